"""Incremental detokenization: a stream of token ids in, text that is safe to show out.

Two things make streaming text harder than one ``tokenizer.decode`` at the end:

1. Byte-level BPE splits a multi-byte UTF-8 character (emoji, CJK) over several tokens, so a
   token's text can be an incomplete character, which decodes as U+FFFD. Such text is held
   until a later token completes it.
2. Stop strings can span tokens. Trailing text that could be the start of a stop string is
   held until it either completes one (the output is cut there and the request stops) or can
   no longer start one.

Decoding follows vLLM and TGI: each step decodes only a short window of tokens, so the cost per
token does not grow with the output. The window starts a few tokens before the new ones (at
first: the end of the prompt), because some decoders drop the leading space of the first token
of a decode; ``read_offset`` marks where the window's already-produced text ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # how a decoder shows an incomplete (or invalid) UTF-8 sequence
NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens the first window starts with (as vLLM does)


@dataclass(frozen=True)
class DetokenizerDelta:
    """What one step adds to the output text.

    ``text`` never ends in a broken character and never holds part of a possible stop string.
    ``stopped`` is set once a stop string was found (``stop_reason`` names it); the output is
    then final: cut before the stop string, or just after it with
    ``include_stop_str_in_output``.
    """

    text: str
    stopped: bool = False
    stop_reason: str | None = None


@dataclass(frozen=True)
class _StopMatch:
    stop: str
    start: int  # where the stop string starts in the searched text

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


class _StopStrings:
    """Finds stop strings in streamed text and says how much of its end to hold back."""

    def __init__(self, stop: Sequence[str], include_in_output: bool) -> None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stops))  # drop duplicates, keep the order
        self._include_in_output = include_in_output
        # A proper prefix of a stop string is at most this long.
        self._max_num_held_chars = max((len(s) for s in self._stops), default=1) - 1

    def find(self, text: str) -> _StopMatch | None:
        """The stop string that is complete first when reading ``text``; the longer on a tie.

        Ranking by end (not start) makes the result the same however the text was split into
        steps: a stream sees a match as soon as its last character arrives.
        """
        if not self._stops:
            return None  # the common request: no stop strings
        matches = [_StopMatch(s, text.find(s)) for s in self._stops if s in text]
        return min(matches, key=lambda m: (m.end, m.start), default=None)

    def cut(self, match: _StopMatch) -> int:
        """Where the output ends for ``match``."""
        return match.end if self._include_in_output else match.start

    def num_held_chars(self, text: str) -> int:
        """Length of the longest end of ``text`` that could still grow into a stop string."""
        for num_chars in range(min(self._max_num_held_chars, len(text)), 0, -1):
            tail = text[len(text) - num_chars :]
            if any(s.startswith(tail) for s in self._stops):
                return num_chars
        return 0


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas, step by step.

    Call :meth:`add_tokens` with each step's new tokens, and :meth:`flush` once when the
    sequence finishes for a reason other than a stop string. All deltas plus ``flush()`` equal
    ``tokenizer.decode(output_token_ids, skip_special_tokens=...)`` (without the cleanup of
    spaces before punctuation, which cannot be streamed), cut at the first stop string.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast tokenizer's own Rust decode: what tokenizer.decode calls for it, without the
        # Python argument handling around it (two decodes per token per sequence add up).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stops = _StopStrings(stop, include_stop_str_in_output)
        # The window: token ids from the prefix offset on. The text of window[:read_offset]
        # (prefix_text) is already produced, or is prompt context.
        self._window = self._prompt_context(prompt_token_ids)
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._held_text = ""  # decoded, but could be the start of a stop string
        self._emitted: list[str] = []
        self._stop_reason: str | None = None
        self._is_flushed = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found (by :meth:`add_tokens` or :meth:`flush`)."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_reason

    @property
    def output_text(self) -> str:
        """The final text: all text emitted so far plus what :meth:`flush` would add."""
        emitted = "".join(self._emitted)
        if self.stopped or self._is_flushed:
            return emitted
        return emitted + self._final_text()[0]

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Adds one step's new tokens; returns the text that may be shown now."""
        if self._is_flushed:
            raise RuntimeError("add_tokens() after flush(): the output is already final")
        if self.stopped:
            return self._delta("")  # nothing after a stop string is ever emitted
        self._window.extend(token_ids)
        text = self._held_text + self._read_new_text()
        match = self._stops.find(text)
        if match is not None:
            return self._stop_at(text, match)
        num_shown_chars = len(text) - self._stops.num_held_chars(text)
        self._held_text = text[num_shown_chars:]
        return self._emit(text[:num_shown_chars])

    def flush(self) -> str:
        """Releases all held-back text; the sequence is finished.

        An incomplete UTF-8 sequence at the very end comes out as the tokenizer decodes it
        (U+FFFD). Returns "" after a stop string, and on a second call.
        """
        if self.stopped or self._is_flushed:
            return ""
        text, stop_reason = self._final_text()
        self._is_flushed = True
        self._stop_reason = stop_reason
        self._held_text = ""
        return self._emit(text).text

    def _final_text(self) -> tuple[str, str | None]:
        """What flush releases (cut at a stop string the held text completes), and that stop."""
        unread_text = self._decode(self._window)[len(self._prefix_text) :]
        text = self._held_text + unread_text
        match = self._stops.find(text)
        if match is None:
            return text, None
        return text[: self._stops.cut(match)], match.stop

    def _read_new_text(self) -> str:
        """Text the window's unread tokens add, or "" while it ends in a broken character."""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) or len(text) < len(self._prefix_text):
            return ""  # wait for the tokens that complete the character
        new_text = text[len(self._prefix_text) :]
        # The next window starts at the tokens just read: their text is its context.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        num_context_tokens = min(NUM_PROMPT_CONTEXT_TOKENS, len(prompt_token_ids))
        context = list(prompt_token_ids[len(prompt_token_ids) - num_context_tokens :])
        # A prompt that ends inside a character would merge its bytes with the output's:
        # decode the output on its own instead.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return str(
                self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
            )
        # No cleanup of spaces before punctuation: it looks across window edges, so a stream
        # would differ from a whole decode (transformers 5 skips it for BPE anyway).
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)  # a flat list of ids decodes to one string
        return text

    def _stop_at(self, text: str, match: _StopMatch) -> DetokenizerDelta:
        self._stop_reason = match.stop
        self._held_text = ""
        return self._emit(text[: self._stops.cut(match)])

    def _emit(self, text: str) -> DetokenizerDelta:
        if text:
            self._emitted.append(text)
        return self._delta(text)

    def _delta(self, text: str) -> DetokenizerDelta:
        return DetokenizerDelta(text, self.stopped, self._stop_reason)
