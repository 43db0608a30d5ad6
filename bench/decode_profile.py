"""Where a decode step's time goes on the GPU: rank 0's kernels during greedy decoding of a
batch, under the torch profiler (CUDA graph replays included).

    python -m bench.decode_profile dummy:llama3-8b --batch 1 --tensor-parallel-size 2 \\
        --output-json OUT.json [--trace OUT.trace.json]

The record has the wall time per output token, the GPU's busy time per token (the union of
kernel intervals: what is left is the GPU waiting on the host or on launches), the kernels
per token, and the kernels that take the most time, by name, per token.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.records import machine_info, save, utc_now
from bench.workloads import ThroughputWorkload, make_random_prompts
from engine import LLM, SamplingParams

TOP_KERNELS = 25


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > end_so_far:
            total += end - max(start, end_so_far)
            end_so_far = end
    return total


def kernel_events(prof: Any) -> list[Any]:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def summarize(events: list[Any], num_tokens: int) -> dict[str, Any]:
    by_name: dict[str, list[float]] = defaultdict(list)
    intervals = []
    for event in events:
        start = event.time_range.start
        end = event.time_range.end
        intervals.append((start, end))
        by_name[event.name].append(end - start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {
        "gpu_busy_us_per_token": busy_us(intervals) / num_tokens,
        "kernels_per_token": len(events) / num_tokens,
        "kernel_us_per_token": sum(end - start for start, end in intervals) / num_tokens,
        "top_kernels": [
            {"name": name[:160], "us_per_token": sum(times) / num_tokens, "calls": len(times)}
            for name, times in top
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    args = parser.parse_args(argv)
    workload = ThroughputWorkload(
        num_prompts=args.batch,
        input_len=(args.input_len, args.input_len),
        output_len=(args.output_len, args.output_len),
    )
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
    )
    prompts = make_random_prompts(workload, llm.engine.loaded.arch.vocab_size)
    token_ids = [p.token_ids for p in prompts]
    sampling = SamplingParams(
        temperature=0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True
    )
    llm.generate(token_ids, sampling, use_tqdm=False)  # warm up
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities) as prof:
        start_s = time.perf_counter()
        llm.generate(token_ids, sampling, use_tqdm=False)
        if on_cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start_s
    steps = args.output_len  # one decode step per output token (the first is the prefill's)
    results: dict[str, Any] = {
        "wall_us_per_token": wall_s * 1e6 / steps,
        **summarize(kernel_events(prof), steps),
    }
    record = {
        "kind": "decode-profile",
        "created_utc": utc_now(),
        "machine": machine_info("cuda" if on_cuda else "cpu"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output_json", "trace")},
        "results": results,
    }
    print(f"wall {results['wall_us_per_token']:.0f} us/token, GPU busy "
          f"{results['gpu_busy_us_per_token']:.0f}, kernels {results['kernels_per_token']:.0f}/token")  # fmt: skip
    for row in results["top_kernels"]:
        print(f"  {row['us_per_token']:8.1f} us  {row['calls'] / steps:5.1f}x  {row['name'][:100]}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    llm.shutdown()
    save(record, args.output_json)


if __name__ == "__main__":
    main()
