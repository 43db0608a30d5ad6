"""Tools, n > 1, chat_template_kwargs and refusals through the official ``openai`` client
against a real gateway, Redis and worker (``tests/tool_fixtures.py``): forced calls are decoded
under their JSON schema, so their arguments validate whatever the random weights say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.gateway_fixtures import Stack
from tests.tool_fixtures import tools_stack  # noqa: F401 (the fixture)

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"], "additionalProperties": False}}}  # fmt: skip
TOOLS: Any = [WEATHER, ALARM]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED: dict[str, Any] = dict(temperature=1.0, seed=7, max_tokens=60)
ONE_CALL: dict[str, Any] = dict(
    SAMPLED, parallel_tool_calls=False
)  # random weights would not stop calling


@pytest.fixture(scope="module")
def client(tools_stack: Stack) -> Iterator[openai.OpenAI]:  # noqa: F811
    with openai.OpenAI(base_url=tools_stack.base_url, api_key="none", max_retries=0) as client:
        yield client


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_is_decoded_under_its_schema(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, tool_choice=choice, n=2, **SAMPLED
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1]
    for c in response.choices:
        assert c.finish_reason == "stop"  # OpenAI's for a forced call
        calls = c.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        check_call("get_weather", calls[0].function.arguments)


def test_named_tool_choice_streams_openai_deltas(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "set_alarm"}}
    stream = client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, tool_choice=choice, stream=True, **SAMPLED
    )  # fmt: skip
    pieces = [d for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name == "set_alarm" and first.function.arguments == ""
    assert rest and all(p.id is None and p.function and p.function.name is None for p in rest)
    check_call("set_alarm", "".join(p.function.arguments or "" for p in rest if p.function))


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_calls_to_the_tools(client: openai.OpenAI, stream: bool) -> None:
    response: Any
    with client.beta.chat.completions.stream(
        model="", messages=ASK, tools=TOOLS, tool_choice="required", **ONE_CALL
    ) if stream else _whole(client) as response:  # fmt: skip
        completion = response.get_final_completion() if stream else response
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1  # parallel_tool_calls false: an array of one
    check_call(calls[0].function.name, calls[0].function.arguments)


class _whole:
    """``create`` as a context manager, to share the test's body with the streamed helper."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client

    def __enter__(self) -> Any:
        return self.client.chat.completions.create(
            model="", messages=ASK, tools=TOOLS, tool_choice="required", **ONE_CALL
        )  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        return None


def test_tools_reach_the_template_except_with_none(client: openai.OpenAI) -> None:
    def prompt_tokens(**fields: Any) -> int:
        response = client.chat.completions.create(model="", messages=ASK, max_tokens=1, **fields)
        assert response.usage is not None
        return response.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    with_tools = prompt_tokens(tools=TOOLS)  # auto: the worker's template taught hermes
    assert with_tools > plain + 20
    thinking_off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off > plain  # the template opened an empty <think></think>


def test_message_names_and_reasoning_reach_the_template(client: openai.OpenAI) -> None:
    """The template renders a message's ``name`` and an assistant's ``reasoning_content``
    (this one as Qwen's does): each lengthens the prompt the worker built."""

    def prompt_tokens(**fields: Any) -> int:
        messages = [{"role": "user", "content": "Hi", **fields.get("user", {})},
                    {"role": "assistant", "content": "Hello", **fields.get("assistant", {})},
                    {"role": "user", "content": "Weather?"}]  # fmt: skip
        response = client.chat.completions.create(model="", messages=messages, max_tokens=1)  # type: ignore[arg-type]
        assert response.usage is not None
        return response.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(user={"name": "bob"}) > plain
    assert prompt_tokens(assistant={"reasoning_content": "a greeting", "refusal": None}) > plain


def test_n_samples_share_one_prompt(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model="", messages=ASK, max_tokens=5, n=3,
                                            temperature=0)  # fmt: skip
    one = client.chat.completions.create(model="", messages=ASK, max_tokens=5, temperature=0)
    texts = [c.message.content for c in greedy.choices]
    assert texts == [one.choices[0].message.content] * 3
    assert greedy.usage is not None and one.usage is not None
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    stream = client.chat.completions.create(model="", messages=ASK, max_tokens=5, n=3, seed=3,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    text: dict[int, str] = {}
    ends: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert sorted(text) == sorted(ends) == [0, 1, 2]
    completions = client.completions.create(model="", prompt="Hello", max_tokens=4, n=2,
                                            best_of=4, seed=5)  # fmt: skip
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.usage is not None and completions.usage.completion_tokens == 4 * 4


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"store": True}, "store"), ({"user": "me"}, "user"), ({"frobnicate": True}, "frobnicate"),
     ({"logit_bias": {"5": 1}}, "logit_bias"), ({"functions": [WEATHER["function"]]}, "functions"),
     ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
     ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
     ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
     ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}],
       "tool_choice": "required"}, "tools")],
)  # fmt: skip
def test_fields_not_honoured_are_refused(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="", messages=ASK, max_tokens=2, extra_body=fields)
    error: Any = exc.value.body
    assert error["param"] == param, error
    if param in (
        "store",
        "user",
        "frobnicate",
        "logit_bias",
        "functions",
        "parallel_tool_calls",
    ):
        assert error["code"] == "unsupported_parameter" and error["type"] == "invalid_request_error"


def test_completion_fields_not_honoured_are_refused(client: openai.OpenAI) -> None:
    for fields in ({"tools": TOOLS}, {"metadata": {"a": "b"}}, {"echo": True}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model="", prompt="x", max_tokens=2, extra_body=fields)
        error: Any = exc.value.body
        assert error["code"] == "unsupported_parameter" and error["param"] == next(iter(fields))
