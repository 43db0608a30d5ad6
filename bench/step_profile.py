"""Where an engine step's time goes: the throughput workload with timers around each stage.

    python bench/step_profile.py dummy:qwen3-0.6b --num-prompts 256 [--setting max_model_len=2048]

Each stage is timed between device synchronizations, so the stages add up to the step (and
the run is slower than ``pagestream bench throughput``, which does not synchronize).
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.workloads import ThroughputWorkload, make_random_prompts
from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig

STAGES = ("schedule", "prepare_inputs", "forward", "sample")


def timed(totals: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start_s = time.perf_counter()
        result = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        totals[key] += time.perf_counter() - start_s
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    settings: dict[str, Any] = {
        k: int(v) if v.isdigit() else v for k, v in (s.split("=") for s in args.setting)
    }
    engine = LLMEngine(EngineConfig(model=args.model, **settings))
    totals: dict[str, float] = collections.defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    runner = engine.runner
    runner.prepare_inputs = timed(totals, "prepare_inputs", runner.prepare_inputs)  # type: ignore[method-assign]
    runner._logits = timed(totals, "forward", runner._logits)  # type: ignore[method-assign]
    runner.sampler.sample = timed(totals, "sample", runner.sampler.sample)  # type: ignore[method-assign]
    runner.sampler.greedy = timed(totals, "sample", runner.sampler.greedy)  # type: ignore[method-assign]
    workload = ThroughputWorkload(num_prompts=args.num_prompts)
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    for index, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=0, max_tokens=prompt.output_len, ignore_eos=True)
        engine.add_request(f"p{index}", prompt_token_ids=prompt.token_ids, sampling=sampling)
    start_s, num_steps, num_tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
        num_steps += 1
    elapsed_s = time.perf_counter() - start_s
    print(f"{num_steps} steps, {elapsed_s:.2f} s, {num_tokens / elapsed_s:.0f} output tok/s")
    for stage in STAGES:
        print(
            f"  {stage:15s} {totals[stage]:6.2f} s  {1e3 * totals[stage] / num_steps:6.3f} ms/step"
        )
    rest_s = elapsed_s - sum(totals.values())
    print(f"  {'the rest':15s} {rest_s:6.2f} s  {1e3 * rest_s / num_steps:6.3f} ms/step")


if __name__ == "__main__":
    main()
