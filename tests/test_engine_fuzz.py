"""Random traffic on random engine settings: every request ends as it would running alone.

Each case draws its settings from a seed: page size, a pool smaller than the traffic needs,
the batch and prefill-chunk budgets, preemption by recompute or swap, prefix caching, a host
tier, a tenant quota, weights quantized at load, speculative decoding (prompt lookup or a
draft model, 1-5 drafts) or async scheduling. Its traffic arrives between steps: prompts that
share prefixes or repeat a run of tokens, greedy or seeded sampling (top-k, top-p),
penalties, stop tokens with and without ``min_tokens``, stop strings, EOS, logprobs,
priorities, tenants, short timeouts and aborts.

After every step the page accounting is checked; at the end the pool is empty, and each
request's tokens, text, finish reason and log-probs equal those of the same request run alone
on a roomy engine with none of those features (an aborted or timed-out request's tokens are a
prefix of them). Seeded sampling is compared only without speculative decoding, which keeps the
distribution but not the draws.

``PAGESTREAM_FUZZ_SEEDS=FIRST:LAST`` runs those cases instead of the fixed ones (a failure
names its seed and settings; run that seed alone to reproduce it).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention.backend import ATTN_BACKEND_ENV, get_attention_backend
from engine.config import QuantizationName
from engine.outputs import EngineStats
from engine.sampler import TokenLogprobs
from engine.sequence import FinishReason
from tests.conftest import TINY_COMMON

VOCAB_SIZE = TINY_COMMON["vocab_size"]
MAX_MODEL_LEN = 96
MAX_STEPS = 5_000
FIXED_SEEDS = range(64)
TRITON_SEEDS = [4, 10]  # preempted by swap; by recompute, with host-tier hits; both async


def fuzz_seeds() -> list[int]:
    chosen = os.environ.get("PAGESTREAM_FUZZ_SEEDS")
    if not chosen:
        return list(FIXED_SEEDS)
    first, _, last = chosen.partition(":")
    return list(range(int(first), int(last or first) + 1))


@dataclass
class Arrival:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: int
    tenant: str
    timeout_s: float | None


@dataclass
class Case:
    """One seed's settings and traffic."""

    seed: int
    settings: dict[str, Any]
    speculative: str
    arrivals: list[Arrival] = field(default_factory=list)


def draw_settings(rng: random.Random, draft_model: Path) -> tuple[dict[str, Any], str]:
    speculative = rng.choice(["off", "off", "ngram", "draft"])
    max_seqs = rng.randint(1, 6)
    drafts = rng.randint(1, 5)
    budget = rng.choice([16, 24, 32, 64])
    if speculative != "off":  # a verify step must fit every row's drafts
        budget = max(budget, (drafts + 1) * max_seqs)
    prefix_caching = rng.random() < 0.8
    settings: dict[str, Any] = dict(
        device="cpu",
        pa_block_size=rng.choice([4, 8, 16]),
        max_model_len=MAX_MODEL_LEN,
        pa_context_len=rng.choice([96, 128, 160, 256]),  # the whole pool, in tokens
        max_seqs=max_seqs,
        max_batched_tokens=budget,
        prefill_chunk=rng.choice([4, 8, 12, 32]),
        preemption=rng.choice(["recompute", "swap"]),
        swap_space_mb=rng.choice([1, 8]),
        prefix_caching=prefix_caching,
        kv_offload_mb=rng.choice([0, 1]) if prefix_caching else 0,
        tenant_page_quotas={"a": rng.randint(4, 12)} if rng.random() < 0.25 else {},
        # weights quantized at load: the CPU runs their dequantizing reference path
        quantization=rng.choice(["auto", "auto", "auto", "q8_0", "q4_0", "q4_1", "fp8"]),
    )
    if speculative == "ngram":
        settings.update(speculative="ngram", num_speculative_tokens=drafts)
    elif speculative == "draft":
        settings.update(speculative_model=str(draft_model), num_speculative_tokens=drafts)
    else:
        settings["async_scheduling"] = rng.random() < 0.5
    return settings, speculative


