"""The gateway at the HTTP level: bad bodies, auth, size limits, health, metrics, a client
that disconnects mid-stream (seen from the worker's side), curl, and the command itself."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.sse_client import HttpError, SseConnection
from clients.protocol import DoneEvent, FinishReason, Keys, decode_event
from tests.gateway_fixtures import API_KEY, LONG_MAX_TOKENS, Stack, start_gateway, wait_for
from worker.local_stack import free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STOP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway.url, headers=AUTH, timeout=30) as client:
        yield client


def test_a_body_that_is_not_json_or_has_a_wrong_type_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] == "invalid_json"
    response = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": "many"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "max_tokens"
    response = http.post("/v1/completions", json={"prompt": "w5", "temperature": "hot"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "temperature"
    assert "Expected `float | null`, got `str`" in error["message"]
    response = http.post("/v1/chat/completions", json={"model": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_missing_key_is_401_but_health_is_open(stack: Stack) -> None:
    with httpx.Client(base_url=stack.gateway.url, timeout=30) as anonymous:
        response = anonymous.post("/v1/completions", json={"prompt": "w5"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        health = anonymous.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "workers": 1, "models": [stack.model]}


def test_a_body_over_the_limit_is_413(http: httpx.Client, stack: Stack) -> None:
    limit = stack.gateway.settings.max_body_bytes
    big = {"prompt": "w5 " * (limit // 3 + 1), "max_tokens": 1}
    response = http.post("/v1/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    chunked = http.post("/v1/completions", content=iter([b"x" * limit, b"x"]))  # no length
    assert chunked.status_code == 413


def test_unknown_route_gets_an_error_object(http: httpx.Client) -> None:
    response = http.get("/v1/engines")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_client_disconnect_cancels_the_request_and_frees_its_pages(
    http: httpx.Client, stack: Stack
) -> None:
    engine = stack.worker.engine
    idle_pages_free = engine.stats().num_pages_free
    body = {"prompt": [5, 6, 7, 8], "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        request_id = json.loads(first.removeprefix("data: "))["id"]
    # The connection is closed: the worker must end the request as cancelled, long before
    # its last token, and give its pages back.
    done = _done_event(stack, request_id)
    assert done.finish_reason is FinishReason.CANCELLED
    assert done.usage.completion_tokens < LONG_MAX_TOKENS
    wait_for(lambda: engine.stats().num_pages_free == idle_pages_free)
    metrics = http.get("/metrics").text
    assert 'pagestream_gateway_requests_total{endpoint="completions",status="499"} 1' in metrics


def test_metrics_count_requests_and_time_tokens(http: httpx.Client) -> None:
    before = http.get("/metrics").text
    response = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert response.status_code == 200
    after = http.get("/metrics").text
    assert after.startswith("# HELP pagestream_gateway_requests_total")

    def value(text: str, name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    ok = 'pagestream_gateway_requests_total{endpoint="completions",status="200"}'
    assert value(after, ok) == value(before, ok) + 1
    assert value(after, "pagestream_gateway_time_to_first_token_seconds_count") >= 1
    assert value(after, "pagestream_gateway_requests_in_flight") == 0


def test_health_is_503_without_workers_or_redis(stack: Stack) -> None:
    for redis_url, reason in ((stack.redis.url, "no fresh worker heartbeat"),
                              (f"redis://127.0.0.1:{free_port()}/0", "redis unreachable")):  # fmt: skip
        gateway = start_gateway(redis_url, prefix="nobody")
        try:
            health = httpx.get(f"{gateway.url}/health", timeout=30)
            completion = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "w5"})
        finally:
            gateway.stop()
        assert health.status_code == 503 and reason in health.json()["reason"]
        assert completion.status_code == 503
        assert completion.json()["error"]["type"] == "service_unavailable"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl here")
def test_curl_streams_a_chat_answer(stack: Stack) -> None:
    """The curl example of docs/gateway.md, in the same form."""
    body = json.dumps({"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4,
                       "stream": True, "ignore_eos": True})  # fmt: skip
    result = subprocess.run(
        ["curl", "-sSN", f"{stack.base_url}/chat/completions", "-H", f"Authorization: Bearer {API_KEY}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    events = [line.removeprefix("data: ") for line in result.stdout.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)


def test_the_command_serves_with_keys_from_the_environment(stack: Stack, tmp_path: Path) -> None:
    """``pagestream gateway`` as a process, two server processes on one port: keys from
    PAGESTREAM_API_KEY, SIGTERM stops it, and it never loads torch."""
    port = free_port()
    env = {**os.environ, "PAGESTREAM_API_KEY": "k1,k2", "PYTHONUNBUFFERED": "1"}
    code = ("import sys, runpy; sys.argv = ['pagestream', 'gateway', *sys.argv[1:]]; "
            "from commands import main; rc = main(); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")  # fmt: skip
    args = [sys.executable, "-c", code, "--redis-url", stack.redis.url, "--port", str(port),
            "--log-level", "WARNING", "--workers", "2"]  # fmt: skip
    process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/health"), timeout_s=30)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"})
        refused = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3"})
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=STOP_TIMEOUT_S)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == stack.model
    assert refused.status_code == 401
    assert process.returncode == 0, stderr
    assert stdout.strip() == "no torch"
    assert f"http://127.0.0.1:{port}/v1 -> {stack.redis.url}" in stderr
    assert "2 process(es)" in stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_the_benchmarks_sse_client_streams_and_reuses_its_connection(stack: Stack) -> None:
    async def run() -> tuple[list[list[bytes]], int]:
        connection = SseConnection(stack.base_url, AUTH)
        body = json.dumps({"prompt": [5, 6], "max_tokens": 3, "stream": True,
                           "ignore_eos": True}).encode()  # fmt: skip
        try:
            streams = []
            for _ in range(2):
                streams.append(
                    [data async for data in connection.post_events("/completions", body)]
                )
            with pytest.raises(HttpError) as refused:
                _ = [data async for data in connection.post_events("/no-such-route", b"{}")]
        finally:
            await connection.close()
        return streams, refused.value.status

    streams, status = asyncio.run(run())
    for events in streams:  # one connection, two streams, each whole
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert status == 404


def _done_event(stack: Stack, request_id: str) -> DoneEvent:
    """The worker's terminal ``done`` event of ``request_id``, read from Redis."""
    redis = stack.redis.client()

    def read() -> DoneEvent | None:
        for entry_id, fields in redis.xrange(Keys().out(request_id)):
            event = decode_event(fields[b"msg"], entry_id.decode())
            if isinstance(event, DoneEvent):
                return event
        return None

    try:
        done: DoneEvent = wait_for(read)
    finally:
        redis.close()
    return done


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(stack: Stack) -> None:
    """Not streamed: the client closes its connection once the request runs (its out stream
    exists); the worker cancels it."""
    before = _request_ids(stack)
    body = json.dumps(
        {"prompt": [5, 6], "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    ).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", stack.gateway.settings.port)) as sock:
        sock.sendall(head.encode() + body)
        request_id = wait_for(lambda: next(iter(_request_ids(stack) - before), None))
    done = _done_event(stack, request_id)
    assert done.finish_reason is FinishReason.CANCELLED
    assert done.usage.completion_tokens < LONG_MAX_TOKENS


def test_the_deadline_ends_a_request_as_length(stack: Stack) -> None:
    gateway = start_gateway(stack.redis.url, timeout_s=0.3)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    try:
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    finally:
        gateway.stop()
    choice = response.json()["choices"][0]
    assert response.status_code == 200 and choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] < LONG_MAX_TOKENS  # cut by the deadline


def _request_ids(stack: Stack) -> set[str]:
    redis = stack.redis.client()
    try:
        head, tail = Keys().out("*").split("*")  # pagestream:out:{*}: the id in a hash tag
        keys = (key.decode() for key in redis.scan_iter(f"{head}*{tail}"))
        return {key[len(head) : len(key) - len(tail)] for key in keys}
    finally:
        redis.close()
