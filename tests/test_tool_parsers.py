"""The gateway's output readers on text: the hermes tool-call parser, the qwen3 reasoning
parser and the forced-call readers, whole and streamed in pieces split everywhere."""

from __future__ import annotations

import json
from typing import Any

import pytest

from worker.gateway.chat_output import ChatFormat, ChatParts
from worker.gateway.errors import OpenAIError
from worker.gateway.reasoning import ThinkTagParser
from worker.gateway.tool_parsers import HermesToolParser
from worker.gateway.tools import ToolPlan, plan_tools

WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CLOCK: dict[str, Any] = {"type": "function", "function": {"name": "time_now"}}
TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"extra": {"nested": [1, "}"]}}}\n</tool_call>\n<tool_call>\n{"name": "time_now", '
    '"arguments": {}}\n</tool_call>'
)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def read(chat_format: ChatFormat, chunks: list[str]) -> tuple[ChatParts, list[ChatParts], list]:
    """Everything the reader gave, joined, every delta, and the complete calls."""
    reader = chat_format.reader()
    deltas = [reader.feed(chunk) for chunk in chunks] + [reader.flush()]
    joined = ChatParts()
    for delta in deltas:
        joined.add(delta)
    return joined, deltas, reader.calls


def streamed_calls(deltas: list[ChatParts]) -> list[dict[str, str]]:
    """Calls put together from deltas as an OpenAI client does, checking the order: a call's
    first piece has its id and name, every later piece arguments only."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.id and piece.name and piece.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.name, "arguments": ""}
            else:
                assert piece.id is None and piece.name is None
                calls[piece.index]["arguments"] += piece.arguments
    return [calls[index] for index in sorted(calls)]


AUTO = ChatFormat(tools=ToolPlan("auto", [WEATHER, CLOCK], parser="hermes"))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(TWO_CALLS)])
def test_hermes_calls_whole_and_split_anywhere(size: int) -> None:
    joined, deltas, calls = read(AUTO, pieces(TWO_CALLS, size))
    # the whitespace around the calls is not content: streamed, every delta holds it back
    # until text follows (none does), so the stream's content is the whole response's
    assert joined.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "extra": {"nested": [1, "}"]}}),
        ("time_now", {}),
    ]
    streamed = streamed_calls(deltas)
    assert [s["arguments"] for s in streamed] == [c.arguments for c in calls]
    assert [s["id"] for s in streamed] == [c.id for c in calls]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # the arguments stream as they are written, not all at the end
    if size == 1:
        assert sum(1 for d in deltas for p in d.tool_calls if p.arguments) > 10


def test_hermes_text_without_calls_and_broken_blocks_stay_content() -> None:
    text = "a < b, <tool_c and <tool_call>not json</tool_call> end"
    for size in (1, 4, len(text)):
        joined, _, calls = read(AUTO, pieces(text, size))
        assert joined.content == text and calls == []


def test_with_tools_whitespace_is_held_until_text_follows_or_the_end() -> None:
    text = "  two  words \n\n"  # no call: all of it is content, the trailing space too
    for size in (1, 3, len(text)):
        joined, deltas, _ = read(AUTO, pieces(text, size))
        assert joined.content == text
        assert all(d.content == d.content.rstrip() for d in deltas[:-1])  # held back
    call = '<tool_call>{"name": "time_now", "arguments": {}}</tool_call>'
    for size in (1, 4, 100):  # text after a call is content; the trailing newline not
        joined, _, calls = read(AUTO, pieces(f"Sure. {call}\n then done.\n", size))
        assert joined.content == "Sure. \n then done." and len(calls) == 1


def test_hermes_block_cut_off_by_max_tokens() -> None:
    joined, _, calls = read(AUTO, pieces('<tool_call>{"name": "get_weather", "argu', 3))
    assert calls == [] and joined.content == '<tool_call>{"name": "get_weather", "argu'
    _, _, calls = read(AUTO, pieces('<tool_call>{"name": "time_now", "arguments": {"a', 3))
    assert [c.name for c in calls] == ["time_now"] and calls[0].arguments == '{"a'


THINKING = "<think>\nThe user wants </thi nk> the weather.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("size", [1, 2, 6, len(THINKING)])
def test_qwen3_reasoning_split_anywhere(size: int) -> None:
    joined, deltas, _ = read(ChatFormat(reasoning_parser="qwen3"), pieces(THINKING, size))
    assert joined.reasoning == "\nThe user wants </thi nk> the weather.\n"
    assert joined.content == "It is sunny."
    # no delta mixes the tags in: every piece is reasoning or content text
    assert not any("<think" in d.reasoning + d.content or "</think" in d.content for d in deltas)


def test_qwen3_without_think_is_content_and_cut_reasoning_is_reasoning() -> None:
    joined, _, _ = read(ChatFormat(reasoning_parser="qwen3"), pieces("<thin is not a tag", 2))
    assert (joined.reasoning, joined.content) == ("", "<thin is not a tag")
    joined, _, _ = read(ChatFormat(reasoning_parser="qwen3"), ["<think>still going"])
    assert (joined.reasoning, joined.content) == ("still going", "")


def test_reasoning_then_tool_calls() -> None:
    chat_format = ChatFormat("qwen3", AUTO.tools)
    text = "<think>I need the weather</think>\n" + TWO_CALLS
    for size in (1, 7):
        joined, deltas, calls = read(chat_format, pieces(text, size))
        assert joined.reasoning == "I need the weather"
        assert [c.name for c in calls] == ["get_weather", "time_now"]
        assert streamed_calls(deltas)[0]["arguments"] == calls[0].arguments


def test_think_parser_state_is_per_reader() -> None:
    parser = ThinkTagParser()
    assert parser.feed("<th").reasoning == "" and parser.feed("ink>x").reasoning == "x"
    assert HermesToolParser().feed("plain").content == "plain"


def test_named_and_required_plans() -> None:
    named = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}},
                       None)  # fmt: skip
    assert named is not None and named.mode == "named"
    assert named.schema() == WEATHER["function"]["parameters"]
    joined, deltas, calls = read(ChatFormat(tools=named), pieces('{"city": "Oslo"}', 3))
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert streamed_calls(deltas)[0]["arguments"] == '{"city": "Oslo"}'
    required = plan_tools([WEATHER, CLOCK], "required", False)
    assert required is not None
    schema = required.schema()
    assert schema is not None and schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["time_now"]]
    output = '[{"name": "time_now", "arguments": {}}]'
    joined, deltas, calls = read(ChatFormat(tools=required), pieces(output, 4))
    assert [(c.name, c.arguments) for c in calls] == [("time_now", "{}")]
    assert joined.content == ""


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [([WEATHER], "sometimes", "tool_choice"), ([WEATHER], {"type": "function"}, "tool_choice"),
     ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
     (None, "required", "tool_choice"), ([WEATHER, WEATHER], None, "tools"),
     ([{"type": "function", "function": {}}], None, "tools")],
)  # fmt: skip
def test_bad_tool_choices_are_400(tools: list | None, choice: object, param: str) -> None:
    with pytest.raises(OpenAIError) as exc:
        plan_tools(tools, choice, None)  # type: ignore[arg-type]
    assert exc.value.status == 400 and exc.value.body.param == param


def test_auto_needs_a_parser() -> None:
    plan = plan_tools([WEATHER], None, None)
    assert plan is not None and plan.mode == "auto"
    with pytest.raises(OpenAIError) as exc:
        plan.with_parser(None)
    assert exc.value.body.code == "unsupported_parameter"
