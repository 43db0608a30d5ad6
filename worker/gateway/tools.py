"""``tools`` and ``tool_choice`` on chat: what the template is given, how the output is read.

- ``none``: the template is not given the tools; the output is plain content.
- ``auto`` (the default with tools): the template is given the tools and the output is read
  by the deployment's tool-call parser (``tool_parsers``); a deployment without one refuses it.
- ``required``: decoded under a JSON schema (a structured output) of an array of one or more
  ``{"name", "arguments"}`` objects, each name one of the tools and its arguments valid for
  that tool's ``parameters`` (one item at most with ``parallel_tool_calls: false``).
- a named function: decoded under that function's ``parameters`` schema; the output is the
  call's arguments. Its ``finish_reason`` is ``stop``, as OpenAI's is for a forced call;
  calls made under ``auto`` or ``required`` end with ``tool_calls``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from worker.gateway.errors import OpenAIError, unsupported
from worker.gateway.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolOutput,
    new_call_id,
)

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools run."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as the request gave them
    parser: str | None = None  # auto: the tool-call parser's name
    name: str | None = None  # named: the function
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is given."""
        return None if self.mode == "none" else self.tools

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is decoded under (required and named)."""
        parameters = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.mode == "named":
            assert self.name is not None
            return parameters[self.name]
        if self.mode != "required":
            return None
        items = [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
             "arguments": params}, "required": ["name", "arguments"],
             "additionalProperties": False}
            for name, params in parameters.items()
        ]  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def output(self) -> ToolOutput:
        """A fresh reader of one choice's output."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCallOutput(self.name)
        if self.mode == "required":
            return RequiredCallsOutput()
        assert self.parser is not None
        return TOOL_CALL_PARSERS[self.parser]()

    def with_parser(self, parser: str | None) -> ToolPlan:
        """This plan reading ``auto`` output with ``parser``; refused (400) without one."""
        if self.mode != "auto":
            return self
        if parser is None:
            raise unsupported("tools", "this deployment has no tool-call parser for tool_choice "
                              "auto: start the gateway with --tool-call-parser "
                              "(docs/tool-calling.md)")  # fmt: skip
        return dataclasses.replace(self, parser=parser)

    @property
    def finish_reason(self) -> str:
        """What a choice that made calls (and stopped by itself) ends with."""
        return "stop" if self.mode == "named" else "tool_calls"


def plan_tools(
    tools: list[Any] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> ToolPlan | None:
    """The plan for a request's tools (None without any); raises ``OpenAIError`` (400).
    Under ``auto`` its parser is set once the model is known (``with_parser``)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    checked = [_check_tool(index, tool) for index, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in checked]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tools: function names must be unique", param="tools")
    parallel = parallel_tool_calls is not False
    mode, name = _mode(tool_choice, names)
    if mode == "auto" and not parallel:
        raise unsupported("parallel_tool_calls", "parallel_tool_calls false is honoured with "
                          "tool_choice required or a named function, not auto")  # fmt: skip
    return ToolPlan(mode, checked, None, name, parallel)


def _mode(tool_choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise OpenAIError(400, f"tool_choice {tool_choice!r} is not none, auto, required "
                              "or a function", param="tool_choice")  # fmt: skip
        return tool_choice, None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(400, 'tool_choice must name a function: {"type": "function", '
                          '"function": {"name": ...}}', param="tool_choice")  # fmt: skip
    if name not in names:
        raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools",
                          param="tool_choice")  # fmt: skip
    return "named", name


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise unsupported("tools", f'{where}: only tools of type "function" are supported')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(400, f"{where}.function needs a name", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise OpenAIError(400, f"{where}.function.parameters must be a JSON schema object",
                          param="tools")  # fmt: skip
    return tool


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters: dict[str, Any] | None = tool["function"].get("parameters")
    return parameters or _EMPTY_PARAMETERS


def template_messages_tool_calls(tool_calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: ``function.arguments``
    as an object (templates write it with ``tojson``), when it is JSON text of one."""
    converted = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(400, f"messages[{index}].tool_calls: each needs a function "
                              "with a name", param="messages")  # fmt: skip
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # else the template gets the text as it is
                arguments = json.loads(arguments)
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return converted


# -- the output of a forced call ----------------------------------------------------------------


class NamedCallOutput:
    """The output is the arguments of a call to ``name``: streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self.calls: list[ToolCall] = []
        self._arguments = ""
        self._started = False

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, self.id, self.name))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
            self._arguments += text
        return out

    def flush(self) -> ToolDelta:
        out = self.feed("") if not self._started else ToolDelta()
        self.calls = [ToolCall(self.id, self.name, self._arguments)]
        return out


class RequiredCallsOutput:
    """The output is a JSON array of calls: read whole at the end (each call then sent as
    its name, then its arguments). Text that is not such an array stays content."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""

    def feed(self, text: str) -> ToolDelta:
        self._text += text
        return ToolDelta()

    def flush(self) -> ToolDelta:
        try:
            items = json.loads(self._text)
        except ValueError:
            items = None
        valid = isinstance(items, list) and all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
        )
        if not valid or not items:
            return ToolDelta(content=self._text)
        out = ToolDelta()
        for index, item in enumerate(items):
            arguments = json.dumps(item.get("arguments", {}))
            call = ToolCall(new_call_id(), item["name"], arguments)
            self.calls.append(call)
            out.tool_calls.append(ToolCallDelta(index, call.id, call.name))
            out.tool_calls.append(ToolCallDelta(index, arguments=arguments))
        return out
