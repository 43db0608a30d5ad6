"""Latency benchmark: time to first token and time per output token at batch 1..N.

Each batch size runs ``batch`` random prompts of ``input_len`` tokens together, each making
exactly ``output_len`` tokens. The hardware limit of a decode step is the bytes it must read
(every weight once, plus each sequence's KV context) over the device's copy bandwidth,
measured in the same run; ``fraction_of_limit`` is that floor over the measured time per token.
A mixture of experts reads only the experts its tokens pick: at batch 1 its active weights,
at batch B the experts that B tokens' random top-k picks are expected to cover.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.peers import load_hf_model, run_hf_generate
from bench.records import machine_info, speculative_counts, utc_now
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.memory import gc_frozen, release_device_memory
from engine.models.arch import ModelArch
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LatencyWorkload:
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    input_len: int = 128
    output_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError("batch sizes must be >= 1")
        if self.input_len < 1 or self.output_len < 2:
            raise ConfigError("input_len must be >= 1 and output_len >= 2")

    def prompts(self, batch: int, vocab_size: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + batch)
        return rng.integers(0, vocab_size, (batch, self.input_len)).tolist()

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        """The untimed run's prompt: the batch-1 prompt reversed. Its shape, but no prefix
        in common with a measured prompt, so the prefix cache cannot shorten a timed prefill
        (as ``bench.workloads.warmup_prompts``)."""
        return [prompt[::-1] for prompt in self.prompts(1, vocab_size)]


def run_latency(
    engine: LLMEngine,
    workload: LatencyWorkload,
    *,
    copy_bytes_per_s: float | None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """The latency record: one result per batch size (see module docstring)."""
    if max(workload.batch_sizes) > engine.config.max_seqs:
        raise ConfigError(f"batch sizes above --max-seqs {engine.config.max_seqs}")
    vocab_size = engine.loaded.arch.vocab_size
    _run_batch(engine, workload.warmup_prompts(vocab_size), workload.output_len)
    results = []
    for batch in tqdm(workload.batch_sizes, desc="latency", unit="batch", disable=not use_tqdm):
        stats_before = engine.stats()
        timings = _run_batch(engine, workload.prompts(batch, vocab_size), workload.output_len)
        stats_after = engine.stats()
        result = _summarize(engine, workload, batch, timings, copy_bytes_per_s)
        result["speculative"] = speculative_counts(stats_before, stats_after)
        # prompt tokens the prefix cache served: 0 unless a batch repeats a prompt
        result["device_hit_tokens"] = (
            stats_after.num_device_hit_tokens - stats_before.num_device_hit_tokens
        )
        results.append(result)
    return {
        "kind": "latency",
        "created_utc": utc_now(),
        "machine": machine_info(engine.device),
        "settings": {
            **dataclasses.asdict(engine.config),
            **dataclasses.asdict(workload),
            "dtype_resolved": str(engine.dtype).removeprefix("torch."),
            "all_reduce": engine.group.sums,  # which path summed (a later engine: NCCL)
        },
        "copy_bytes_per_s": copy_bytes_per_s,
        "weights_bytes": engine.loaded.weights_bytes,
        "cuda_graphs": engine.runner.uses_cuda_graphs,
        "results": results,
    }


def _run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> list[list[float]]:
    """Token arrival times (seconds from the start) of every request."""
    sampling = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    times: dict[str, list[float]] = {}
    start_s = time.perf_counter()
    for index, prompt in enumerate(prompts):
        times[f"lat-{index}"] = []
        engine.add_request(f"lat-{index}", prompt_token_ids=prompt, sampling=sampling)
    with gc_frozen():  # as the worker's engine thread and LLM.generate run
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now_s = time.perf_counter() - start_s
            for out in outputs:
                times[out.request_id] += [now_s] * len(out.new_token_ids)
    return list(times.values())


def _summarize(
    engine: LLMEngine,
    workload: LatencyWorkload,
    batch: int,
    timings: list[list[float]],
    copy_bytes_per_s: float | None,
) -> dict[str, Any]:
    ttft_s = [t[0] for t in timings]
    tpot_s = [(t[-1] - t[0]) / (len(t) - 1) for t in timings]
    elapsed_s = max(t[-1] for t in timings)
    # A decode step reads every weight once and each sequence's context (mean over the run).
    mean_context = workload.input_len + workload.output_len / 2
    weight_bytes = decode_weight_bytes(engine.loaded.arch, engine.loaded.weights_bytes, batch)
    step_bytes = weight_bytes + int(batch * mean_context * engine.kv_cache.spec.bytes_per_token)
    result: dict[str, Any] = {
        "batch": batch,
        "mean_ttft_s": statistics.fmean(ttft_s),
        "p90_ttft_s": float(np.percentile(ttft_s, 90)),
        "mean_tpot_s": statistics.fmean(tpot_s),
        "p90_tpot_s": float(np.percentile(tpot_s, 90)),
        "output_tok_s": batch * workload.output_len / elapsed_s,
        "decode_step_bytes": step_bytes,
    }
    if copy_bytes_per_s:
        limit_s = step_bytes / copy_bytes_per_s
        result["limit_tpot_s"] = limit_s
        result["fraction_of_limit"] = limit_s / result["mean_tpot_s"]
    return result


def decode_weight_bytes(arch: ModelArch, weights_bytes: int, batch: int) -> int:
    """The weight bytes a decode step of ``batch`` tokens reads: all of them for a dense
    model; for a MoE, less the experts no token is expected to pick (uniform routing: each
    expert is missed by all ``batch`` tokens with probability ``(1 - k / E) ** batch``)."""
    moe = arch.moe
    if moe is None:
        return weights_bytes
    missed = moe.num_experts * (1 - moe.top_k / moe.num_experts) ** batch
    per_expert = 3 * arch.hidden_size * moe.intermediate_size * len(moe.sparse_layers)
    unread_fraction = missed * per_expert / arch.num_params
    return int(weights_bytes * (1 - unread_fraction))


def add_hf_peer(record: dict[str, Any], model: str, workload: LatencyWorkload) -> None:
    """transformers' static-batch ``generate`` at each batch size (the engine must be gone)."""
    device = torch.device(record["machine"]["device"])
    dtype = getattr(torch, record["settings"]["dtype_resolved"])
    hf_model = load_hf_model(model, dtype, device)
    vocab_size = hf_model.config.vocab_size
    for result in record["results"]:
        peer = run_hf_generate(
            hf_model, workload.prompts(result["batch"], vocab_size), workload.output_len
        )
        result["hf_generate"] = {
            **peer.as_record(),
            "tpot_s": peer.elapsed_s / workload.output_len,
            "speedup": peer.elapsed_s / workload.output_len / result["mean_tpot_s"],
        }
    del hf_model
    release_device_memory()
