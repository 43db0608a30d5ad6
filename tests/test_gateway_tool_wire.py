"""Tool calls and reasoning as the ``openai`` client reads them, with the test in the worker's
place: it writes the token events a Qwen-style model writes (``<think>``, ``<tool_call>``
blocks), cut into pieces at awkward places, which a tiny random model cannot be made to write.
The gateway takes the parsers from the fake worker's heartbeat (``--*-parser auto``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from clients import protocol
from clients.protocol import DoneEvent, Event, FinishReason, Keys, TokenEvent, Usage, WorkerStatus
from tests.gateway_fixtures import GatewayThread, start_gateway, wait_for
from tests.redis_server import RedisServer

KEYS = Keys()
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time_now"}},
]
ASK: Any = [{"role": "user", "content": "weather?"}]
OUTPUT = (
    "<think>\nParis, so get_weather.\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "when": ["today", "}"]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "time_now", "arguments": {}}\n</tool_call>'
)


@pytest.fixture
def gateway(redis_server: RedisServer) -> Iterator[GatewayThread]:
    redis = redis_server.client()
    now_ms = int(time.time() * 1000)
    status = WorkerStatus(name="fake", host="h", pid=1, model="qwen-like", started_at_ms=now_ms,
                          updated_at_ms=now_ms, num_in_flight=0, max_in_flight=8,
                          tool_call_parser="hermes", reasoning_parser="qwen3")  # fmt: skip
    redis.set(KEYS.worker("fake"), protocol.encode(status), ex=protocol.HEARTBEAT_TTL_S)
    redis.close()
    gateway = start_gateway(redis_server.url)
    yield gateway
    gateway.stop()


def events_of(text: str, size: int, n: int = 1) -> list[Event]:
    """``text`` as token events of ``size`` characters for each of ``n`` samples, then done."""
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    events: list[Event] = []
    for index in range(n):
        for seq, piece in enumerate(pieces):
            last = n > 1 and seq == len(pieces) - 1
            events.append(TokenEvent(seq=index * len(pieces) + seq, text=piece, token_ids=[seq],
                                     index=index, finish_reason=FinishReason.STOP if last else None))  # fmt: skip
    usage = Usage(prompt_tokens=3, completion_tokens=n * len(pieces))
    return [*events, DoneEvent(finish_reason=FinishReason.STOP, usage=usage)]


def serve(redis_server: RedisServer, events: list[Event]) -> protocol.Request:
    """Take the next request from the stream, as a worker would, and answer with ``events``."""
    redis = redis_server.client()

    def next_entry() -> bytes | None:
        reply: Any = redis.xread({KEYS.requests: "0-0"}, count=1)
        return reply[0][1][0][1][protocol.PAYLOAD_FIELD.encode()] if reply else None

    request = protocol.decode_request(wait_for(next_entry))
    for event in events:
        redis.xadd(KEYS.out(request.id), {protocol.PAYLOAD_FIELD: protocol.encode(event)})
    redis.close()
    return request


def ask(
    gateway: GatewayThread, redis_server: RedisServer, events: list[Event], **fields: Any
) -> Any:
    """Run the ``openai`` client's chat call while the test answers it; (result, request)."""
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as client:

        def call() -> Any:
            result = client.chat.completions.create(model="qwen-like", messages=ASK, **fields)
            return list(result) if fields.get("stream") else result

        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(call)
            request = serve(redis_server, events)
            return reply.result(timeout=30), request


@pytest.mark.parametrize("size", [1, 4, 13])
def test_auto_tool_calls_and_reasoning_whole(
    gateway: GatewayThread, redis_server: RedisServer, size: int
) -> None:
    response, request = ask(gateway, redis_server, events_of(OUTPUT, size), tools=TOOLS)
    assert request.tools == TOOLS  # the worker's template gets them
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    message: Any = choice.message
    assert message.content == "Checking."
    assert message.reasoning_content == "\nParis, so get_weather.\n"
    calls = message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "time_now"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "when": ["today", "}"]}
    assert json.loads(calls[1].function.arguments) == {}


@pytest.mark.parametrize("size", [1, 3, 7])
def test_auto_tool_calls_and_reasoning_streamed(
    gateway: GatewayThread, redis_server: RedisServer, size: int
) -> None:
    chunks, _ = ask(gateway, redis_server, events_of(OUTPUT, size, n=2), tools=TOOLS,
                    stream=True, n=2)  # fmt: skip
    for index in (0, 1):
        deltas = [c.delta for chunk in chunks for c in chunk.choices if c.index == index]
        ends = [c.finish_reason for chunk in chunks for c in chunk.choices
                if c.index == index and c.finish_reason]  # fmt: skip
        assert ends == ["tool_calls"]
        assert deltas[0].role == "assistant"
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert reasoning == "\nParis, so get_weather.\n"
        assert "".join(d.content or "" for d in deltas).strip() == "Checking."
        pieces = [p for d in deltas for p in d.tool_calls or []]
        calls: dict[int, dict[str, str]] = {}
        for piece in pieces:  # OpenAI's order: id, type and name first, then arguments
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.arguments == ""
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
        assert [c["name"] for c in calls.values()] == ["get_weather", "time_now"]
        assert json.loads(calls[0]["arguments"])["when"] == ["today", "}"]
        if size == 1:  # arguments arrive as they are written
            assert sum(1 for p in pieces if p.index == 0) > 10


def test_thinking_off_and_tool_choice_none_leave_the_text_alone(
    gateway: GatewayThread, redis_server: RedisServer
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    response, request = ask(gateway, redis_server, events_of(OUTPUT, 5), tools=TOOLS,
                            tool_choice="none", extra_body=off)  # fmt: skip
    assert request.tools is None and request.chat_template_kwargs == {"enable_thinking": False}
    choice = response.choices[0]
    assert choice.message.content == OUTPUT and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert getattr(choice.message, "reasoning_content", None) is None
