"""``priority`` and ``tenant`` through the gateway (issue 31, item 3): the OpenAI body's
extension fields reach the protocol request on the stream; ``user`` is not a tenant."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from clients import protocol
from tests.gateway_fixtures import start_gateway, wait_for
from tests.redis_server import RedisServer
from tests.test_gateway_wire import DONE, KEYS, _beat
from worker.gateway.errors import OpenAIError
from worker.gateway.translate import decode_chat, decode_completion


def test_priority_and_tenant_map_onto_the_request_and_user_is_refused() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "priority": -2, "tenant": "gold"}
    inputs = decode_chat(json.dumps(body).encode(), chat_max_tokens=8).inputs
    assert (inputs["priority"], inputs["tenant"]) == (-2, "gold")
    plain = decode_completion(json.dumps({"prompt": "hi"}).encode()).inputs
    assert "priority" not in plain and "tenant" not in plain  # the client's defaults: 0, default
    # `user` names an end user, not a tenant: not honoured, so refused rather than dropped
    with pytest.raises(OpenAIError) as error:
        decode_completion(json.dumps({"prompt": "hi", "user": "alice"}).encode())
    assert (error.value.status, error.value.body.param) == (400, "user")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tenant": ""}, "tenant"),
        ({"priority": "high"}, "priority"),
        ({"priority": 2**63}, "priority"),
    ],
)
def test_a_bad_priority_or_tenant_is_a_400_naming_it(fields: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as error:
        decode_completion(json.dumps({"prompt": "hi", **fields}).encode())
    assert (error.value.status, error.value.body.param) == (400, param)


def test_the_gateway_sends_priority_and_tenant_to_the_worker(redis_server: RedisServer) -> None:
    redis = redis_server.client()
    _beat(redis)
    gateway = start_gateway(redis_server.url)
    body = {"model": "fake-model", "prompt": "x", "priority": 3, "tenant": "batch"}

    def next_request() -> protocol.Request | None:
        reply = redis.xread({KEYS.requests: "0-0"}, count=1)
        if not reply:
            return None
        return protocol.decode_request(reply[0][1][0][1][protocol.PAYLOAD_FIELD.encode()])

    try:
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json=body, timeout=30)
            request = wait_for(next_request)
            redis.xadd(KEYS.out(request.id), {protocol.PAYLOAD_FIELD: protocol.encode(DONE)})
            response = reply.result()
    finally:
        gateway.stop()
        redis.close()
    assert response.status_code == 200
    assert (request.priority, request.tenant) == (3, "batch")
