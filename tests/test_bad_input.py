"""Bad input a user can send: each gets an error naming what was wrong, and nothing else breaks.

Requests are refused by ``add_request`` with an ``InvalidRequestError`` whose ``field`` names
the culprit, while a good request already in flight runs on to its correct output. Models
that cannot be loaded raise ``ModelLoadError``, bad settings ``ConfigError``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import (
    LLM,
    ConfigError,
    EngineConfig,
    InvalidRequestError,
    LLMEngine,
    ModelLoadError,
    SamplingParams,
    UnsupportedModelError,
)
from engine.inputs import PromptEncoder
from engine.sampling_params import DEFAULT_MAX_TOKENS
from tests.conftest import TINY_COMMON, hf_greedy

VOCAB_SIZE = TINY_COMMON["vocab_size"]
MAX_MODEL_LEN = 64
MAX_STEPS = 500
GOOD_TEXT = "the capital of france is"
GOOD_TOKEN_IDS = [17, 42, 99, 3, 250, 7]
NUM_NEW_TOKENS = 8
# min_tokens == max_tokens: EOS is suppressed as in hf_greedy (min_new_tokens).
GOOD_SAMPLING = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
WORDS = ["<pad>", "<s>", "</s>", "<unk>", *GOOD_TEXT.split(), "paris", "hello", "world"]


def with_sampling(**settings: Any) -> Callable[[], dict[str, Any]]:
    # SamplingParams validates on construction: build it inside pytest.raises.
    return lambda: dict(prompt_token_ids=GOOD_TOKEN_IDS, sampling=SamplingParams(**settings))


def with_request(**request: Any) -> Callable[[], dict[str, Any]]:
    return lambda: request


# name: (the bad request's add_request arguments, the field named, a hint in the message)
BAD_REQUESTS: dict[str, tuple[Callable[[], dict[str, Any]], str, str]] = {
    "empty prompt": (with_request(prompt=""), "prompt", "empty"),
    "empty token ids": (with_request(prompt_token_ids=[]), "prompt", "empty"),
    "prompt fills the context": (
        with_request(prompt_token_ids=[5] * MAX_MODEL_LEN),
        "prompt",
        f"at most {MAX_MODEL_LEN - 1}",
    ),
    "token id past the vocabulary": (
        with_request(prompt_token_ids=[5, VOCAB_SIZE]),
        "token_ids",
        f"0..{VOCAB_SIZE - 1}",
    ),
    "negative token id": (with_request(prompt_token_ids=[5, -1]), "token_ids", "-1"),
    "prompt and token ids": (
        with_request(prompt=GOOD_TEXT, prompt_token_ids=GOOD_TOKEN_IDS),
        "prompt",
        "exactly one",
    ),
    "messages without a chat template": (
        with_request(messages=[{"role": "user", "content": "hello"}]),
        "messages",
        "no chat template",
    ),
    "max_tokens past the context": (
        with_request(
            prompt_token_ids=[5] * (MAX_MODEL_LEN - 4), sampling=SamplingParams(max_tokens=5)
        ),
        "max_tokens",
        f"context is {MAX_MODEL_LEN} tokens; the prompt has {MAX_MODEL_LEN - 4}",
    ),
    "timeout of zero": (
        with_request(prompt_token_ids=GOOD_TOKEN_IDS, timeout_s=0),
        "timeout_s",
        "> 0",
    ),
    "max_tokens 0": (with_sampling(max_tokens=0), "max_tokens", ">= 1"),
    "negative temperature": (with_sampling(temperature=-0.5), "temperature", ">= 0"),
    "infinite temperature": (with_sampling(temperature=float("inf")), "temperature", "finite"),
    "infinite repetition penalty": (
        with_sampling(repetition_penalty=float("inf")),
        "repetition_penalty",
        "finite",
    ),
    "top_p 0": (with_sampling(top_p=0.0), "top_p", "(0, 1]"),
    "top_p 1.5": (with_sampling(top_p=1.5), "top_p", "(0, 1]"),
    "top_k -2": (with_sampling(top_k=-2), "top_k", "0/-1 for off"),
    "min_p above 1": (with_sampling(min_p=1.5), "min_p", "[0, 1]"),
    "logprobs 21": (with_sampling(logprobs=21), "logprobs", "[0, 20]"),
    "negative min_tokens": (with_sampling(min_tokens=-1), "min_tokens", ">= 0"),
    "min_tokens above max_tokens": (
        with_sampling(min_tokens=10, max_tokens=5),
        "min_tokens",
        "max_tokens",
    ),
    "empty stop string": (with_sampling(stop=[""]), "stop", "non-empty"),
    "temperature not a number": (
        with_sampling(temperature="hot"),
        "temperature",
        'expected a number, got str "hot"',
    ),
    "max_tokens not an integer": (
        with_sampling(max_tokens=8.0),
        "max_tokens",
        "expected an integer or null, got float 8.0",
    ),
    "prompt not a string": (with_request(prompt=5), "prompt", "expected a string, got int 5"),
    "priority not an integer": (
        with_request(prompt_token_ids=GOOD_TOKEN_IDS, priority="high"),
        "priority",
        "integer",
    ),
    "None among the token ids": (with_request(prompt_token_ids=[5, None]), "token_ids", "None"),
    "bool as a token id": (with_request(prompt_token_ids=[5, True]), "token_ids", "True"),
    "timeout not a number": (
        with_request(prompt_token_ids=GOOD_TOKEN_IDS, timeout_s="soon"),
        "timeout_s",
        "> 0",
    ),
    "timeout NaN": (
        with_request(prompt_token_ids=GOOD_TOKEN_IDS, timeout_s=float("nan")),
        "timeout_s",
        "> 0",
    ),
    "seed past 64 bits": (with_sampling(seed=2**64), "seed", "64 bits"),
    "empty tenant": (
        with_request(prompt_token_ids=GOOD_TOKEN_IDS, tenant=""),
        "tenant",
        "non-empty",
    ),
}


@pytest.fixture(scope="module")
def text_model_dir(tiny_model_dirs: dict[str, Path], tmp_path_factory: Any) -> Path:
    """The tiny llama with a small word-level tokenizer (and no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path_factory.mktemp("text-model") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def good_reference(text_model_dir: Path) -> list[int]:
    good_prompt = [WORDS.index(word) for word in GOOD_TEXT.split()]
    return hf_greedy(text_model_dir, [good_prompt], NUM_NEW_TOKENS)[0]


def step(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return tokens
        step(engine, tokens)
    raise AssertionError("the engine stopped making progress")


def check_refused_while_serving(
    engine: LLMEngine,
    make_bad: Callable[[], dict[str, Any]],
    field: str,
    hint: str,
    good_reference: list[int],
) -> None:
    engine.add_request("good", GOOD_TEXT, sampling=GOOD_SAMPLING)
    tokens: dict[str, list[int]] = {}
    step(engine, tokens)  # the good request is in flight when the bad one arrives
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", **make_bad())
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")
    assert hint in error.value.message
    engine.add_request("after", prompt_token_ids=GOOD_TOKEN_IDS, sampling=GOOD_SAMPLING)
    run_to_end(engine, tokens)
    assert tokens.keys() == {"good", "after"}, "the refused request must leave no trace"
    assert tokens["good"] == good_reference
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_engine_keeps_serving(
    case: str, text_model_dir: Path, good_reference: list[int]
) -> None:
    engine = LLMEngine(EngineConfig(model=str(text_model_dir), max_model_len=MAX_MODEL_LEN))
    check_refused_while_serving(engine, *BAD_REQUESTS[case], good_reference)


def test_token_ids_are_checked_whole_and_the_first_bad_one_is_named() -> None:
    class Id(int):  # an int subclass is an int, as it always was; a bool is not
        pass

    encoder = PromptEncoder("m", None, vocab_size=100, max_model_len=1000)
    assert encoder.encode(prompt_token_ids=[0, 99, Id(5)]) == [0, 99, 5]
    for ids, named in (([1, 2, 100, -1], "[2] = 100"), ([1, -3], "[1] = -3"),
                       ([1, 2.0], "[1] = 2.0"), ([False, 1], "[0] = False")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=re.escape(named)):
            encoder.encode(prompt_token_ids=ids)


def test_text_prompt_for_a_model_without_tokenizer() -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", max_seqs=4))
    engine.add_request("good", prompt_token_ids=GOOD_TOKEN_IDS, sampling=GOOD_SAMPLING)
    tokens: dict[str, list[int]] = {}
    step(engine, tokens)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", GOOD_TEXT)
    assert error.value.field == "prompt"
    assert "dummy:tiny" in error.value.message and "token_ids" in error.value.message
    run_to_end(engine, tokens)
    alone = LLM("dummy:tiny", max_seqs=4).generate(GOOD_TOKEN_IDS, GOOD_SAMPLING, use_tqdm=False)
    assert tokens == {"good": alone[0].token_ids}


# -- LLM.generate -----------------------------------------------------------------------------


def test_generate_with_one_bad_prompt_names_it_and_runs_nothing(
    text_model_dir: Path, good_reference: list[int]
) -> None:
    llm = LLM(str(text_model_dir), max_model_len=MAX_MODEL_LEN)
    prompts: list[Any] = [GOOD_TEXT, GOOD_TOKEN_IDS, [5, VOCAB_SIZE + 7], GOOD_TEXT]
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(prompts, GOOD_SAMPLING, use_tqdm=False)
    assert error.value.field == "token_ids"
    assert "request 2" in error.value.message and str(VOCAB_SIZE + 7) in error.value.message
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_pages_used == 0
    with pytest.raises(InvalidRequestError, match="request 1") as error:
        llm.generate([GOOD_TEXT, ""], GOOD_SAMPLING, use_tqdm=False)
    assert error.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([GOOD_TEXT] * 3, [GOOD_SAMPLING] * 2, use_tqdm=False)
    assert error.value.field == "sampling_params" and "2 given for 3" in error.value.message
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate([GOOD_TEXT, GOOD_TEXT], GOOD_SAMPLING, use_tqdm=False)
    assert [out.token_ids for out in outputs] == [good_reference] * 2


# -- prompt + max_tokens against the context ------------------------------------------------

NEAR_FULL = [5] * (MAX_MODEL_LEN - 4)  # leaves room for 4 tokens


def lengths(llm: LLM, sampling: SamplingParams) -> tuple[int, str | None]:
    [out] = llm.generate(NEAR_FULL, sampling, use_tqdm=False)
    return len(out.token_ids), out.finish_reason.value if out.finish_reason else None


def test_max_tokens_past_the_context_is_refused_unless_clamping_is_asked(
    text_model_dir: Path,
) -> None:
    llm = LLM(str(text_model_dir), max_model_len=MAX_MODEL_LEN)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(NEAR_FULL, SamplingParams(max_tokens=10), use_tqdm=False)
    assert error.value.field == "max_tokens"
    assert error.value.message == (
        f"this model's context is {MAX_MODEL_LEN} tokens; the prompt has {MAX_MODEL_LEN - 4} "
        "and max_tokens asks for 10 more: lower max_tokens to at most 4"
    )
    assert not llm.engine.has_unfinished_requests()
    fits = SamplingParams(max_tokens=4, ignore_eos=True)
    assert lengths(llm, fits) == (4, "length")  # exactly full is fine
    # asked for by the request ...
    clamped = SamplingParams(max_tokens=10, ignore_eos=True, clamp_max_tokens=True)
    assert lengths(llm, clamped) == (4, "length")
    # ... or by the engine, for every request
    clamping = LLM(str(text_model_dir), max_model_len=MAX_MODEL_LEN, clamp_max_tokens=True)
    assert lengths(clamping, SamplingParams(max_tokens=10, ignore_eos=True)) == (4, "length")
    # a prompt that fills the context alone is still refused
    with pytest.raises(InvalidRequestError) as error:
        clamping.generate([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=1), use_tqdm=False)
    assert error.value.field == "prompt"


def test_without_max_tokens_the_default_is_lowered_to_fit(text_model_dir: Path) -> None:
    llm = LLM(str(text_model_dir), max_model_len=MAX_MODEL_LEN)
    assert lengths(llm, SamplingParams(ignore_eos=True)) == (4, "length")
    [short] = llm.generate(GOOD_TOKEN_IDS, SamplingParams(ignore_eos=True), use_tqdm=False)
    assert len(short.token_ids) == DEFAULT_MAX_TOKENS  # room enough: the usual default


# -- models that cannot be loaded -------------------------------------------------------------


def test_unknown_model_path_names_it_and_the_accepted_forms(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as error:
        LLM(str(missing))
    message = str(error.value)
    assert str(missing) in message
    for form in ("HF directory", ".gguf", "hub id", "dummy:<shape>", "smollm2-135m"):
        assert form in message


def test_directory_without_config_and_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        LLM(str(tmp_path))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        LLM(str(tmp_path / "model.gguf"))


def test_unknown_dummy_shape_lists_the_known_shapes() -> None:
    with pytest.raises(ModelLoadError) as error:
        LLM("dummy:gpt-5")
    message = str(error.value)
    assert "'gpt-5'" in message
    for shape in ("tiny", "smollm2-135m", "qwen3-0.6b", "llama3-8b"):
        assert shape in message


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_embd": 64,
                "n_head": 4,
                "n_layer": 2,
                "vocab_size": 320,
            }
        )
    )
    with pytest.raises(UnsupportedModelError) as error:
        LLM(str(tmp_path))
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


