"""Priority preemption (issue 31, item 3): when the pool is full, a waiting request that
outranks running ones (a lower ``priority`` value, as in vLLM) preempts the lowest-priority,
newest of them and runs; equal priorities keep arrival order. Greedy outputs stay those of
transformers: preemption decides when a sequence runs, never what it produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import FinishReason
from engine.sequence import SequenceStatus
from tests.conftest import hf_greedy, random_prompts
from tests.test_engine_behaviour import VOCAB_SIZE, Driver, greedy, make_engine

# A pool of 8 pages of 16 tokens: three low-priority prompts of 20 tokens hold 6 of them.
POOL = dict(pa_block_size=16, pa_context_len=128, max_model_len=128, swap_space_mb=8)
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_an_urgent_request_preempts_the_lowest_priority_newest_running_one(
    preemption: str, llama_dir: Path
) -> None:
    low_ids = ["low-old", "low-mid", "low-new"]
    prompts = random_prompts([20, 20, 20, 40], VOCAB_SIZE, seed=31)
    driver = Driver(make_engine(llama_dir, preemption=preemption, **POOL))
    engine = driver.engine
    for rid, prompt in zip(low_ids, prompts, strict=False):
        driver.add(rid, prompt, greedy(NUM_TOKENS), priority=1)
    driver.step()
    driver.step()
    lows = {rid: engine.sequence(rid) for rid in low_ids}
    assert all(s is not None and s.status is SequenceStatus.RUNNING for s in lows.values())
    assert engine.block_manager.num_free_blocks == 2  # the urgent prompt needs 3 pages
    driver.add("urgent", prompts[3], greedy(NUM_TOKENS), priority=0)
    driver.step()
    urgent = engine.sequence("urgent")
    assert urgent is not None and urgent.status is SequenceStatus.RUNNING
    assert {rid for rid, s in lows.items() if s and s.num_preemptions} == {"low-new"}
    engine.block_manager.check_invariants(engine.scheduler.running)
    driver.run()
    streams = driver.streams
    assert streams["urgent"].finish_step is not None and streams["low-new"].finish_step is not None
    assert streams["urgent"].finish_step < streams["low-new"].finish_step
    assert urgent.num_preemptions == 0
    assert engine.stats().num_preemptions >= 1
    ids = [*low_ids, "urgent"]
    assert driver.tokens(ids) == hf_greedy(llama_dir, prompts, NUM_TOKENS)
    assert all(streams[rid].finish_reason == FinishReason.LENGTH for rid in ids)


def test_a_request_of_equal_priority_waits_for_pages_instead_of_preempting(
    llama_dir: Path,
) -> None:
    prompts = random_prompts([20, 20, 20, 40], VOCAB_SIZE, seed=31)
    driver = Driver(make_engine(llama_dir, **POOL))
    engine = driver.engine
    for i, prompt in enumerate(prompts[:3]):
        driver.add(f"low-{i}", prompt, greedy(NUM_TOKENS), priority=1)
    driver.step()
    driver.step()
    driver.add("late", prompts[3], greedy(NUM_TOKENS), priority=1)
    driver.step()
    late = engine.sequence("late")
    assert late is not None and late.status is SequenceStatus.WAITING
    assert engine.scheduler.num_preemptions == 0
    driver.run()
    assert driver.tokens(["low-0", "low-1", "low-2", "late"]) == hf_greedy(
        llama_dir, prompts, NUM_TOKENS
    )


def test_max_seqs_full_an_urgent_request_takes_a_lower_ones_slot(llama_dir: Path) -> None:
    prompts = random_prompts([8, 9], VOCAB_SIZE, seed=32)
    driver = Driver(make_engine(llama_dir, max_seqs=1))
    driver.add("low", prompts[0], greedy(8), priority=2)
    driver.step()
    driver.add("urgent", prompts[1], greedy(8), priority=0)
    driver.run()
    streams = driver.streams
    assert streams["urgent"].finish_step is not None and streams["low"].finish_step is not None
    assert streams["urgent"].finish_step < streams["low"].finish_step
    assert driver.tokens(["low", "urgent"]) == hf_greedy(llama_dir, prompts, 8)
