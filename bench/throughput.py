"""Offline throughput benchmark: random token-id prompts through the engine, no Redis.

Prompts are random token ids (no tokenizer needed, so ``dummy:<shape>`` models work), EOS is
ignored and sampling is greedy, so every request produces exactly its drawn output length.
``run_throughput`` returns a JSON-ready record: machine, settings and results.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
from tqdm.auto import tqdm

from bench.jit_compiles import JitCompiles
from bench.kernel_sample import KernelSampler
from bench.records import machine_info, percentiles, speculative_counts
from bench.workloads import (
    NUM_WARMUP_PROMPTS,
    BenchPrompt,
    ThroughputWorkload,
    make_random_prompts,
    warmup_prompts,
)
from engine.errors import ConfigError
from engine.llm import LLM
from engine.llm_engine import EngineStats, LLMEngine
from engine.memory import gc_frozen
from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from engine.step_profile import StepProfiler
from engine.structured import StructuredOutputs

BYTES_PER_GB = 1e9


def run_throughput(
    llm_or_engine: LLM | LLMEngine,
    workload: ThroughputWorkload,
    *,
    use_tqdm: bool = True,
    profile_every: int = 0,
) -> dict[str, Any]:
    """Run every prompt of ``workload`` at once; the benchmark record (see module docstring).

    ``profile_every``: profile about one step in that many (``bench/kernel_sample.py``) and add the
    run's kernel time by category as ``kernel_profile`` (0: none)."""
    engine = llm_or_engine.engine if isinstance(llm_or_engine, LLM) else llm_or_engine
    _check_fits(engine, workload)
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    created_utc = datetime.now(UTC)
    sampler = KernelSampler(profile_every, engine.device) if profile_every else None
    results = _measure(engine, prompts, use_tqdm, workload.num_warmup_prompts, sampler=sampler)
    return {
        "kind": "throughput",
        "created_utc": created_utc.isoformat(timespec="seconds"),
        "machine": machine_info(engine.device),
        "settings": {
            **dataclasses.asdict(engine.config),
            **dataclasses.asdict(workload),
            "resolved": resolved_settings(engine),
        },
        "results": results,
    }


def _check_fits(engine: LLMEngine, workload: ThroughputWorkload) -> None:
    if workload.longest_request_len > engine.max_model_len:
        raise ConfigError(
            f"the longest request ({workload.longest_request_len} tokens) "
            f"exceeds the context of {engine.max_model_len} tokens: lower --input-len / "
            "--output-len or raise --max-model-len"
        )


@dataclass
class _Tally:
    """What the step loop counted over one run."""

    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_steps: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)
    last_s: dict[str, float] = field(default_factory=dict)  # request -> its last token's time
    num_tokens: dict[str, int] = field(default_factory=dict)

    def tpot_s(self) -> list[float]:
        """Each request's time per output token after its first (as a streaming client sees it)."""
        return [
            (self.last_s[rid] - first_s) / (self.num_tokens[rid] - 1)
            for rid, first_s in self.ttft_s.items()
            if self.num_tokens[rid] > 1
        ]


def _measure(
    engine: LLMEngine,
    prompts: list[BenchPrompt],
    use_tqdm: bool,
    num_warmup_prompts: int = NUM_WARMUP_PROMPTS,
    structured: StructuredOutputs | None = None,
    sampler: KernelSampler | None = None,
) -> dict[str, Any]:
    """One timed run of ``prompts`` (each under ``structured`` when given: bench/structured.py;
    about one step in ``sampler.every`` profiled when given)."""
    _warm_up(engine, warmup_prompts(prompts, num_warmup_prompts), structured)
    stats_before = engine.stats()
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.step_profiler = profiler = StepProfiler()  # two device events per step
    with JitCompiles() as builds:
        start_s = time.perf_counter()
        if structured is not None:  # every matcher made at once on threads, as LLM.generate does
            engine.grammars.prebuild([structured] * len(prompts))
        for index, prompt in enumerate(prompts):
            _add(engine, f"bench-{index}", prompt.token_ids, prompt.output_len, structured)
        step = engine.step if sampler is None else sampler.wrapping(engine.step)
        tally = _step_until_done(engine, step, len(prompts), start_s, use_tqdm)
        elapsed_s = time.perf_counter() - start_s
    engine.step_profiler = StepProfiler(enabled=False)
    num_input_tokens = sum(len(p.token_ids) for p in prompts)
    weights_bytes = engine.loaded.weights_bytes
    profiled = {} if sampler is None else {"kernel_profile": sampler.summary()}
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(prompts),
        "input_tokens": num_input_tokens,
        "output_tokens": tally.num_output_tokens,
        "output_tok_s": tally.num_output_tokens / elapsed_s,
        "total_tok_s": (num_input_tokens + tally.num_output_tokens) / elapsed_s,
        "mean_ttft_s": sum(tally.ttft_s.values()) / max(len(tally.ttft_s), 1),
        "tpot_s": percentiles(tally.tpot_s()),
        "num_preemptions": engine.stats().num_preemptions - stats_before.num_preemptions,
        # Of this run's prompt tokens (the engine's own rate counts its whole life).
        "prefix_hit_rate": tally.num_cached_prompt_tokens / num_input_tokens,
        "prefix_cache": prefix_cache_counts(stats_before, engine.stats()),
        "num_steps": tally.num_steps,
        # Each step reads every weight once: a floor on the memory bandwidth achieved.
        "weights_bytes": weights_bytes,
        "weights_gb_s": weights_bytes * tally.num_steps / elapsed_s / BYTES_PER_GB,
        "peak_memory_bytes": _peak_memory_bytes(engine.device),
        # per step kind: host and GPU milliseconds, and how busy the GPU was overall
        "step_profile": profiler.summary(elapsed_s),
        # speculative decoding (random prompts give prompt lookup little to find)
        "speculative": speculative_counts(stats_before, engine.stats()),
        # Triton kernels built inside the timed run (this process), which its time includes
        "jit_compiles": builds.summary(),
        **profiled,
    }