def draw_sampling(rng: random.Random, sampled: bool) -> SamplingParams:
    stop_token_ids = rng.choice([(), (), (rng.randrange(VOCAB_SIZE),)])
    # every token is a word `w<id>`: "w1" stops at w1, w10-w19 and w100-w199, often mid-draft
    stop = rng.choice([(), (), (f"w{rng.randrange(4, VOCAB_SIZE)}",), ("w1",), ("w2 w",)])
    max_tokens = rng.randint(1, 30)
    return SamplingParams(
        temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
        top_k=rng.choice([0, 5]) if sampled else 0,
        top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
        seed=rng.randrange(1_000) if sampled else None,
        max_tokens=max_tokens,
        min_tokens=min(3, max_tokens) if stop_token_ids and rng.random() < 0.3 else 0,
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        stop_token_ids=stop_token_ids,
        stop=stop,
        include_stop_str_in_output=rng.random() < 0.5,
        logprobs=rng.choice([None, None, 0, 3]),
        ignore_eos=rng.random() < 0.7,  # else the model's EOS (a word like any other) ends it
    )


def draw_case(seed: int, draft_model: Path) -> Case:
    rng = random.Random(seed)
    settings, speculative = draw_settings(rng, draft_model)
    case = Case(seed, settings, speculative)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    for index in range(rng.randint(3, 14)):
        if rng.random() < 0.5:  # a shared prefix: prefix-cache and host-tier hits
            tail = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 20))]
            prompt = rng.choice(prefixes) + tail
        else:  # a repeated run: prompt lookup finds drafts
            run = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(2, 6))]
            prompt = run * rng.randint(2, 6)
        sampled = speculative == "off" and rng.random() < 0.4
        case.arrivals.append(
            Arrival(
                request_id=f"r{index}",
                prompt=prompt[:70],
                sampling=draw_sampling(rng, sampled),
                priority=rng.randint(0, 2),
                tenant=rng.choice(["a", "b", "default"]),
                timeout_s=rng.uniform(0.001, 0.05) if rng.random() < 0.05 else None,
            )
        )
    return case


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text: str = ""


class Reference:
    """Each request run alone on a roomy plain engine with the case's weights (as loaded, or
    quantized at load), remembered by weights, prompt and sampling."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.engines: dict[QuantizationName, LLMEngine] = {}
        self.known: dict[tuple[str, tuple[int, ...], SamplingParams], Outcome] = {}

    def engine(self, quantization: QuantizationName) -> LLMEngine:
        if quantization not in self.engines:
            self.engines[quantization] = LLMEngine(
                EngineConfig(
                    model=str(self.model), device="cpu", quantization=quantization,
                    pa_block_size=16, pa_context_len=4096, max_model_len=MAX_MODEL_LEN,
                    max_seqs=8, max_batched_tokens=512, prefill_chunk=512, prefix_caching=False,
                    async_scheduling=False,
                )
            )  # fmt: skip
        return self.engines[quantization]

    def __call__(
        self, quantization: QuantizationName, prompt: list[int], sampling: SamplingParams
    ) -> Outcome:
        key = (quantization, tuple(prompt), sampling)
        if key not in self.known:
            outcome = Outcome()
            engine = self.engine(quantization)
            engine.add_request("alone", prompt_token_ids=prompt, sampling=sampling)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outcome.tokens += out.new_token_ids
                    outcome.text += out.text_delta
                    outcome.logprobs += out.logprobs
                    outcome.finish_reason = out.finish_reason
            self.known[key] = outcome
        return self.known[key]


@dataclass
class Run:
    case: Case
    outcomes: dict[str, Outcome]
    aborted: set[str]
    stats: EngineStats
    pages_left: int  # pages still in use once every request ended


def run_case(case: Case, model: Path) -> Run:
    """Step one engine through the case's traffic."""
    rng = random.Random(case.seed + 1)  # when arrivals and aborts happen
    engine = LLMEngine(EngineConfig(model=str(model), seed=case.seed, **case.settings))
    outcomes: dict[str, Outcome] = {}
    aborted: set[str] = set()
    waiting = list(case.arrivals)
    for _ in range(MAX_STEPS):
        if not waiting and not engine.has_unfinished_requests():
            break
        burst = rng.choice([1, 1, 2, 4]) if rng.random() < 0.3 else 0
        for arrival in waiting[:burst]:
            outcomes[arrival.request_id] = Outcome()
            engine.add_request(
                arrival.request_id, prompt_token_ids=arrival.prompt, sampling=arrival.sampling,
                priority=arrival.priority, tenant=arrival.tenant, timeout_s=arrival.timeout_s,
            )  # fmt: skip
        del waiting[:burst]
        live = [rid for rid, outcome in outcomes.items() if outcome.finish_reason is None]
        if live and rng.random() < 0.015:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            outcome = outcomes[out.request_id]
            assert outcome.finish_reason is None, f"{out.request_id} went on after its end"
            outcome.tokens += out.new_token_ids
            outcome.text += out.text_delta
            outcome.logprobs += out.logprobs
            if out.finished:
                outcome.finish_reason = out.finish_reason
                if out.usage is not None and out.finish_reason != FinishReason.CANCELLED:
                    assert out.usage.completion_tokens == len(outcome.tokens)
        engine.block_manager.check_invariants(engine.scheduler.running)
    else:
        pytest.fail(f"seed {case.seed}: requests still unfinished after {MAX_STEPS} steps")
    return Run(case, outcomes, aborted, engine.stats(), engine.block_manager.num_used_blocks)


