"""Tool-call parsers: a model's own tool-call format in its text, as OpenAI tool calls.

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2.5,
Qwen3 and Hermes chat templates teach the model to write them (several in a row for parallel
calls). Text outside the blocks is the message's content.

Streaming follows OpenAI's deltas: a call's first delta carries its ``index``, ``id``, ``type``
and ``function.name`` with empty arguments, as soon as the name is complete; then its
``function.arguments`` arrive in pieces as the model writes them. Text that may still become a
tag (or the closing brace of the call) is held back until it is decided. A block that is not a
JSON object with a string ``name`` is passed on as content when nothing of it was streamed as a
call yet.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from worker.gateway.reasoning import partial_suffix


@dataclass
class ToolCallDelta:
    """A piece of one call: the first has ``id`` and ``name``, the others ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A whole call: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolOutput(Protocol):
    """Reads one choice's text: content and tool-call deltas; ``calls`` once flushed."""

    calls: list[ToolCall]

    def feed(self, text: str) -> ToolDelta: ...

    def flush(self) -> ToolDelta: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HELD_TAIL = "} \t\r\n"  # may be the call's own closing brace: decided by what follows


@dataclass
class _OpenCall:
    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    args_start: int = 0  # where the arguments begin in the block's text
    num_sent: int = 0  # characters of the arguments streamed so far
    sent: str = ""


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._call: _OpenCall | None = None  # the block being read
        self.calls: list[ToolCall] = []  # every complete call, in order

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        out = ToolDelta()
        while self._step(out):
            pass
        return out

    def flush(self) -> ToolDelta:
        """The end of the output: a block left open (cut off) ends as far as it got."""
        out = ToolDelta()
        if self._call is None:
            out.content, self._buffer = self._buffer, ""
        elif self._call.name is None:
            out.content, self._buffer = self.OPEN + self._buffer, ""
        else:
            call = self._call
            rest = self._arguments(call, self._buffer)
            self._send_arguments(call, rest[call.num_sent :], out)
            self.calls.append(ToolCall(call.id, call.name or "", call.sent))
        self._call = None
        return out

    def _step(self, out: ToolDelta) -> bool:
        """Take what the buffer decides; True while there may be more to take."""
        if self._call is None:
            start = self._buffer.find(self.OPEN)
            if start < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, self.OPEN)
                out.content += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                return False
            out.content += self._buffer[:start]
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._call = _OpenCall(len(self.calls))
            return True
        end = self._buffer.find(self.CLOSE)
        if end < 0:
            self._stream(self._call, self._buffer, out)
            return False
        block, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE) :]
        self._close(self._call, block, out)
        self._call = None
        return True

    def _stream(self, call: _OpenCall, block: str, out: ToolDelta) -> None:
        if call.name is None:
            match = _HEADER.match(block)
            if match is None:
                return
            call.name = json.loads(f'"{match.group(1)}"')
            call.args_start = match.end()
            out.tool_calls.append(ToolCallDelta(call.index, call.id, call.name))
        arguments = self._arguments(call, block)
        arguments = arguments[: len(arguments) - partial_suffix(arguments, self.CLOSE)]
        safe = len(arguments.rstrip(_HELD_TAIL))
        if safe > call.num_sent:
            self._send_arguments(call, arguments[call.num_sent : safe], out)

    def _close(self, call: _OpenCall, block: str, out: ToolDelta) -> None:
        parsed = _parse_block(block)
        if call.name is None:  # nothing streamed: send it whole, or pass it on as text
            if parsed is None:
                out.content += self.OPEN + block + self.CLOSE
                return
            call.name = parsed[0]
            out.tool_calls.append(ToolCallDelta(call.index, call.id, call.name))
            self._send_arguments(call, parsed[1], out)
        else:
            rest = self._arguments(call, block).rstrip()
            rest = rest[:-1].rstrip() if rest.endswith("}") else rest  # the block's own brace
            self._send_arguments(call, rest[call.num_sent :], out)
        self.calls.append(ToolCall(call.id, call.name, call.sent))

    @staticmethod
    def _arguments(call: _OpenCall, block: str) -> str:
        """The block's arguments text so far, from their first non-blank character."""
        arguments = block[call.args_start :]
        if call.num_sent == 0:  # where the blanks after the colon end depends on the split
            call.args_start += len(arguments) - len(arguments.lstrip())
            arguments = arguments.lstrip()
        return arguments

    def _send_arguments(self, call: _OpenCall, text: str, out: ToolDelta) -> None:
        if text:
            out.tool_calls.append(ToolCallDelta(call.index, arguments=text))
            call.num_sent += len(text)
            call.sent += text


def _parse_block(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block, or None when it is not a call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return value["name"], text


TOOL_CALL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
