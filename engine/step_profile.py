"""Where a step's time goes, by step type: host work against GPU work.

A benchmark turns it on (``LLMEngine.step_profiler``); each step then records its wall time,
the time the host spent waiting for the device, and on CUDA the device time between two
events around the step's launch (what the forward and sampling took on the GPU, without the
queueing in front of them). The host's own work is the wall time less the waiting. With
asynchronous scheduling the GPU should be busy nearly all the time: ``gpu_busy_fraction``
says how much of the run it was.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq

STEP_KINDS = ("decode", "verify", "mixed", "prefill")


def step_kind(num_new_tokens: list[int], num_verify_rows: int = 0) -> str | None:
    """``decode`` (one token per row), ``verify`` (decode rows, some of them with draft
    tokens), ``prefill`` (chunks only), ``mixed``, or None (empty). ``num_verify_rows``: rows
    whose tokens are a decode's one and its drafts."""
    if not num_new_tokens:
        return None
    num_decodes = sum(1 for n in num_new_tokens if n == 1) + num_verify_rows
    if num_decodes == len(num_new_tokens):
        return "verify" if num_verify_rows else "decode"
    return "mixed" if num_decodes else "prefill"


@dataclass
class _Step:
    kind: str
    num_tokens: int
    wall_s: float
    wait_s: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None


@dataclass
class StepProfiler:
    """Collects one record per step; ``summary`` reduces them per step kind. Disabled (the
    engine's default) it records nothing and costs a branch per call."""

    enabled: bool = True
    steps: list[_Step] = field(default_factory=list)
    _start_s: float = 0.0
    _wait_s: float = 0.0
    _events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def begin_step(self) -> None:
        if self.enabled:
            self._start_s, self._wait_s, self._events = time.perf_counter(), 0.0, None

    def before_launch(self, device: torch.device) -> None:
        if self.enabled and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)

    def after_launch(self) -> None:
        if self._events is not None:
            self._events[1].record()

    def add_wait(self, wait_s: float) -> None:
        self._wait_s += wait_s

    def end_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Record the step that ran ``scheduled`` (nothing when disabled: no per-step lists)."""
        if not self.enabled:
            return
        num_new_tokens = [entry.num_new_tokens for entry in scheduled]
        num_verify_rows = sum(1 for entry in scheduled if entry.draft_token_ids)
        kind = step_kind(num_new_tokens, num_verify_rows)
        if kind is None:
            return
        wall_s = time.perf_counter() - self._start_s
        self.steps.append(_Step(kind, sum(num_new_tokens), wall_s, self._wait_s, self._events))

    def summary(self, elapsed_s: float | None = None) -> dict[str, Any]:
        """Per kind: steps, tokens, and p50/mean of wall, host and GPU milliseconds."""
        if self.steps and self.steps[-1].events is not None:
            torch.cuda.synchronize()  # the last step's end event
        by_kind: dict[str, list[_Step]] = defaultdict(list)
        for step in self.steps:
            by_kind[step.kind].append(step)
        out: dict[str, Any] = {kind: _kind_summary(steps) for kind, steps in by_kind.items()}
        gpu_ms = [_gpu_ms(step) for step in self.steps]
        if elapsed_s and all(ms is not None for ms in gpu_ms):
            out["gpu_busy_fraction"] = sum(ms or 0.0 for ms in gpu_ms) / 1e3 / elapsed_s
        return out


def _gpu_ms(step: _Step) -> float | None:
    return None if step.events is None else step.events[0].elapsed_time(step.events[1])


def _kind_summary(steps: list[_Step]) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"p50": statistics.median(values), "mean": statistics.fmean(values)}

    summary: dict[str, Any] = {
        "steps": len(steps),
        "tokens_per_step": statistics.fmean(step.num_tokens for step in steps),
        "wall_ms": stats([1e3 * step.wall_s for step in steps]),
        "host_ms": stats([1e3 * (step.wall_s - step.wait_s) for step in steps]),
    }
    gpu = [_gpu_ms(step) for step in steps]
    if all(ms is not None for ms in gpu):
        summary["gpu_ms"] = stats([ms or 0.0 for ms in gpu])
    return summary
