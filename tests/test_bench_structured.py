"""bench/structured.py's engine side on the CPU: the constrained run takes prompts of its own
(the unconstrained run's are in the prefix cache), fills masks, and makes the same tokens count."""

from __future__ import annotations

from pathlib import Path

from bench.structured import _engine_runs
from bench.workloads import ThroughputWorkload, make_random_prompts
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_the_constrained_run_finds_nothing_of_the_free_run_in_the_cache(
    smollm2_vocab_model: Path,
) -> None:
    engine = LLMEngine(EngineConfig(model=str(smollm2_vocab_model), max_model_len=256))
    workload = ThroughputWorkload(num_prompts=3, input_len=(40, 48), output_len=(6, 6))
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    free, constrained = _engine_runs(engine, prompts)
    assert free["output_tokens"] == constrained["output_tokens"] == 18
    assert constrained["prefix_hit_rate"] == 0.0
    assert constrained["mask_fill_ms_per_step"] > 0
    assert constrained["mask_wait_ms_per_step"] > 0
