"""bench/structured.py's engine side on the CPU: the constrained run takes prompts of its own
(the unconstrained run's are in the prefix cache), fills masks, and makes the same tokens count."""

from __future__ import annotations

from pathlib import Path

from bench.structured import _engine_runs
from bench.workloads import ThroughputWorkload, make_random_prompts
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_no_run_finds_an_earlier_runs_prompts_in_the_cache(smollm2_vocab_model: Path) -> None:
    """Two pairs (``--repeat 2``): every run, the second pair's too, prefills all of its
    prompts, and each constrained run fills masks."""
    engine = LLMEngine(EngineConfig(model=str(smollm2_vocab_model), max_model_len=256))
    workload = ThroughputWorkload(num_prompts=3, input_len=(40, 48), output_len=(6, 6))
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    pairs = _engine_runs(engine, prompts, repeat=2)
    assert len(pairs) == 2
    for free, constrained in pairs:
        assert free["output_tokens"] == constrained["output_tokens"] == 18
        assert free["prefix_hit_rate"] == constrained["prefix_hit_rate"] == 0.0
        assert constrained["mask_fill_ms_per_step"] > 0
        assert constrained["mask_wait_ms_per_step"] > 0


def test_a_decode_window_is_profiled_op_by_op_then_the_batch_is_gone(
    smollm2_vocab_model: Path,
) -> None:
    """``--profile-steps``: the ops of a few decode steps, per step; the constrained
    window's include the mask's work, and nothing of either batch stays in the engine."""
    import json

    from bench.step_kernels import format_profile, profile_decode_steps
    from bench.structured import LONG_SCHEMA
    from engine import StructuredOutputs

    engine = LLMEngine(EngineConfig(model=str(smollm2_vocab_model), max_model_len=256))
    prompts = [[5 + i, 17, 23, 42, 7] * 4 for i in range(3)]
    free = profile_decode_steps(engine, prompts, steps=2)
    schema = StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA))
    constrained = profile_decode_steps(engine, prompts, steps=2, structured=schema)
    assert not engine.has_unfinished_requests()
    for profile in (free, constrained):
        assert profile["steps"] == 2 and profile["rows"] == 3 and profile["time"] == "cpu"
        assert profile["ops"] and all(op["us_per_step"] > 0 for op in profile["ops"])
    assert format_profile("json_schema", constrained).startswith("json_schema: 3 rows, 2 steps")
    free_ops = {op["name"] for op in free["ops"]}
    # the reference mask on the CPU: -inf where a bit is clear
    assert "aten::masked_fill_" in {op["name"] for op in constrained["ops"]} - free_ops
