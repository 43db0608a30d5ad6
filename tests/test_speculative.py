"""Speculative decoding through the engine: greedy tokens equal plain decoding exactly.

Prompts repeat a short run of tokens, and the tiny random model falls into loops of its own,
so prompt lookup proposes drafts that are often right and often wrong: both paths run. The
settings force chunked prefill, prefix-cache hits and preemption (a pool smaller than the
requests need), and the page accounting is checked after every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.attention.backend import ATTN_BACKEND_ENV, get_attention_backend
from tests.conftest import TINY_COMMON, random_prompts
from tests.test_spec_decode_units import chi_square_excess

VOCAB_SIZE = TINY_COMMON["vocab_size"]
MAX_STEPS = 2_000
# 16 pages of 8 tokens for 6 requests of up to 32 + 48 tokens: they cannot all run at once
TIGHT = dict(
    device="cpu", pa_block_size=8, pa_context_len=128, max_model_len=128, max_seqs=6,
    max_batched_tokens=40, prefill_chunk=12, swap_space_mb=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


def repetitive_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that share a prefix (prefix-cache hits) and repeat a run of 6 tokens."""
    shared = random_prompts([16], VOCAB_SIZE, seed=seed)[0]
    runs = random_prompts([6] * num, VOCAB_SIZE, seed=seed + 1)
    return [shared + run * (2 + index % 3) for index, run in enumerate(runs)]


def run(
    model: Path, prompts: list[list[int]], params: list[SamplingParams], **settings: Any
) -> tuple[list[list[int]], LLMEngine]:
    """Every request's tokens, stepping one engine to the end and checking its pages."""
    engine = LLMEngine(EngineConfig(model=str(model), **settings))
    tokens: dict[str, list[int]] = {}
    for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        tokens[f"r{index}"] = []
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=sampling)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert not engine.has_unfinished_requests()
    return list(tokens.values()), engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_tokens_equal_plain_decoding_under_preemption(llama: Path, preemption: str) -> None:
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=32 + i, ignore_eos=True) for i in range(6)]
    settings = dict(TIGHT, preemption=preemption)
    plain, _ = run(llama, prompts, params, **settings)
    spec, engine = run(
        llama, prompts, params, speculative="ngram", num_speculative_tokens=3, **settings
    )
    assert spec == plain
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_hit_rate > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_steps < sum(len(t) for t in plain)  # fewer steps than tokens: it paid off


def test_stop_tokens_and_max_tokens_end_requests_as_in_plain_decoding(llama: Path) -> None:
    prompts = repetitive_prompts(4, seed=9)
    free = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    plain, _ = run(llama, prompts, free, **TIGHT)
    stops = [tokens[10 + i] for i, tokens in enumerate(plain)]  # a token each stops on
    params = [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, stop_token_ids=(stop,))
        for stop in stops
    ]
    expected, _ = run(llama, prompts, params, **TIGHT)
    spec, _ = run(llama, prompts, params, speculative="ngram", num_speculative_tokens=5, **TIGHT)
    assert spec == expected
    assert all(tokens[-1] in stops or len(tokens) == 37 for tokens in spec)


