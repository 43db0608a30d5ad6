"""Speculative decoding with a draft model (``--speculative-model``): its own pool and shadows.

A draft that is the target itself must have every greedy draft accepted (its KV follows the
sequence exactly); a perturbed copy agrees only in part, so rejected drafts' KV must be rolled
back; a sampled request drafting from itself keeps (almost) every draft, which only happens
when the verifier divides by the draft's own distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from engine.sampler import DeviceSample
from tests.test_speculative import TIGHT, repetitive_prompts, run


@pytest.fixture(scope="module")
def llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


def greedy_params(num: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=36 + i, ignore_eos=True) for i in range(num)]


def drafted_like_plain(
    target: Path,
    draft: Path,
    prompts: list[list[int]],
    params: list[SamplingParams],
    num_drafts: int,
    **settings: Any,
) -> tuple[list[list[int]], LLMEngine]:
    """Plain decoding's tokens, after checking that drafting from ``draft`` gives the same;
    and the drafting engine, for its statistics."""
    plain, _ = run(target, prompts, params, **settings)
    spec, engine = run(
        target, prompts, params, speculative_model=str(draft), num_speculative_tokens=num_drafts,
        **settings,
    )  # fmt: skip
    assert spec == plain
    return plain, engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_perturbed_draft_gives_plain_greedy_tokens(
    llama: Path, perturbed_llama: Path, preemption: str
) -> None:
    prompts, params = repetitive_prompts(5, seed=21), greedy_params(5)
    settings = dict(TIGHT, preemption=preemption)
    _, engine = drafted_like_plain(llama, perturbed_llama, prompts, params, 3, **settings)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert 0.2 < stats.acceptance_rate < 1  # both accepted and rejected drafts ran


def test_the_model_as_its_own_draft_has_every_greedy_draft_accepted(llama: Path) -> None:
    prompts, params = repetitive_prompts(4, seed=23), greedy_params(4)
    plain, engine = drafted_like_plain(llama, llama, prompts, params, 4, **TIGHT)
    stats = engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.num_steps < sum(len(tokens) for tokens in plain) / 2


def test_after_the_prompt_every_draft_pass_runs_one_token_a_row(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt is the one catch-up that runs several tokens in a pass: the accepted tokens
    (two a step here, every draft holding) are caught up one a pass, as decode steps that
    replay a CUDA graph on a GPU."""
    engine = LLMEngine(
        EngineConfig(model=str(llama), speculative_model=str(llama), num_speculative_tokens=3)
    )
    assert engine.proposer is not None
    runner = engine.proposer.runner  # type: ignore[attr-defined]
    several: list[str] = []
    prepare_inputs = runner.prepare_inputs

    def spy(batch: Any, *args: Any) -> Any:
        several.extend(e.seq.request_id for e in batch.scheduled if e.num_new_tokens > 1)
        return prepare_inputs(batch, *args)

    monkeypatch.setattr(runner, "prepare_inputs", spy)
    for index, prompt in enumerate(repetitive_prompts(3, seed=29)):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=greedy_params(1)[0])
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert sorted(several) == ["r0", "r1", "r2"]