def prefix_cache_counts(before: EngineStats, after: EngineStats) -> dict[str, int]:
    """What the prefix cache's tiers did between two readings of the engine's stats."""
    return {
        "device_hit_tokens": after.num_device_hit_tokens - before.num_device_hit_tokens,
        "host_hit_tokens": after.num_host_hit_tokens - before.num_host_hit_tokens,
        "deferred_admissions": after.num_deferred_admissions - before.num_deferred_admissions,
        "offloaded_pages": after.num_offloaded_pages - before.num_offloaded_pages,
        "offload_evictions": after.num_offload_evictions - before.num_offload_evictions,
    }


def _warm_up(
    engine: LLMEngine, prompts: list[BenchPrompt], structured: StructuredOutputs | None = None
) -> None:
    for index, prompt in enumerate(prompts):
        _add(engine, f"warmup-{index}", prompt.token_ids, prompt.output_len, structured)
    while engine.has_unfinished_requests():
        engine.step()


def _add(
    engine: LLMEngine,
    request_id: str,
    token_ids: list[int],
    output_len: int,
    structured: StructuredOutputs | None = None,
) -> None:
    sampling = SamplingParams(
        temperature=0, max_tokens=output_len, ignore_eos=True, structured=structured
    )
    engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling)


def _step_until_done(
    engine: LLMEngine,
    step: Callable[[], list[StepOutput]],
    num_requests: int,
    start_s: float,
    use_tqdm: bool,
) -> _Tally:
    tally = _Tally()
    with (
        tqdm(total=num_requests, disable=not use_tqdm, desc="throughput", unit="req") as bar,
        gc_frozen(),  # as the worker's engine thread and LLM.generate run
    ):
        while engine.has_unfinished_requests():
            step_outputs = step()
            now_s = time.perf_counter()
            tally.num_steps += 1
            for out in step_outputs:
                tally.num_output_tokens += len(out.new_token_ids)
                if out.new_token_ids:
                    tally.ttft_s.setdefault(out.request_id, now_s - start_s)
                    tally.last_s[out.request_id] = now_s - start_s
                    count = tally.num_tokens.get(out.request_id, 0)
                    tally.num_tokens[out.request_id] = count + len(out.new_token_ids)
                if out.usage is not None:
                    tally.num_cached_prompt_tokens += out.usage.cached_prompt_tokens
                bar.update(int(out.finished))
            rate = tally.num_output_tokens / (now_s - start_s)
            bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
    return tally


def _peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None  # the CPU has no allocator statistics worth reporting


def resolved_settings(engine: LLMEngine) -> dict[str, Any]:
    """What ``auto`` and unset settings became on this machine."""
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "paged_attention": engine.config.use_paged_attention(),
        "prefill_attention": engine.prefill_attention,
        "cuda_graphs": engine.runner.uses_cuda_graphs,
        "tensor_parallel_size": engine.group.size,
        "all_reduce": engine.group.sums,  # which path summed (a later engine: NCCL)
        "num_kv_pages": engine.kv_cache.num_blocks,
        "num_offload_pages": engine.kv_cache.offload_pages.shape[0],  # host prefix tier
        "kv_page_tokens": engine.kv_cache.spec.block_size,
        "kv_pool_source": engine.pool_source,
        "sampler_seed": engine.config.seed,  # "seed" above is the workload's
    }


def format_results(results: dict[str, Any]) -> str:
    """The headline numbers as a two-column table."""
    rows = [
        ("requests", f"{results['num_requests']}"),
        ("input tokens", f"{results['input_tokens']}"),
        ("output tokens", f"{results['output_tokens']}"),
        ("elapsed s", f"{results['elapsed_s']:.2f}"),
        ("output tok/s", f"{results['output_tok_s']:.1f}"),
        ("total tok/s", f"{results['total_tok_s']:.1f}"),
        ("mean TTFT s", f"{results['mean_ttft_s']:.3f}"),
        ("preemptions", f"{results['num_preemptions']}"),
    ]
    builds = results.get("jit_compiles")
    if builds and builds["count"]:  # the run's time includes them
        rows.append(("Triton builds", f"{builds['count']} ({builds['seconds']:.2f} s)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>12}" for name, value in rows)