def test_penalties_and_min_tokens_take_the_rejection_path_unchanged(llama: Path) -> None:
    """Greedy rows with penalties or EOS suppression verify drafts against one-hot target
    distributions (the rejection-sampling path), not the argmax shortcut: same tokens.
    (Strong penalties make the model avoid repeats, so drafts would never be accepted.)"""
    prompts = repetitive_prompts(4, seed=13)
    params = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.02, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=30),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.05, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.1, ignore_eos=True),
    ]
    plain, _ = run(llama, prompts, params, **TIGHT)
    settings = dict(TIGHT, speculative="ngram", num_speculative_tokens=4)
    spec, engine = run(llama, prompts, params, **settings)
    assert spec == plain
    assert engine.stats().num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_with_drafts(llama: Path) -> None:
    prompts = repetitive_prompts(3, seed=17)
    params = [
        SamplingParams(temperature=0.7, top_k=20, max_tokens=30, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    settings = dict(TIGHT, speculative="ngram", num_speculative_tokens=3)
    first, engine = run(llama, prompts, params, **settings)
    second, _ = run(llama, prompts, params, **settings)
    assert first == second
    assert all(len(tokens) == 30 for tokens in first)
    assert engine.stats().num_draft_tokens > 0


def test_stop_strings_and_the_context_end_cut_accepted_drafts(text_model_dir: Path) -> None:
    """Text, finish and stop reasons equal plain decoding's with stop strings and the model's
    context ending requests (test_speculative_draft_model forces a stop inside a step)."""
    # clamp_max_tokens: max_tokens=40 does not fit; lowered, the context ends the requests
    settings = dict(device="cpu", pa_block_size=8, max_seqs=4, max_batched_tokens=48,
                    prefill_chunk=32, max_model_len=48, clamp_max_tokens=True)  # fmt: skip
    words = [f"w{i}" for i in (10, 11, 12, 13, 200, 7, 9, 42)]
    prompts = [" ".join(words[i : i + 4] * 3) for i in range(4)]  # about 13 tokens each
    free = SamplingParams(temperature=0, max_tokens=40)  # the 48-token context ends them
    plain_llm = LLM(str(text_model_dir), **settings)
    spec_llm = LLM(str(text_model_dir), speculative="ngram", num_speculative_tokens=4, **settings)
    unstopped = plain_llm.generate(prompts, free, use_tqdm=False)
    stops = [out.text.split()[8 + i] for i, out in enumerate(unstopped)]
    params = [free] * 2 + [
        SamplingParams(temperature=0, max_tokens=40, stop=[s]) for s in stops[2:]
    ]
    results = [llm.generate(prompts, params, use_tqdm=False) for llm in (plain_llm, spec_llm)]
    plain, spec = (
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs] for outs in results
    )
    assert spec == plain
    assert [reason for _, _, reason, _ in plain] == ["length", "length", "stop", "stop"]
    assert spec_llm.engine.stats().num_accepted_tokens > 0


def test_logprobs_of_accepted_drafts_are_the_plain_ones(llama: Path) -> None:
    prompts = repetitive_prompts(3, seed=29)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    settings = dict(TIGHT, max_batched_tokens=64)
    plain = LLM(str(llama), **settings).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(llama), speculative="ngram", num_speculative_tokens=3, **settings)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert spec_llm.engine.stats().num_accepted_tokens > 0
    for mine, theirs in zip(spec, plain, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert len(mine.logprobs) == len(mine.token_ids)
        for got, want in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert got is not None and want is not None
            assert (got.token_id, [t for t, _ in got.top]) == (
                want.token_id,
                [t for t, _ in want.top],
            )
            # a verify chunk and a decode step round differently in the last bits
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: test_gpu_*)")
def test_the_triton_kernels_verify_drafts_as_the_torch_references_do(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify rows are multi-token queries over paged context behind single-token decodes:
    the Triton kernels (under the interpreter) give plain decoding's tokens too."""
    prompts = repetitive_prompts(3, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
    plain, _ = run(llama, prompts, params, **TIGHT)
    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    spec, engine = run(
        llama, prompts, params, speculative="ngram", num_speculative_tokens=3, **TIGHT
    )
    assert get_attention_backend(engine.device).name == "triton"  # what the engine got
    assert spec == plain
    assert engine.stats().num_accepted_tokens > 0


def test_two_tensor_parallel_ranks_verify_drafts_as_one(llama: Path) -> None:
    """Rank 0 sends each verify step (the drafts in its token list) to the other rank, which
    computes its share of every draft position's logits."""
    prompts = repetitive_prompts(3, seed=33)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
    plain, _ = run(llama, prompts, params, **TIGHT)
    settings = dict(TIGHT, speculative="ngram", num_speculative_tokens=3, tensor_parallel_size=2)
    with LLM(str(llama), **settings) as sharded:
        outputs = sharded.generate(prompts, params, use_tqdm=False)
        stats = sharded.engine.stats()
    assert [out.token_ids for out in outputs] == plain
    assert stats.num_accepted_tokens > 0


SMALL_VOCAB = 6
NUM_SAMPLED_REQUESTS = 3000


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama over 6 tokens: the joint law of 3 sampled tokens has 216 cells."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_COMMON, "vocab_size": SMALL_VOCAB})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    directory = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(directory)
    return directory


def exact_three_token_law(model_dir: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """[V**3] the probability of each (t1, t2, t3) after ``prompt``, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    law = torch.zeros(SMALL_VOCAB**3, dtype=torch.float64)
    with torch.no_grad():
        for first in range(SMALL_VOCAB):
            for second in range(SMALL_VOCAB):
                ids = torch.tensor([[*prompt, first, second]])
                logits = model(ids).logits[0, -3:].double() / temperature  # [3, V]
                probs = torch.softmax(logits, dim=-1)
                p12 = probs[0, first] * probs[1, second]
                law[(first * SMALL_VOCAB + second) * SMALL_VOCAB :][:SMALL_VOCAB] = p12 * probs[2]
    return law


def test_sampled_tokens_with_drafts_follow_the_models_law(small_vocab_llama: Path) -> None:
    """Prompt lookup proposes the prompt's loop for the second token; accepting, resampling
    and the bonus token must leave the joint law of the first tokens exactly the model's.
    (Resampling from p instead of max(0, p - q) fails this: 2.9 times the critical value.)"""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3]
    temperature = 1.3
    params = [
        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=seed)
        for seed in range(NUM_SAMPLED_REQUESTS)
    ]
    settings = dict(device="cpu", max_seqs=128, max_batched_tokens=512, max_model_len=64)
    llm = LLM(str(small_vocab_llama), speculative="ngram", num_speculative_tokens=2, **settings)
    outputs = llm.generate([prompt] * NUM_SAMPLED_REQUESTS, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran, often
    cells = torch.tensor([(a * SMALL_VOCAB + b) * SMALL_VOCAB + c for a, b, c in
                          (out.token_ids for out in outputs)])  # fmt: skip
    observed = torch.bincount(cells, minlength=SMALL_VOCAB**3).double()
    expected = exact_three_token_law(small_vocab_llama, prompt, temperature)
    expected *= NUM_SAMPLED_REQUESTS
    assert chi_square_excess(observed, expected) < 1
    # the first two tokens alone: fewer cells, more power where the drafts are verified
    pairs = SMALL_VOCAB**2, SMALL_VOCAB
    assert chi_square_excess(observed.view(pairs).sum(1), expected.view(pairs).sum(1)) < 1