# -- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "hints"),
    [
        (dict(pa_memory_mb=64, pa_context_len=4096), ["--pa-memory-mb", "--pa-context-len"]),
        (dict(pa_memory_fraction=0.5, pa_memory_mb=64), ["--pa-memory-mb", "mutually"]),
        (dict(pa_block_size=24), ["pa_block_size", "power of two", "24"]),
        (dict(pa_block_size=0), ["pa_block_size", "power of two"]),
        (dict(max_batched_tokens=8, max_seqs=16), ["max_batched_tokens (8)", "max_seqs (16)"]),
        (dict(preemption="evict"), ["preemption", "'evict'", "recompute, swap"]),
        (dict(paged_attn="maybe"), ["paged_attn", "auto, on, off"]),
        (dict(max_model_len=1), ["max_model_len", ">= 2"]),
        (dict(tenant_page_quotas={"a": 0}), ["tenant_page_quotas['a']"]),
    ],
)
def test_bad_settings_are_refused_with_the_reason(
    settings: dict[str, Any], hints: list[str]
) -> None:
    with pytest.raises(ConfigError) as error:
        EngineConfig(model="dummy:tiny", **settings)
    for hint in hints:
        assert hint in str(error.value)


def test_pool_too_small_for_one_sequence_says_how_to_fix_it(llama_dir: Path) -> None:
    with pytest.raises(ConfigError) as error:
        LLM(str(llama_dir), pa_block_size=16, pa_context_len=64, max_model_len=256)
    message = str(error.value)
    assert "cannot hold one sequence of 256 tokens" in message
    for fix in ("--pa-memory-mb", "--pa-context-len", "--max-model-len"):
        assert fix in message


def test_max_model_len_above_the_models_context(llama_dir: Path) -> None:
    with pytest.raises(ConfigError) as error:
        LLM(str(llama_dir), max_model_len=1024)
    message = str(error.value)
    assert "1024" in message and str(TINY_COMMON["max_position_embeddings"]) in message
