"""n > 1 and best_of in the engine: one prefill shared by the samples (pages by reference
count, the partial last page copied on write), a seed stream per sample, usage and stats that
count the prompt once, best_of's ranking, and cancellation freeing every sample's pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, EngineConfig, FinishReason, LLMEngine, SamplingParams, StepOutput
from engine.scheduler import ScheduledBatch
from tests.conftest import TINY_COMMON, random_prompts

VOCAB_SIZE = TINY_COMMON["vocab_size"]
BLOCK_SIZE = 4
PROMPT_LEN = 10  # two full pages and a partial one: shared, shared, copied on write


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, Path]) -> LLM:
    return LLM(str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE, max_seqs=8)


@pytest.fixture()
def prompt() -> list[int]:
    return random_prompts([PROMPT_LEN], VOCAB_SIZE, seed=3)[0]


def sampled(**fields: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, **fields})


def test_greedy_samples_equal_a_single_run(llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = llm.generate([prompt], params, use_tqdm=False)[0]
    out = llm.generate([prompt], SamplingParams(**{**vars(params), "n": 3}), use_tqdm=False)[0]
    assert [sample.index for sample in out.outputs] == [0, 1, 2]
    for sample in out.outputs:
        assert sample.token_ids == single.token_ids
        assert sample.finish_reason is FinishReason.LENGTH
    assert out.usage is not None
    assert out.usage.prompt_tokens == PROMPT_LEN  # once, not three times
    assert out.usage.completion_tokens == 3 * 8


def test_seeded_samples_are_reproducible_and_use_seed_plus_index(
    llm: LLM, prompt: list[int]
) -> None:
    first = llm.generate([prompt], sampled(n=3, seed=11), use_tqdm=False)[0]
    again = llm.generate([prompt], sampled(n=3, seed=11), use_tqdm=False)[0]
    assert [s.token_ids for s in first.outputs] == [s.token_ids for s in again.outputs]
    assert len({tuple(s.token_ids) for s in first.outputs}) > 1  # distinct streams
    for index, sample in enumerate(first.outputs):
        alone = llm.generate([prompt], sampled(seed=11 + index), use_tqdm=False)[0]
        assert sample.token_ids == alone.token_ids


def test_prompt_is_prefilled_once(tiny_model_dirs: dict[str, Path], prompt: list[int]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE))
    engine.add_request("r", prompt_token_ids=prompt, sampling=sampled(n=4, seed=1))
    outputs = run(engine)
    assert engine.stats().num_prefill_tokens == PROMPT_LEN
    last = [out for out in outputs if out.finished]
    assert len(last) == 1 and last[0] is outputs[-1]
    assert last[0].usage is not None and last[0].usage.prompt_tokens == PROMPT_LEN
    ends = [out.index for out in outputs if out.sample_finished]
    assert sorted(ends) == [0, 1, 2, 3]
    assert engine.block_manager.num_used_blocks == 0


def test_samples_share_the_prompt_pages(
    tiny_model_dirs: dict[str, Path], prompt: list[int]
) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE,
                     prefix_caching=False, async_scheduling=False)
    )  # fmt: skip
    engine.add_request("r", prompt_token_ids=prompt, sampling=sampled(n=3, seed=1))
    engine.step()  # the prefill, and the samples' first tokens
    samples = engine.scheduler.find_all("r")
    assert sorted(s.sample_index for s in samples) == [0, 1, 2]
    bm = engine.block_manager
    tables = [s.block_table for s in samples]
    full_pages = tables[0][: PROMPT_LEN // BLOCK_SIZE]
    for table in tables:
        assert table[: len(full_pages)] == full_pages
    assert [bm.ref_counts[block] for block in full_pages] == [3, 3]
    tail = tables[0][PROMPT_LEN // BLOCK_SIZE]
    assert bm.ref_counts[tail] == 3  # shared until written
    assert bm.num_used_blocks == 3
    bm.check_invariants(samples)
    engine.step()  # every sample writes its second token's KV into the partial page
    tails = {s.block_table[PROMPT_LEN // BLOCK_SIZE] for s in samples}
    assert len(tails) == 3  # two copies made; the last sharer kept the original
    assert all(bm.ref_counts[block] == 1 for block in tails)
    assert [bm.ref_counts[block] for block in full_pages] == [3, 3]
    bm.check_invariants(samples)


def test_best_of_returns_the_highest_cumulative_logprob(llm: LLM, prompt: list[int]) -> None:
    every = llm.generate([prompt], sampled(n=4, seed=5, logprobs=0), use_tqdm=False)[0]
    scores = [sum(lp.logprob for lp in s.logprobs if lp) for s in every.outputs]
    ranked = sorted(range(4), key=lambda i: scores[i], reverse=True)
    best = llm.generate([prompt], sampled(n=2, best_of=4, seed=5), use_tqdm=False)[0]
    assert [s.token_ids for s in best.outputs] == [every.outputs[i].token_ids for i in ranked[:2]]
    assert all(lp is None for s in best.outputs for lp in s.logprobs)  # not asked for
    assert best.usage is not None and best.usage.completion_tokens == 4 * 6


def test_cancel_frees_every_sample(tiny_model_dirs: dict[str, Path], prompt: list[int]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE))
    params = sampled(n=3, seed=2, max_tokens=50)
    engine.add_request("early", prompt_token_ids=prompt, sampling=params)
    engine.abort("early")  # before the samples fork
    engine.add_request("late", prompt_token_ids=prompt, sampling=params)
    outputs = [out for _ in range(3) for out in engine.step()]
    engine.abort("late")
    outputs += run(engine)
    for request_id in ("early", "late"):
        mine = [out for out in outputs if out.request_id == request_id]
        ends = sorted(out.index for out in mine if out.sample_finished)
        assert ends == [0, 1, 2]
        assert all(
            out.finish_reason is FinishReason.CANCELLED for out in mine if out.sample_finished
        )
        assert sum(out.finished for out in mine) == 1
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("early", prompt_token_ids=prompt, sampling=params)  # the id is free


def test_timeout_ends_every_sample(tiny_model_dirs: dict[str, Path], prompt: list[int]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE))
    params = sampled(n=3, max_tokens=200)
    engine.add_request("late", prompt_token_ids=prompt, sampling=params, timeout_s=0.05)
    engine.add_request("at-once", prompt_token_ids=prompt, sampling=params, timeout_s=1e-6)
    outputs = run(engine)
    for request_id in ("late", "at-once"):
        ends = [o for o in outputs if o.request_id == request_id and o.sample_finished]
        assert sorted(o.index for o in ends) == [0, 1, 2]
        assert all(o.finish_reason is FinishReason.TIMEOUT for o in ends)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_samples_still_match(tiny_model_dirs: dict[str, Path], preemption: str) -> None:
    prompts = random_prompts([9, 7], VOCAB_SIZE, seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    roomy = LLM(str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE)
    small = dict(pa_context_len=48, max_model_len=48, swap_space_mb=8, preemption=preemption)
    tight = LLM(str(tiny_model_dirs["llama"]), pa_block_size=BLOCK_SIZE, **small)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert [s.token_ids for s in have.outputs] == [s.token_ids for s in want.outputs]
    assert tight.engine.block_manager.num_used_blocks == 0


def test_samples_with_prompt_lookup_drafts_match(tiny_model_dirs: dict[str, Path]) -> None:
    # The first request drafts (prompt lookup) when the second one forks its samples: fork
    # rows and draft rows in one step. Greedy: drafting changes nothing.
    repetitive = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    other = random_prompts([9], VOCAB_SIZE, seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    results = []
    for speculative in ("off", "ngram"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]),
                                        pa_block_size=BLOCK_SIZE, speculative=speculative))  # fmt: skip
        engine.add_request("a", prompt_token_ids=repetitive, sampling=params)
        outputs = [out for _ in range(7) for out in engine.step()]  # "a" drafts in step 8
        engine.add_request("b", prompt_token_ids=other, sampling=params)
        steps = record_batches(engine)
        outputs += run(engine)
        tokens: dict[tuple[str, int], list[int]] = {}
        for out in outputs:
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        results.append(tokens)
        if speculative == "ngram":  # the step that forks "b" verifies drafts of "a"
            fork = next(step for step in steps if step.forks)
            assert any(entry.draft_token_ids for entry in fork.scheduled)
    assert results[0] == results[1] and len(results[0]) == 4


def test_too_many_samples_are_refused(llm: LLM, prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="best_of"):
        llm.generate([prompt], sampled(n=2, best_of=9), use_tqdm=False)
    with pytest.raises(ValueError, match="best_of: must be >= n"):
        SamplingParams(n=3, best_of=2)


def record_batches(engine: LLMEngine) -> list[ScheduledBatch]:
    """Every batch the engine's scheduler makes from now on (the scheduler's own)."""
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recorded(now_s: float) -> ScheduledBatch:
        batches.append(schedule(now_s))
        return batches[-1]

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return batches


def run(engine: LLMEngine) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


def test_the_clients_completion_folds_samples_by_index() -> None:
    from clients import Completion
    from clients.protocol import DoneEvent, RestartEvent, TokenEvent
    from clients.protocol import FinishReason as WireFinish
    from clients.protocol import Usage as WireUsage

    completion = Completion("r")
    completion.add(TokenEvent(seq=0, text=" dead", token_ids=[1], index=1))
    completion.add(RestartEvent(attempt=1, worker="w2"))
    for seq, (index, text) in enumerate([(0, " a"), (1, " x"), (0, " b"), (1, "")]):
        end = WireFinish.LENGTH if (index, text) == (0, " b") else None
        end = WireFinish.STOP if text == "" else end
        completion.add(TokenEvent(seq=seq, text=text, token_ids=[seq] if text else [],
                                  index=index, finish_reason=end))  # fmt: skip
    usage = WireUsage(prompt_tokens=2, completion_tokens=3)
    completion.add(DoneEvent(finish_reason=WireFinish.STOP, usage=usage))
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, " a b", WireFinish.LENGTH), (1, " x", WireFinish.STOP),
    ]  # fmt: skip
    assert (completion.text, completion.token_ids) == (" a b", [0, 2])
    assert completion.finish_reason is WireFinish.LENGTH and completion.usage == usage