NEAR_TIE = 1e-5  # two greedy candidates' raw log-probs this close: fp32 rounding may pick either


def greedy_near_tie(
    arrival: Arrival, got: list[int], alone: list[int], case: Case, reference: Reference
) -> int | None:
    """Where ``got`` first differs from ``alone``, if a greedy pick there was a near-tie.

    A step that batches, chunks or verifies rows rounds differently from one that runs a
    request alone, in the last bits of fp32: two candidates within ``NEAR_TIE`` of each other
    (by the reference's raw log-probs, asked for again with 20 alternatives) may come out
    either way. Penalties move both alike only when both tokens occur equally often before,
    so otherwise it is no tie.
    """
    index = next((i for i, (a, b) in enumerate(zip(got, alone, strict=False)) if a != b), None)
    if index is None or not arrival.sampling.is_greedy:
        return None
    wide = replace(arrival.sampling, logprobs=20)
    top = reference(case.settings["quantization"], arrival.prompt, wide).logprobs[index]
    candidates = dict(top.top) if top is not None else {}
    mine, theirs = got[index], alone[index]
    if mine not in candidates or theirs not in candidates:
        return None
    history = arrival.prompt + alone[:index]
    if history.count(mine) != history.count(theirs):
        return None
    return index if abs(candidates[mine] - candidates[theirs]) < NEAR_TIE else None


def check_outcomes(run: Run, reference: Reference) -> None:
    """No page left in use; each request ended as it did alone (cut short: a prefix of it)."""
    context = f"seed {run.case.seed}, settings {run.case.settings}"
    assert run.pages_left == 0, context
    for arrival in run.case.arrivals:
        got = run.outcomes[arrival.request_id]
        alone = reference(run.case.settings["quantization"], arrival.prompt, arrival.sampling)
        where = f"{arrival.request_id} ({arrival.sampling}); {context}"
        cut_short = arrival.request_id in run.aborted or got.finish_reason == FinishReason.TIMEOUT
        tie = greedy_near_tie(arrival, got.tokens, alone.tokens, run.case, reference)
        if tie is not None:  # a greedy near-tie resolved the other way: the rest may differ
            got, alone = Outcome(got.tokens[:tie], None, got.logprobs[:tie]), alone
            cut_short = True
        if cut_short:
            assert got.tokens == alone.tokens[: len(got.tokens)], where
        else:
            assert (got.tokens, got.finish_reason) == (alone.tokens, alone.finish_reason), where
            assert got.text == alone.text, where
        assert len(got.logprobs) == len(got.tokens), where  # one entry per token
        for mine, theirs in zip(got.logprobs, alone.logprobs, strict=False):  # up to a cut
            if mine is None or theirs is None:
                assert mine is theirs is None and arrival.sampling.logprobs is None, where
                continue
            # the same raw distribution, batched and chunked otherwise: last-bit rounding
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4), where
            assert len(mine.top) == len(theirs.top) == arrival.sampling.logprobs, where


