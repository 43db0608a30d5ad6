"""Where the decode steps of a running batch spend their device time, op by op: a short
``torch.profiler`` window over ``steps`` engine steps, once the batch is past its prefill.

``bench.structured --profile-steps N`` runs it on the same batch unconstrained and under the
JSON schema, so the record shows what a constrained step adds on the GPU (the bitmask's copy,
the mask kernel, the sampling outside the decode graph) where the step timings only show that
it adds. On the CPU (tests) the ops are the CPU's.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import SamplingParams, StructuredOutputs
from engine.llm_engine import LLMEngine
from engine.memory import gc_frozen

TOP_OPS = 25  # rows kept per profile


def profile_decode_steps(
    engine: LLMEngine,
    prompts: list[list[int]],
    steps: int,
    structured: StructuredOutputs | None = None,
    max_warmup_steps: int = 200,
) -> dict[str, Any]:
    """Profile ``steps`` steps of ``prompts`` decoding together (each under ``structured``
    when given), once every one of them has its first token (its prefill done, within
    ``max_warmup_steps``); then the batch is aborted. Returns the ops by device time (CPU
    time on the CPU), per step."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.device.type == "cuda"
    sampling = SamplingParams(
        temperature=0, max_tokens=max_warmup_steps + steps, ignore_eos=True, structured=structured
    )
    ids = [f"profile-{index}" for index in range(len(prompts))]
    for request_id, token_ids in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with gc_frozen():
        started: set[str] = set()
        for _ in range(max_warmup_steps):
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
            if len(started) == len(ids):
                break
        engine.step()  # the step in flight, if any, resolved: decode steps from here
        if on_cuda:
            torch.cuda.synchronize(engine.device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if on_cuda:
                torch.cuda.synchronize(engine.device)
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    return {
        "steps": steps,
        "rows": len(prompts),
        "time": "device" if on_cuda else "cpu",
        "ops": _top_ops(prof.key_averages(), steps, on_cuda),
    }


def _top_ops(averages: Any, steps: int, on_cuda: bool) -> list[dict[str, Any]]:
    """The ops with the most self time (device or CPU), in microseconds per step."""
    rows = []
    for event in averages:
        if on_cuda:  # torch renamed cuda_* to device_* (2.4); both stand in some releases
            self_us = getattr(event, "self_device_time_total", None)
            if self_us is None:
                self_us = event.self_cuda_time_total
        else:
            self_us = event.self_cpu_time_total
        if self_us > 0:
            rows.append(
                {
                    "name": event.key,
                    "us_per_step": self_us / steps,
                    "calls_per_step": event.count / steps,
                }
            )
    rows.sort(key=lambda row: -row["us_per_step"])
    return rows[:TOP_OPS]


def format_profile(name: str, profile: dict[str, Any], limit: int = 12) -> str:
    """A few lines: the op, its time per step, its calls per step."""
    total = sum(row["us_per_step"] for row in profile["ops"])
    lines = [f"{name}: {profile['rows']} rows, {profile['steps']} steps, "
             f"top ops {total:.0f} us of {profile['time']} time a step"]  # fmt: skip
    for row in profile["ops"][:limit]:
        lines.append(
            f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:<5.1f} {row['name'][:90]}"
        )
    return "\n".join(lines)
