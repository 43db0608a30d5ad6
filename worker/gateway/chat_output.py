"""One chat choice's text as OpenAI's message parts: reasoning, content and tool calls.

The text goes through the reasoning parser first (when the deployment has one and the request
did not turn thinking off), then what is content through the tool-call reader (when the
request has tools). Streamed, each event's text becomes at most one delta; whole, the parts
are joined at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.gateway.reasoning import REASONING_PARSERS, ReasoningParser
from worker.gateway.tool_parsers import ToolCall, ToolCallDelta, ToolDelta, ToolOutput
from worker.gateway.tools import ToolPlan


@dataclass
class ChatParts:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)

    def add(self, other: ChatParts) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass(frozen=True)
class ChatFormat:
    """How a chat request's output is read: its reasoning parser and its tool plan."""

    reasoning_parser: str | None = None
    tools: ToolPlan | None = None

    @property
    def is_plain(self) -> bool:
        return self.reasoning_parser is None and self.tools is None

    def reader(self) -> ChoiceReader:
        return ChoiceReader(self)


class ChoiceReader:
    """Splits one choice's text as it arrives (see the module)."""

    def __init__(self, chat_format: ChatFormat) -> None:
        self.format = chat_format
        name = chat_format.reasoning_parser
        self._reasoning: ReasoningParser | None = None
        if name is not None:
            self._reasoning = REASONING_PARSERS[name]()
        plan = chat_format.tools
        self._tools: ToolOutput | None = None if plan is None else plan.output()
        # With tools, the content's trailing whitespace is held back until text follows it,
        # and dropped at the end if the choice made calls: the newlines after and between
        # calls are not content, streamed or whole (the rule depends on the text alone, not
        # on how it was split into events).
        self._held_space = ""

    def feed(self, text: str) -> ChatParts:
        parts = ChatParts()
        content = text
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            parts.reasoning, content = split.reasoning, split.content
        self._add_content(parts, content, final=False)
        return parts

    def flush(self) -> ChatParts:
        """The end of the output: whatever was held back."""
        parts = ChatParts()
        content = ""
        if self._reasoning is not None:
            split = self._reasoning.flush()
            parts.reasoning, content = split.reasoning, split.content
        self._add_content(parts, content, final=True)
        return parts

    @property
    def calls(self) -> list[ToolCall]:
        """The complete tool calls (after ``flush``)."""
        return [] if self._tools is None else self._tools.calls

    def finish_reason(self, reason: str) -> str:
        """A choice that stopped by itself after making calls ends with ``tool_calls``."""
        plan = self.format.tools
        if plan is not None and reason == "stop" and self.calls:
            return plan.finish_reason
        return reason

    def _add_content(self, parts: ChatParts, content: str, final: bool) -> None:
        if self._tools is None:
            parts.content = content
            return
        delta = self._tools.feed(content) if content else None
        if delta is not None:
            parts.content, parts.tool_calls = self._hold_space(delta), delta.tool_calls
        if final:
            end = self._tools.flush()
            parts.content += self._hold_space(end)
            parts.tool_calls += end.tool_calls
            if not self.calls:  # plain text after all: its trailing whitespace is text
                parts.content += self._held_space
            self._held_space = ""

    def _hold_space(self, delta: ToolDelta) -> str:
        """The delta's content to show now: the held whitespace goes out before the next
        text."""
        text = self._held_space + delta.content
        shown = text.rstrip()
        self._held_space = text[len(shown) :]
        return shown
