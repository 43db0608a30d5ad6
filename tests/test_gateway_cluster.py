"""The OpenAI gateway and ``pagestream health`` against a real 3-primary Redis Cluster.

A worker and a gateway both with ``redis_cluster`` and K = 3 request shards; the cluster
(``worker.local_cluster``) refuses any command or script whose keys lie in different hash
slots. The worker's name puts its heartbeat on a primary other than the one the URL names,
so the gateway's and ``health``'s look-up of the heartbeats must scan every primary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from clients import Client, protocol
from clients.protocol import CLUSTER_SLOTS, DoneEvent, FinishReason, Keys, WorkerStatus, key_slot
from commands import main
from tests.gateway_fixtures import API_KEY, LONG_MAX_TOKENS, GatewayThread, wait_for
from tests.redis_cluster import NUM_PRIMARIES, RedisCluster
from tests.redis_server import RedisServer
from tests.service_fixtures import FAST, InProcessWorker
from worker.gateway.config import GatewaySettings
from worker.settings import WorkerSettings

NUM_SHARDS = 3
KEYS = Keys(num_shards=NUM_SHARDS)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IGNORE_EOS = {"ignore_eos": True}
HEARTBEAT_TIMEOUT_S = 30.0


def primary_of(key: str) -> int:
    """The index of the primary that holds ``key`` (the slots are split in port order)."""
    return key_slot(key) * NUM_PRIMARIES // CLUSTER_SLOTS


def name_on_primary(index: int, stem: str) -> str:
    """A worker name whose heartbeat key lies on primary ``index``."""
    return next(f"{stem}{i}" for i in range(1000) if primary_of(KEYS.worker(f"{stem}{i}")) == index)


@dataclass
class ClusterStack:
    """A 3-primary cluster, one worker and one gateway, all with 3 shards."""

    cluster: RedisCluster
    worker: InProcessWorker
    gateway: GatewayThread
    worker_name: str
    model: str

    def client(self) -> Client:
        return Client(self.cluster.url, cluster=True, shards=NUM_SHARDS, timeout_s=60)


@pytest.fixture(scope="module")
def cluster_stack(chat_model_dir: Path, tmp_path_factory: Any) -> Iterator[ClusterStack]:
    cluster = RedisCluster(tmp_path_factory.mktemp("gateway-cluster"))
    cluster.start()
    name = name_on_primary(1, "gw-cluster-")  # the URL names primary 0
    settings = WorkerSettings(redis_url=cluster.url, redis_cluster=True,
                              num_shards=NUM_SHARDS, name=name, **FAST)  # fmt: skip
    worker = InProcessWorker(chat_model_dir, settings)
    gateway = None
    try:
        worker.start()
        gateway = GatewayThread(GatewaySettings(
            redis_url=cluster.url, redis_cluster=True, num_shards=NUM_SHARDS, port=0,
            api_keys=(API_KEY,),
        )).start()  # fmt: skip
        raw = cluster.client()
        wait_for(lambda: raw.exists(KEYS.worker(name)), HEARTBEAT_TIMEOUT_S)
        raw.close()
        yield ClusterStack(cluster, worker, gateway, name, str(chat_model_dir))
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        cluster.stop()


def terminal_events(raw: Any, request_id: str) -> list[protocol.Event]:
    events = [protocol.decode_event(f[b"msg"]) for _, f in raw.xrange(KEYS.out(request_id))]
    return [event for event in events if isinstance(event, protocol.TERMINAL_EVENTS)]


def out_stream_ids(raw: Any) -> set[str]:
    """The request ids that have an out stream, from every primary (with K > 1 shards a key
    is ``{p}:out:{shard tag}:id``)."""
    keys = (key.decode() for key in raw.scan_iter(f"{KEYS.prefix}:out:*"))
    return {key.split("}:", 1)[1] for key in keys}


@pytest.mark.timeout(90)
def test_chat_through_the_gateway_streamed_and_not_on_a_sharded_cluster(
    cluster_stack: ClusterStack,
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "w5 w6"}]
    raw = cluster_stack.cluster.client()
    before = out_stream_ids(raw)
    with openai.OpenAI(base_url=f"{cluster_stack.gateway.url}/v1", api_key=API_KEY,
                       max_retries=0) as client:  # fmt: skip
        whole = [
            client.chat.completions.create(
                model=cluster_stack.model, messages=messages, max_tokens=5 + i,
                temperature=0, extra_body=IGNORE_EOS,
            )
            for i in range(6)
        ]  # fmt: skip
        chunks = list(client.chat.completions.create(
            model=cluster_stack.model, messages=messages, max_tokens=5, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        ))  # fmt: skip
        completion = client.completions.create(model=cluster_stack.model, prompt=[5, 6, 7],
                                               max_tokens=4, temperature=0, extra_body=IGNORE_EOS)  # fmt: skip
    with cluster_stack.client() as redis_client:  # the template makes `w10 w5 w6 w11 w12`
        reference = redis_client.complete(token_ids=[10, 5, 6, 11, 12], max_tokens=10,
                                          temperature=0, ignore_eos=True)  # fmt: skip
        plain = redis_client.complete(token_ids=[5, 6, 7], max_tokens=4, temperature=0,
                                      ignore_eos=True)  # fmt: skip
    words = reference.text.split()
    for i, out in enumerate(whole):
        assert out.choices[0].message.content.split() == words[: 5 + i]  # type: ignore[union-attr]
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (
            5,
            5 + i,
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.split() == words[:5]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert completion.choices[0].text == plain.text
    # each gateway request answered once; every shard acknowledged and emptied
    new = out_stream_ids(raw) - before
    assert len(new) == len(whole) + 2 + 2  # the gateway's 8, the reference client's 2
    assert all(len(terminal_events(raw, request_id)) == 1 for request_id in new)
    # the entry is acknowledged and deleted just after its terminal event is written
    assert wait_for(lambda: [raw.xlen(shard) for shard in KEYS.shards] == [0] * NUM_SHARDS)
    shards_used = {KEYS.shard_for(request_id) for request_id in new}
    raw.close()
    assert len(shards_used) > 1, shards_used  # random ids: 10 requests on one of 3 shards is 3^-9


@pytest.mark.timeout(90)
def test_a_client_that_disconnects_cancels_its_request_on_a_cluster(
    cluster_stack: ClusterStack,
) -> None:
    """The gateway's cancel (``{p}:cancel:{id}``, then ``{p}:cancels``, two slots) reaches the
    worker: the request ends as ``cancelled`` long before its last token."""
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": LONG_MAX_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=cluster_stack.gateway.url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            chunk_id = json.loads(first.removeprefix("data: "))["id"]
        metrics = wait_for(lambda: _counted_499(http))
    raw = cluster_stack.cluster.client()
    try:
        done = wait_for(lambda: _done(raw, chunk_id))  # the chunks' id is the request's
    finally:
        raw.close()
    assert done.finish_reason is FinishReason.CANCELLED
    assert done.usage.completion_tokens < LONG_MAX_TOKENS
    assert 'endpoint="chat.completions",status="499"} 1' in metrics


def _counted_499(http: httpx.Client) -> str | None:
    text = http.get("/metrics").text
    return text if 'status="499"' in text else None


def _done(raw: Any, request_id: str) -> DoneEvent | None:
    events = terminal_events(raw, request_id)
    return events[0] if events and isinstance(events[0], DoneEvent) else None


@pytest.mark.timeout(90)
def test_a_gateway_on_a_home_shard_puts_its_requests_there(cluster_stack: ClusterStack) -> None:
    """``--home-shard 2``: every request the gateway names lies on shard 2 (entry, out stream
    and claim), keeps its OpenAI id form, and is answered as from any gateway."""
    raw = cluster_stack.cluster.client()
    before = out_stream_ids(raw)
    gateway = GatewayThread(GatewaySettings(
        redis_url=cluster_stack.cluster.url, redis_cluster=True, num_shards=NUM_SHARDS,
        home_shard=2, port=0, api_keys=(API_KEY,),
    )).start()  # fmt: skip
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY,
                           max_retries=0) as client:  # fmt: skip
            chats = [
                client.chat.completions.create(
                    model=cluster_stack.model, messages=[{"role": "user", "content": "w5"}],
                    max_tokens=3, temperature=0, extra_body=IGNORE_EOS,
                )
                for _ in range(6)
            ]  # fmt: skip
    finally:
        gateway.stop()
    new = out_stream_ids(raw) - before
    raw.close()
    assert {chat.id for chat in chats} == new
    assert all(request_id.startswith("chatcmpl-") for request_id in new)
    assert {KEYS.key_shard(request_id) for request_id in new} == {2}
    assert {KEYS.shard_for(request_id) for request_id in new} == {KEYS.shards[2]}
    assert all(chat.usage is not None and chat.usage.completion_tokens == 3 for chat in chats)


def test_a_home_shard_beyond_the_shards_is_one_clear_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gateway", "--shards", "3", "--home-shard", "3"]) != 0
    assert "home shard must be 0..2 with 3 shards, got 3" in capsys.readouterr().err


def test_gateway_health_and_models_find_the_worker_on_another_primary(
    cluster_stack: ClusterStack,
) -> None:
    assert primary_of(KEYS.worker(cluster_stack.worker_name)) != 0  # the URL's node holds none
    health = httpx.get(f"{cluster_stack.gateway.url}/health", timeout=30)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "workers": 1, "models": [cluster_stack.model]}
    models = httpx.get(f"{cluster_stack.gateway.url}/v1/models", headers=AUTH, timeout=30)
    assert [card["id"] for card in models.json()["data"]] == [cluster_stack.model]


def test_health_command_on_a_cluster(
    cluster_stack: ClusterStack, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pagestream health --redis-cluster on``: a fresh heartbeat on any primary is ok, by
    name or by host; a stale or missing one exits 1 with the reason; without the flag, a
    cluster node's URL gets a one-line error that says to add it."""
    url, name = cluster_stack.cluster.url, cluster_stack.worker_name
    raw = cluster_stack.cluster.client()
    stale_name = name_on_primary(2, "stale-")
    stale = WorkerStatus(name=stale_name, host="elsewhere", pid=1, model="m",
                         started_at_ms=0, updated_at_ms=int(time.time() * 1000) - 60_000,
                         num_in_flight=0, max_in_flight=1)  # fmt: skip
    raw.set(KEYS.worker(stale_name), protocol.encode(stale), ex=30)
    raw.close()
    cluster = ["--redis-url", url, "--redis-cluster", "on"]
    assert main(["health", *cluster, "--name", name]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {name} (")
    assert main(["health", *cluster]) == 0  # by host: scans every primary
    assert capsys.readouterr().out.startswith(f"ok: {name} (")
    for missing in (stale_name, "nobody"):
        assert main(["health", *cluster, "--name", missing]) == 1
        assert f"no fresh heartbeat from worker {missing!r}" in capsys.readouterr().err
    assert main(["health", "--redis-url", url, "--name", name]) == 1
    error = capsys.readouterr().err.strip()
    assert error == (
        f"pagestream health: error: the Redis at {url} is a node of a Redis Cluster: "
        "pass --redis-cluster on (or PAGESTREAM_REDIS_CLUSTER=1)"
    )


def test_health_command_with_cluster_on_against_one_redis_says_so(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["health", "--redis-url", redis_server.url, "--redis-cluster", "on"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pagestream health: error: the Redis at {redis_server.url} is not a Redis Cluster: "
        "leave --redis-cluster off"
    )
