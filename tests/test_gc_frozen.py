"""Serving loops keep the objects alive at their start out of the garbage collector's walk
(``engine.memory.gc_frozen``), and hand them back when the loop ends."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.memory import GC_FREEZE_ENV, gc_frozen


def test_the_block_freezes_then_hands_the_objects_back() -> None:
    assert gc.get_freeze_count() == 0
    alive = [object(), [1, 2]]
    with gc_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_frozen():  # nested: the outer freeze stands, nothing frozen twice
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
    assert any(obj is alive for obj in gc.get_objects())  # tracked again


def test_a_failure_inside_still_hands_them_back() -> None:
    with pytest.raises(RuntimeError), gc_frozen():
        raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0


def test_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    with gc_frozen():
        assert gc.get_freeze_count() == 0


def test_generate_steps_with_the_engine_frozen_and_ends_thawed(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model_dirs["llama"]), device="cpu", max_model_len=64)
    counts: list[int] = []
    step = llm.engine.step

    def counting_step(*args: object, **kwargs: object) -> object:
        counts.append(gc.get_freeze_count())
        return step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm.engine, "step", counting_step)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert counts and min(counts) > 0  # every step ran with the startup objects frozen
    assert gc.get_freeze_count() == 0


def test_the_pause_bench_records_each_generation_frozen_and_not(
    tiny_model_dirs: dict[str, Path],
) -> None:
    from bench.gc_pauses import run_once

    llm = LLM(str(tiny_model_dirs["llama"]), device="cpu", max_model_len=64)
    rows = [run_once(llm, num_prompts=4, output_len=8, frozen=frozen) for frozen in (False, True)]
    assert [row["frozen"] for row in rows] == [False, True]
    for row in rows:
        assert set(row["pauses"]) == {"gen0", "gen1", "gen2"} and row["tracked_objects"] > 0
        assert all(p["total_ms"] >= p["max_ms"] >= 0 for p in row["pauses"].values())
    assert gc.get_freeze_count() == 0
