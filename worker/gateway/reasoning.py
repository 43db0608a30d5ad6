"""Reasoning parsers: a thinking model's reasoning split from its answer, streamed or whole.

``qwen3``: Qwen3 (and QwQ, DeepSeek-R1 style) models write ``<think>reasoning</think>answer``.
The reasoning is what stands between the tags when the output begins with ``<think>``; it goes
to ``reasoning_content``, the rest to ``content``. An output that does not begin with
``<think>`` (``enable_thinking: false``, or a model that did not think) is all content. An
output cut off inside the reasoning is all reasoning. Text that may still turn out to be a tag
is held back until it is decided, so a streamed delta never splits a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(Protocol):
    def feed(self, text: str) -> ReasoningDelta: ...

    def flush(self) -> ReasoningDelta: ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``tag`` (not all of it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkTagParser:
    """``<think>reasoning</think>content`` (see the module)."""

    START, END = "<think>", "</think>"

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self._after_end = False  # newlines right after </think> are dropped

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        if self._state == "start":
            self._decide_start()
        if self._state == "reasoning":
            out.reasoning = self._take_reasoning()
        if self._state == "content":
            out.content = self._take_content()
        return out

    def flush(self) -> ReasoningDelta:
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)

    def _decide_start(self) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.START):
            self._state, self._buffer = "reasoning", stripped[len(self.START) :]
        elif not self.START.startswith(stripped):  # cannot become <think>: no reasoning
            self._state = "content"

    def _take_reasoning(self) -> str:
        end = self._buffer.find(self.END)
        if end < 0:
            keep = partial_suffix(self._buffer, self.END)
            cut = len(self._buffer) - keep
            reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
            return reasoning
        reasoning = self._buffer[:end]
        self._buffer = self._buffer[end + len(self.END) :]
        self._state, self._after_end = "content", True
        return reasoning

    def _take_content(self) -> str:
        content, self._buffer = self._buffer, ""
        if self._after_end:
            content = content.lstrip("\n")
            self._after_end = not content
        return content


REASONING_PARSERS: dict[str, type[ThinkTagParser]] = {"qwen3": ThinkTagParser}
