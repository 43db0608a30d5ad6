"""Where the decode steps of a running batch spend their device time, op by op: a short
``torch.profiler`` window over ``steps`` engine steps, once the batch is past its prefill.

``bench.structured --profile-steps N`` runs it on the same batch unconstrained and under the
JSON schema, so the record shows what a constrained step adds on the GPU (the bitmask's copy,
the mask kernel, the sampling outside the decode graph) where the step timings only show that
it adds. On CUDA the rows are kernels, copies and sets only (``kernel_sample.kernel_times``:
an op beside its own kernels would count them twice, and a PDL launch's wait in its
predecessor once more); on the CPU (tests) they are the CPU ops' self times.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from bench.kernel_sample import kernel_times
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
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with gc_frozen():
        started: set[str] = set()
        for _ in range(max_warmup_steps):
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
            if len(started) == len(ids):
                break
        engine.step()  # the step in flight, if any, resolved: decode steps from here
        if on_cuda:
            torch.cuda.synchronize(engine.device)
        with profile(activities=[activity]) as prof:
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
        "ops": _top_ops(kernel_times(prof, on_cuda), steps),
    }


def _top_ops(times: list[tuple[str, float, int]], steps: int) -> list[dict[str, Any]]:
    """The kernels (ops on the CPU) with the most time, in microseconds per step."""
    us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for name, elapsed_us, count in times:
        us[name] += elapsed_us
        calls[name] += count
    top = sorted((item for item in us.items() if item[1] > 0), key=lambda item: -item[1])
    return [
        {"name": name, "us_per_step": total / steps, "calls_per_step": calls[name] / steps}
        for name, total in top[:TOP_OPS]
    ]


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
