"""The step profile: steps sorted by kind, host time against waiting, one record per step."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from engine.step_profile import StepProfiler, step_kind
from tests.conftest import random_prompts


def test_step_kinds() -> None:
    assert step_kind([]) is None
    assert step_kind([1, 1, 1]) == "decode"
    assert step_kind([1, 40]) == "mixed"
    assert step_kind([40, 7]) == "prefill"
    assert step_kind([1, 4, 5], num_verify_rows=2) == "verify"  # decodes with drafts
    assert step_kind([4, 40], num_verify_rows=1) == "mixed"


def test_profile_of_a_run_has_every_kind_and_adds_up(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dirs["llama"]), device="cpu", max_seqs=4, max_batched_tokens=48,
              prefill_chunk=32)  # fmt: skip
    engine = llm.engine
    engine.step_profiler = profiler = StepProfiler()
    prompts = random_prompts([45, 7, 30, 19, 60], 320, seed=3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    summary = profiler.summary(elapsed_s=1.0)
    assert set(summary) == {"decode", "mixed", "prefill"}  # no GPU: no busy fraction
    assert sum(kind["steps"] for kind in summary.values()) == engine.stats().num_steps
    assert summary["decode"]["tokens_per_step"] <= 4
    for kind in summary.values():
        assert 0 < kind["host_ms"]["mean"] <= kind["wall_ms"]["mean"]
        assert "gpu_ms" not in kind


def test_a_disabled_profiler_records_nothing(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dirs["llama"]), device="cpu")
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert not llm.engine.step_profiler.enabled and llm.engine.step_profiler.steps == []
