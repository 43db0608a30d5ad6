"""The gateway against the wire protocol itself: a real Redis and gateway, and the test in the
worker's place, writing the events a worker writes when things go wrong mid-stream."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from clients import protocol
from clients.protocol import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    Keys,
    RestartEvent,
    TokenEvent,
    Usage,
    WorkerStatus,
)
from tests.gateway_fixtures import start_gateway, wait_for
from tests.redis_server import RedisServer

KEYS = Keys()
DONE = DoneEvent(
    finish_reason=FinishReason.LENGTH, usage=Usage(prompt_tokens=1, completion_tokens=2)
)


def _beat(redis: object) -> None:
    now_ms = int(time.time() * 1000)
    status = WorkerStatus(name="fake", host="h", pid=1, model="fake-model", started_at_ms=now_ms,
                          updated_at_ms=now_ms, num_in_flight=0, max_in_flight=8)  # fmt: skip
    redis.set(KEYS.worker("fake"), protocol.encode(status), ex=protocol.HEARTBEAT_TTL_S)  # type: ignore[attr-defined]


def _serve_one(redis: object, events: list[Event], after: str) -> str:
    """Take the next request from the stream, as a worker would, and write ``events``."""

    def next_entry() -> tuple[str, bytes] | None:
        reply = redis.xread({KEYS.requests: after}, count=1)  # type: ignore[attr-defined]
        if not reply:
            return None
        entry_id, fields = reply[0][1][0]
        return entry_id.decode(), fields[protocol.PAYLOAD_FIELD.encode()]

    entry_id, payload = wait_for(next_entry)
    request = protocol.decode_request(payload)
    for event in events:
        redis.xadd(KEYS.out(request.id), {protocol.PAYLOAD_FIELD: protocol.encode(event)})  # type: ignore[attr-defined]
    return entry_id


@pytest.mark.parametrize(
    ("events", "expected_text", "error_code"),
    [
        # a worker died after streaming a token: the stream cannot take it back
        ([TokenEvent(seq=0, text=" a", token_ids=[5]), RestartEvent(attempt=1, worker="w2")],
         " a", "worker_restarted"),
        # the engine failed after a token
        ([TokenEvent(seq=0, text=" a", token_ids=[5]),
          ErrorEvent(code=ErrorCode.INTERNAL, message="engine failed")], " a", "internal_error"),
        # a restart before any token is invisible
        ([RestartEvent(attempt=1, worker="w2"), TokenEvent(seq=0, text=" b", token_ids=[6]),
          TokenEvent(seq=1, text=" c", token_ids=[7]), DONE], " b c", None),
        # a token event written twice (a retried write) is sent once
        ([TokenEvent(seq=0, text=" b", token_ids=[6]), TokenEvent(seq=0, text=" b", token_ids=[6]),
          TokenEvent(seq=1, text=" c", token_ids=[7]), DONE], " b c", None),
    ],
)  # fmt: skip
def test_mid_stream_events_become_chunks_or_an_error_event(
    redis_server: RedisServer, events: list[Event], expected_text: str, error_code: str | None
) -> None:
    redis = redis_server.client()
    _beat(redis)
    gateway = start_gateway(redis_server.url)
    body = {"model": "fake-model", "prompt": "x", "stream": True}
    try:
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json=body, timeout=30)
            _serve_one(redis, events, "0-0")
            response = reply.result()
    finally:
        gateway.stop()
        redis.close()
    assert response.status_code == 200
    datas = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(data) for data in datas[:-1]]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))
    assert text == expected_text
    if error_code is None:
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert chunks[-1]["error"]["code"] == error_code
        assert chunks[-1]["error"]["type"] == "server_error"


def test_a_worker_error_before_the_first_token_is_a_status(redis_server: RedisServer) -> None:
    redis = redis_server.client()
    _beat(redis)
    gateway = start_gateway(redis_server.url)
    error = ErrorEvent(code=ErrorCode.INVALID_REQUEST, message="top_p: must be in (0, 1]",
                       field="top_p")  # fmt: skip
    try:
        with ThreadPoolExecutor(1) as pool:
            body = {"prompt": "x", "stream": True, "top_p": 7}
            reply = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json=body, timeout=30)
            _serve_one(redis, [error], "0-0")
            response = reply.result()
    finally:
        gateway.stop()
        redis.close()
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert msgspec.json.decode(response.content)["error"]["param"] == "top_p"
