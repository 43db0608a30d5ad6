"""bench/latency.py on the CPU: the warm-up leaves no prompt in the prefix cache that a
measured batch could be served from."""

from __future__ import annotations

from bench.latency import LatencyWorkload, run_latency
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_measured_batches_get_no_prefix_cache_hits_from_the_warm_up() -> None:
    # 40 prompt tokens on 16-token pages: the batch-1 prompt has two full pages to reuse
    engine = LLMEngine(
        EngineConfig(model="dummy:tiny", max_model_len=128, pa_block_size=16, pa_memory_mb=16)
    )
    workload = LatencyWorkload(batch_sizes=(1, 2), input_len=40, output_len=4)
    before = engine.stats()
    record = run_latency(engine, workload, copy_bytes_per_s=None, use_tqdm=False)
    assert engine.stats().num_prefill_tokens - before.num_prefill_tokens == 4 * 40  # warm-up too
    assert [r["device_hit_tokens"] for r in record["results"]] == [0, 0]