def test_greedy_draft_passes_are_queued_before_any_pick_is_read(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy drafts feed the next pass from the device: within one step's drafting every
    pass is launched before the host reads a pick (sampled drafts still wait pass by pass)."""
    engine = LLMEngine(
        EngineConfig(model=str(llama), speculative_model=str(llama), num_speculative_tokens=3)
    )
    proposer: Any = engine.proposer
    runner = proposer.runner
    events: list[str] = []
    launch, propose, read = runner.launch, proposer.propose, DeviceSample.resolve

    def launch_spy(*args: Any) -> Any:
        events.append("launch")
        return launch(*args)

    def read_spy(sample: DeviceSample) -> Any:
        events.append("read")
        return read(sample)

    def propose_spy(running: Any) -> None:
        events.append("|")
        propose(running)

    monkeypatch.setattr(runner, "launch", launch_spy)
    monkeypatch.setattr(proposer, "propose", propose_spy)
    monkeypatch.setattr(DeviceSample, "resolve", read_spy)
    monkeypatch.setattr(runner, "sampling_logits", None)  # the waiting path is not taken
    for index, prompt in enumerate(repetitive_prompts(2, seed=31)):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=greedy_params(1)[0])
    while engine.has_unfinished_requests():
        engine.step()
    rounds = [r.split() for r in " ".join(events).split("|") if r.strip()]
    assert rounds and all(r == sorted(r) for r in rounds)  # "launch"es, then "read"s
    assert max(r.count("launch") for r in rounds) >= 4  # the last token's pass and 3 drafts
    assert engine.stats().num_accepted_tokens == engine.stats().num_draft_tokens > 0


def test_greedy_requests_with_penalties_or_min_tokens_give_plain_tokens(llama: Path) -> None:
    """Penalties read the drafts drawn so far, so their rows draft pass by pass (queued, the
    earlier drafts would still be placeholders on the host); ``min_tokens`` counts them and
    suppresses EOS before, which queued passes must keep."""
    prompts = repetitive_prompts(3, seed=33)
    params = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=30),
    ]
    _, engine = drafted_like_plain(llama, llama, prompts, params, 3, **TIGHT)
    assert engine.stats().num_accepted_tokens == engine.stats().num_draft_tokens > 0
    _, engine = drafted_like_plain(llama, llama, prompts, [params[2]] * 3, 3, **TIGHT)  # queued
    assert engine.stats().num_accepted_tokens == engine.stats().num_draft_tokens > 0


def test_sampled_drafts_are_verified_against_their_own_distribution(llama: Path) -> None:
    """p == q: min(1, p/q) accepts every draft; a verifier that took the draft for a point
    mass would accept it only with probability p(d)."""
    prompts = repetitive_prompts(4, seed=25)
    params = [
        SamplingParams(temperature=1.0, max_tokens=30, seed=i, ignore_eos=True) for i in range(4)
    ]
    settings = dict(TIGHT, speculative_model=str(llama), num_speculative_tokens=3)
    first, engine = run(llama, prompts, params, **settings)
    assert engine.stats().acceptance_rate > 0.97
    second, _ = run(llama, prompts, params, **settings)
    assert first == second  # seeded requests stay reproducible


def test_a_draft_model_of_another_vocabulary_is_refused(llama: Path) -> None:
    with pytest.raises(ConfigError, match="vocabulary of 512 tokens, the model 320"):
        LLMEngine(EngineConfig(model=str(llama), device="cpu", speculative_model="dummy:tiny"))


def test_a_draft_model_with_a_shorter_context_is_refused(llama: Path) -> None:
    config = EngineConfig(model="dummy:tiny", device="cpu", speculative_model=str(llama))
    with pytest.raises(ConfigError, match="context of 256 tokens, shorter than max_model_len"):
        LLMEngine(config)


def test_lookup_and_a_draft_model_are_not_both_allowed() -> None:
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig(speculative="ngram", speculative_model="dummy:tiny")


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there(text_model_dir: Path) -> None:
    """The model drafting for itself gains K + 1 tokens a step, so each stop below falls
    inside a step's tokens: what follows it must never be output."""
    settings = dict(device="cpu", pa_block_size=8, max_seqs=4, max_batched_tokens=48)
    prompts = ["w10 w11 w12 w13", "w200 w7 w9", "w42 w43", "w5 w6 w7 w8 w9"]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain_llm = LLM(str(text_model_dir), **settings)
    spec_llm = LLM(
        str(text_model_dir), speculative_model=str(text_model_dir), num_speculative_tokens=4,
        **settings,
    )  # fmt: skip
    unstopped = plain_llm.generate(prompts, free, use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(unstopped[0].token_ids[7],)),
        SamplingParams(temperature=0, max_tokens=30, stop=[unstopped[1].text.split()[8]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=30),
    ]
    results = [llm.generate(prompts, params, use_tqdm=False) for llm in (plain_llm, spec_llm)]
    plain, spec = (
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs] for outs in results
    )
    assert spec == plain
    assert [len(tokens) for tokens, *_ in spec][2:] == [13, 30]
    stats = spec_llm.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
