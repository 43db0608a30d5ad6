"""Baselines for the throughput benchmark, measured in the same process on the same prompts.

``paged-off``: the engine itself with ``--paged-attn off`` (one contiguous slot of the
longest request per sequence). ``hf``: transformers' continuous batching (``generate_batch``,
sdpa) with ``max_new_tokens`` set to the mean of the drawn output lengths, since one call takes
one length for all prompts. ``vllm``: vLLM's offline API on the same prompts in a subprocess
(``bench/vllm_peer.py``), run before the engine loads. Each adds its results and ``ratio`` (the engine's output tok/s over
the baseline's) to the record under ``baselines``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.peers import load_hf_model, run_hf_generate_batch
from bench.throughput import run_throughput
from bench.workloads import ThroughputWorkload, make_random_prompts
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.memory import release_device_memory

BASELINES = ("paged-off", "hf", "vllm")


def run_with_baselines(
    config: EngineConfig,
    workload: ThroughputWorkload,
    baselines: tuple[str, ...],
    *,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """The engine's throughput record, then each baseline's, one model in memory at a time."""
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ConfigError(f"unknown baseline(s) {sorted(unknown)}; choose from {BASELINES}")
    vllm = None
    if "vllm" in baselines:  # first, on an empty GPU, in its own process
        from bench.vllm_peer import run_vllm_peer, throughput_peer_args

        vllm = run_vllm_peer("throughput", throughput_peer_args(config, [workload]))
    engine = LLMEngine(config)
    record = run_throughput(engine, workload, use_tqdm=use_tqdm)
    vocab_size, dtype, device = engine.loaded.arch.vocab_size, engine.dtype, engine.device
    engine.shutdown()  # its tensor-parallel ranks, if any: the next engine starts its own
    del engine
    release_device_memory()
    ours = record["results"]["output_tok_s"]
    record["baselines"] = {}
    if vllm is not None:
        theirs = {**vllm["results"][0], **{k: v for k, v in vllm.items() if k != "results"}}
        record["baselines"]["vllm"] = {**theirs, "ratio": ours / theirs["output_tok_s"]}
    if "paged-off" in baselines:
        off = _paged_off(config, workload, use_tqdm)
        record["baselines"]["paged_off"] = {**off, "ratio": ours / off["output_tok_s"]}
    if "hf" in baselines:
        prompts = make_random_prompts(workload, vocab_size)
        max_new_tokens = round(sum(p.output_len for p in prompts) / len(prompts))
        hf_model = load_hf_model(config.model, dtype, device)
        peer = run_hf_generate_batch(hf_model, [p.token_ids for p in prompts], max_new_tokens)
        del hf_model
        release_device_memory()
        record["baselines"]["hf_generate_batch"] = {
            **peer.as_record(),
            "ratio": ours / peer.output_tok_s,
        }
    return record


def _paged_off(
    config: EngineConfig, workload: ThroughputWorkload, use_tqdm: bool
) -> dict[str, Any]:
    # A contiguous slot per sequence as long as the longest request, not the model's context.
    longest = workload.input_len[1] + workload.output_len[1]
    off_config = dataclasses.replace(
        config, paged_attn="off", max_model_len=config.max_model_len or longest
    )
    engine = LLMEngine(off_config)
    record = run_throughput(engine, workload, use_tqdm=use_tqdm)
    engine.shutdown()
    del engine
    release_device_memory()
    results: dict[str, Any] = record["results"]
    results["settings"] = {"paged_attn": "off", "max_model_len": off_config.max_model_len}
    return results
