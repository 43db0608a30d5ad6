"""Asynchronous scheduling changes no token.

With ``async_scheduling`` the engine schedules and launches step N+1 before it has seen step
N's picks: decode inputs come from the device, a row may be spent on a sequence that step N
ends, and outputs arrive one step later. On the CPU nothing overlaps, but the bookkeeping is
the same as on a GPU, so these tests compare it with the synchronous engine, output for output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.llm import RequestOutput
from tests.conftest import random_prompts

SETTINGS = dict(device="cpu", pa_block_size=16, max_seqs=4, max_batched_tokens=48, prefill_chunk=32)


def run_both(
    model: Path, prompts: list[Any], params: list[SamplingParams], **settings: Any
) -> tuple[list[RequestOutput], list[RequestOutput], LLM]:
    """(async outputs, sync outputs, the async LLM) for the same prompts and settings."""
    results = []
    for mode in (True, False):
        llm = LLM(str(model), async_scheduling=mode, **{**SETTINGS, **settings})
        results.append((llm.generate(prompts, params, use_tqdm=False), llm))
    (fast, fast_llm), (plain, _) = results
    return fast, plain, fast_llm


def summary(outputs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    """Everything but logprob values, which may differ in the last bits: a row spent on a
    sequence that just ended changes the batch's shape, and so the matmul's rounding."""
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.usage, _logprob_ids(o))
        for o in outputs
    ]


def _logprob_ids(out: RequestOutput) -> list[Any]:
    return [None if lp is None else (lp.token_id, [t for t, _ in lp.top]) for lp in out.logprobs]


def _logprob_values(outputs: list[RequestOutput]) -> list[float]:
    return [
        v for o in outputs for lp in o.logprobs if lp for v in (lp.logprob, *dict(lp.top).values())
    ]


@pytest.fixture(scope="module")
def llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


def test_greedy_mixed_steps_and_lengths(llama: Path) -> None:
    prompts = random_prompts([45, 7, 30, 19, 60, 3], 320, seed=31)
    prompts.append([*prompts[0][:40], 1, 2])  # a prefix-cache hit
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 5, 12, 2, 9, 7, 4)]
    fast, plain, llm = run_both(llama, prompts, params)
    assert summary(fast) == summary(plain)
    assert [o.usage.completion_tokens for o in fast if o.usage] == [1, 5, 12, 2, 9, 7, 4]
    engine = llm.engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_seeded_sampling_with_logprobs(llama: Path) -> None:
    prompts = random_prompts([20, 33, 9, 41], 320, seed=32)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=10, logprobs=3)
        for seed in (1, 2, 3, 4)
    ]
    fast, plain, _ = run_both(llama, prompts, params)
    assert summary(fast) == summary(plain)
    assert _logprob_values(fast) == pytest.approx(_logprob_values(plain), abs=1e-5)
    assert all(o.logprobs[0] is not None for o in fast)


def test_penalties_see_every_earlier_token(llama: Path) -> None:
    prompts = random_prompts([12, 25, 30], 320, seed=33)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12),
        SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.7, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12),  # beside them, a plain greedy row
    ]
    fast, plain, _ = run_both(llama, prompts, params)
    assert summary(fast) == summary(plain)


def test_stop_tokens_end_rows_that_were_already_scheduled_again(llama: Path) -> None:
    prompts = random_prompts([15, 22, 37], 320, seed=34)
    free = LLM(str(llama), async_scheduling=False, **SETTINGS).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )
    # stop each at its 4th token: the async engine has the 5th step launched by then
    params = [
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[out.token_ids[3]])
        for out in free
    ]
    fast, plain, llm = run_both(llama, prompts, params)
    assert summary(fast) == summary(plain)
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 4 for o in fast)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_stop_strings(text_model_dir: Path) -> None:
    llm = LLM(str(text_model_dir), async_scheduling=False, **SETTINGS)
    prompts = ["w10 w11 w12 w13", "w200 w7 w9", "w42"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stops = [out.text.split()[2] for out in free]  # the third word of each answer
    params = [SamplingParams(temperature=0, max_tokens=12, stop=[stop]) for stop in stops]
    fast, plain, _ = run_both(text_model_dir, prompts, params)
    assert summary(fast) == summary(plain)
    assert all(o.finish_reason == "stop" and o.stop_reason in stops for o in fast)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption(llama: Path, preemption: str) -> None:
    prompts = random_prompts([30, 41, 25, 37], 320, seed=35)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    fast, plain, llm = run_both(
        llama, prompts, [params] * 4, pa_context_len=128, max_model_len=96, preemption=preemption
    )
    assert summary(fast) == summary(plain)
    assert llm.engine.scheduler.num_preemptions > 0


def test_cancel_frees_pages_in_the_same_step(llama: Path) -> None:
    llm = LLM(str(llama), async_scheduling=True, **SETTINGS)
    engine = llm.engine
    prompts = random_prompts([20, 26], 320, seed=36)
    for index, prompt in enumerate(prompts):
        engine.add_request(
            f"r{index}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=50, ignore_eos=True),  # running after 4 steps
        )
    for _ in range(4):
        engine.step()
    seq = engine.sequence("r0")
    assert seq is not None and seq.num_pending_tokens == 1  # its last pick is in flight
    used_before = engine.block_manager.num_used_blocks
    engine.abort("r0")
    outputs = engine.step()
    cancelled = [o for o in outputs if o.request_id == "r0"]
    assert [o.finish_reason for o in cancelled] == ["cancelled"]
    assert engine.sequence("r0") is None
    assert engine.block_manager.num_used_blocks < used_before
    assert seq.num_pending_tokens == 0 and -1 not in seq.output_token_ids
    assert cancelled[0].usage is not None
    assert cancelled[0].usage.completion_tokens == len(seq.output_token_ids)