@pytest.fixture(scope="module")
def llama(text_model_dir: Path) -> Path:
    return text_model_dir  # the tiny llama, each token id a word: text and stop strings


@pytest.fixture(scope="module")
def reference(llama: Path) -> Reference:
    return Reference(llama)


@pytest.fixture(scope="module")
def runs(llama: Path, perturbed_llama: Path) -> Callable[[int], Run]:
    """A seed's case, run once for this module: its test and the coverage check share it."""
    done: dict[int, Run] = {}

    def run_of(seed: int) -> Run:
        if seed not in done:
            done[seed] = run_case(draw_case(seed, perturbed_llama), llama)
        return done[seed]

    return run_of


@pytest.mark.parametrize("seed", fuzz_seeds())
def test_random_traffic_ends_as_each_request_alone(
    seed: int, runs: Callable[[int], Run], reference: Reference
) -> None:
    check_outcomes(runs(seed), reference)


def test_the_fixed_cases_reach_every_path(runs: Callable[[int], Run]) -> None:
    """The fixed seeds preempt (by recompute and by swap), hit the host tier, verify drafts of
    both proposers, abort and quantize: cases that never did would pass whatever those paths
    did."""
    reached: Counter[str] = Counter()
    for seed in FIXED_SEEDS:
        run = runs(seed)
        reached[f"preempted by {run.case.settings['preemption']}"] += run.stats.num_preemptions
        reached["host-tier hits"] += run.stats.num_host_hit_tokens
        reached[f"{run.case.speculative} drafts"] += run.stats.num_draft_tokens
        reached["aborts"] += len(run.aborted)
        reached["quantized weights"] += run.case.settings["quantization"] != "auto"
    wanted = [
        "preempted by recompute", "preempted by swap", "host-tier hits", "ngram drafts",
        "draft drafts", "aborts", "quantized weights",
    ]  # fmt: skip
    assert all(reached[name] > 0 for name in wanted), reached


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: test_gpu_*)")
@pytest.mark.parametrize(
    ("seed", "cascade"), [(seed, False) for seed in TRITON_SEEDS] + [(4, True)]
)
def test_the_triton_kernels_end_random_traffic_as_the_torch_references_do(
    seed: int,
    cascade: bool,
    llama: Path,
    perturbed_llama: Path,
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two cases with the attention, KV-write and rotary kernels under the interpreter (a
    verify step through them: tests/test_speculative.py); one again with cascade decode from
    two decodes over one page, so its prefixes come and go with swaps, aborts and arrivals."""
    from engine.attention import backend

    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    assert get_attention_backend(torch.device("cpu")).name == "triton"
    case = draw_case(seed, perturbed_llama)
    if cascade:
        monkeypatch.setattr(backend, "CASCADE_MIN_DECODES", 2)
        monkeypatch.setattr(backend, "CASCADE_MIN_PREFIX_TOKENS", 1)
        case.settings["cascade_attention"] = True
        for arrival in case.arrivals:  # every prompt after one shared start of 16 tokens
            arrival.prompt = [7] * 16 + arrival.prompt[: MAX_MODEL_LEN - 16 - 31]
        prefixes = _noting_prefixes(monkeypatch)
    check_outcomes(run_case(case, llama), reference)
    if cascade:
        assert any(prefixes)


def _noting_prefixes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The longest share of a shared prefix in every Triton attention call from now on."""
    from kernels.attention import paged_attention_triton

    real = paged_attention_triton.paged_attention
    prefixes: list[int] = []

    def noted(*args: Any, **kwargs: Any) -> Any:
        shares = kwargs.get("prefix_lens")
        prefixes.append(0 if shares is None else int(shares.max()))
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention_triton, "paged_attention", noted)
    return prefixes
