"""Prefix-aware routing on the queue (docs/routing.md): a conversation's turns go to the worker
that holds its prefix; a busy worker yields; a session pins; and the delivery guarantees hold
for routed entries: a dead worker's routed entry is taken over with ``restart``, a waiting one
is stolen, each answered once."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from clients import AsyncClient, Client, RestartEvent, TokenEvent, protocol
from clients.protocol import Keys, WorkerStatus
from clients.router import Router
from clients.routing import link_key, prefix_chain
from tests.gateway_fixtures import wait_for
from tests.redis_server import RedisServer
from tests.service_fixtures import slow_steps
from worker.gateway.errors import OpenAIError
from worker.gateway.translate import decode_chat, decode_completion
from worker.routing import shard_yield_threshold

KEYS = Keys()
GREEDY: dict[str, Any] = dict(max_tokens=4, temperature=0, ignore_eos=True)


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(count)]


def fake_worker(
    server: RedisServer,
    name: str,
    *,
    beat: bool = True,
    num_waiting: int = 0,
    num_in_flight: int = 0,
) -> None:
    """A worker that never reads: its routed stream and group, its listing, its heartbeat."""
    r = server.client()
    for stream in (KEYS.requests, KEYS.routed(name)):
        try:
            r.xgroup_create(stream, KEYS.group, "0", mkstream=True)
        except redis.ResponseError as exc:  # a real worker starting beside it made it first
            if "BUSYGROUP" not in str(exc):
                raise
    r.sadd(KEYS.routed_workers, name)
    if beat:
        status = WorkerStatus(
            name=name, host="h", pid=1, model="m", started_at_ms=0, updated_at_ms=0,
            num_in_flight=num_in_flight, max_in_flight=8, num_running=0, num_waiting=num_waiting,
            num_pages_free=0, num_steps=0, step_time_s=0.0,
        )  # fmt: skip
        r.set(KEYS.worker(name), protocol.encode(status), ex=30)
    r.close()


def holds(server: RedisServer, name: str, token_ids: list[int]) -> None:
    """Publish, as worker ``name`` would have, that it holds ``token_ids``' chain."""
    r = server.client()
    for link in prefix_chain(token_ids=token_ids):
        r.zadd(link_key(KEYS.prefix, link), {name: int(time.time() * 1000)})
    r.close()


def published(r: Any, keys: Keys, name: str, token_ids: list[int]) -> bool:
    """Whether worker ``name`` has published the last link of ``token_ids``' chain. It does so
    in the background after admission, so a turn's answer can come back before it lands; the
    next turn is routed by it."""
    chain = prefix_chain(token_ids=token_ids)
    assert chain, "a prompt too short to route by"
    return r.zscore(link_key(keys.prefix, chain[-1]), name) is not None


def test_a_conversations_turns_stay_on_the_worker_that_holds_its_prefix(
    start_worker: Any, redis_server: RedisServer
) -> None:
    for name in ("w1", "w2"):
        start_worker(name, routing=True)
    r = redis_server.client()
    with Client(redis_server.url, routing=True) as client:
        for conversation in range(3):
            history = tokens(conversation, 100)
            served_by, cached = [], []
            for turn in range(3):
                done = client.complete(token_ids=history, **GREEDY)
                wait_for(lambda: published(r, KEYS, done.worker, history))  # noqa: B023
                served_by.append(done.worker)
                cached.append(done.usage.cached_prompt_tokens if done.usage else 0)
                history = history + done.token_ids + tokens(100 * conversation + turn, 6)
            assert len(set(served_by)) == 1, served_by  # every turn where the prefix is cached
            assert all(count >= 64 for count in cached[1:]), cached  # its history's pages
    r.close()


def test_with_routing_a_worker_takes_one_new_entry_at_a_time_from_a_shard(
    start_worker: Any,
) -> None:
    # A shard's entry is a new conversation, and its later turns follow the worker that took
    # it: a reader that took a whole burst kept every conversation in it (116 against 76 on
    # two H100s). Its own stream and a fleet without routing still read their share.
    routed = start_worker("w1", routing=True).service
    plain = start_worker("w2").service
    assert routed.read_count(KEYS.requests, 64) == 1
    assert routed.read_count(KEYS.routed("w1"), 64) == 32  # half of the free slots: 2 sources
    assert plain.read_count(KEYS.requests, 64) == 64


def test_a_busy_routing_worker_leaves_new_conversations_to_an_idle_one(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """w1 blocks on the shard first, then runs a long routed request (its own stream); three
    new conversations arrive on the shard one after another, and the idle w2 takes each: a busy
    CPU worker (one request is its threshold) reads the shard only for what nobody idle took."""
    busy = start_worker("w1", routing=True)
    idle = start_worker("w2", routing=True)
    assert busy.service.yield_shards_at == 1 and idle.service.yield_shards_at == 1  # CPUs
    slow_steps(busy.engine, 0.03)  # 150 tokens: 4.5 s
    history = tokens(7, 100)
    holds(redis_server, "w1", history)

    async def submit_long() -> None:
        async with AsyncClient(redis_server.url, routing=True) as client:
            await client.submit(
                token_ids=history, request_id="long", **{**GREEDY, "max_tokens": 150}
            )

    asyncio.run(submit_long())
    assert wait_for(lambda: "long" in busy.service.in_flight)
    with Client(redis_server.url) as client:  # no routing: every request on the shard
        for index in range(3):
            time.sleep(0.1)  # w2 back to its blocked read after the last one
            done = client.complete(token_ids=tokens(20 + index, 30), **GREEDY)
            assert done.worker == "w2", index
    assert "long" in busy.service.in_flight  # it was busy all along


def test_the_shard_yield_threshold() -> None:
    assert shard_yield_threshold(False, None, 256, "cpu") == 0  # no routing: plain reads
    assert shard_yield_threshold(True, None, 256, "cpu") == 1
    assert shard_yield_threshold(True, None, 256, "cuda") == 16  # the affinity balance gap
    assert shard_yield_threshold(True, None, 32, "cuda") == 4
    assert shard_yield_threshold(True, 0, 256, "cpu") == 0  # never
    assert shard_yield_threshold(True, 3, 256, "cuda") == 3


def test_a_busy_worker_yields_and_a_session_pins(redis_server: RedisServer) -> None:
    async def main(server: RedisServer) -> None:
        redis = aioredis.Redis(port=server.port)
        router = Router(redis, KEYS)
        history = tokens(1, 100)
        request = protocol.new_request("r", token_ids=history, now_ms=0)
        assert await router.choose(request) is None  # nobody holds it: the shared stream
        fake_worker(server, "busy", num_waiting=2)
        holds(server, "busy", history)
        assert await router.choose(request) is None  # its holder is busy: affinity yields
        fake_worker(server, "idle")
        holds(server, "idle", history)
        assert await router.choose(request) is None  # two hold it: the shared stream balances
        longer = history + tokens(2, 100)  # the next turn, served by "idle" alone
        holds(server, "idle", longer)
        request = protocol.new_request("r2", token_ids=longer + tokens(3, 20), now_ms=0)
        assert await router.choose(request) == "idle"  # the longest prefix wins
        fake_worker(server, "pin")
        await redis.set(KEYS.session("chat-7"), "pin")
        pinned = protocol.new_request("s", token_ids=longer, session="chat-7", now_ms=0)
        assert await router.choose(pinned) == "pin"
        await redis.delete(KEYS.worker("pin"))  # its worker is gone: the prefix decides
        assert await router.choose(pinned) == "idle"
        await redis.aclose(close_connection_pool=True)

    asyncio.run(main(redis_server))


def test_the_router_reads_a_few_links_and_still_finds_the_deepest_single_holder(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long conversation: a system prompt both workers hold, then a history only "deep"
    holds, then a new turn nobody holds. The router reads the last links each and probes the
    rest, under a third of the ~170 links, and routes to "deep"."""

    async def main(server: RedisServer) -> None:
        redis = aioredis.Redis(port=server.port)
        router = Router(redis, KEYS)
        system, history = tokens(7, 300), tokens(8, 6000)
        for name in ("wide", "deep"):
            fake_worker(server, name)
            holds(server, name, system)
        holds(server, "deep", system + history)
        request = protocol.new_request("r", token_ids=system + history + tokens(9, 400), now_ms=0)
        read: list[str] = []
        zrange = type(redis.pipeline()).zrange
        monkeypatch.setattr(
            type(redis.pipeline()), "zrange",
            lambda pipe, key, *args: (read.append(key), zrange(pipe, key, *args))[1],
        )  # fmt: skip
        assert await router.choose_why(request) == ("deep", "holder")
        num_links = len(prefix_chain(token_ids=request.token_ids or []))
        assert num_links > 150 and len(read) <= num_links // 3
        await redis.aclose(close_connection_pool=True)

    asyncio.run(main(redis_server))


def test_a_holder_far_busier_than_an_idle_worker_that_holds_nothing_yields(
    redis_server: RedisServer,
) -> None:
    """The router reads every routing worker's heartbeat, not only the holders': an idle
    worker that never saw the conversation still puts the fleet out of balance."""

    async def main(server: RedisServer) -> None:
        redis = aioredis.Redis(port=server.port)
        router = Router(redis, KEYS, fleet_refresh_s=0.0)  # every heartbeat read anew
        history = tokens(4, 100)
        request = protocol.new_request("r", token_ids=history, now_ms=0)
        fake_worker(server, "loaded", num_in_flight=6)
        holds(server, "loaded", history)
        assert await router.choose(request) == "loaded"  # alone: nothing to balance against
        fake_worker(server, "spare", num_in_flight=4)
        assert await router.choose(request) == "loaded"  # 6 against 4: in balance
        fake_worker(server, "spare", num_in_flight=0)
        assert await router.choose(request) is None  # 6 against 0: the shared stream
        # a client reads the fleet at most once a second (by default): a change within it
        # is seen after it
        cached = Router(redis, KEYS)
        assert await cached.choose(request) is None
        fake_worker(server, "spare", num_in_flight=4)
        assert await cached.choose(request) is None  # the reading of a moment ago
        cached.fleet_refresh_s = 0.0
        assert await cached.choose(request) == "loaded"
        await redis.aclose(close_connection_pool=True)

    asyncio.run(main(redis_server))


def routed_submit(server: RedisServer, ghost: str, request_id: str) -> str:
    """Submit through a routing client a request that goes to ``ghost``'s stream."""
    history = tokens(7, 100)
    assert prefix_chain(token_ids=history)  # a cut or more: something to route on
    holds(server, ghost, history)

    async def submit() -> None:
        async with AsyncClient(server.url, routing=True) as client:
            await client.submit(token_ids=history, request_id=request_id, **GREEDY)

    asyncio.run(submit())
    r = server.client()
    assert r.xlen(KEYS.routed(ghost)) == 1 and r.xlen(KEYS.requests) == 0
    r.close()
    return request_id


def test_a_routed_request_whose_worker_died_is_taken_over_once(
    start_worker: Any, redis_server: RedisServer
) -> None:
    fake_worker(redis_server, "ghost")
    request_id = routed_submit(redis_server, "ghost", "orphan")
    r = redis_server.client()
    # The ghost reads it, streams a token, and dies (its heartbeat lapses).
    reply: Any = r.xreadgroup(KEYS.group, "ghost", {KEYS.routed("ghost"): ">"})
    entry_id = reply[0][1][0][0]
    r.set(KEYS.claim(request_id), entry_id)
    partial = protocol.TokenEvent(seq=0, text="w99", token_ids=[99])
    r.xadd(KEYS.out(request_id), {"msg": protocol.encode(partial)})
    r.delete(KEYS.worker("ghost"))
    start_worker("w1", routing=True)
    with Client(redis_server.url) as client:
        events = list(client.resume(request_id, timeout_s=30))
    restarts = [e for e in events if isinstance(e, RestartEvent)]
    assert len(restarts) == 1 and restarts[0].worker == "w1"
    after = events[events.index(restarts[0]) + 1 :]
    assert sum(len(e.token_ids) for e in after if isinstance(e, TokenEvent)) == 4
    assert isinstance(events[-1], protocol.DoneEvent) and events[-1].worker == "w1"
    deadline_s = time.monotonic() + 10  # acknowledged and deleted, then the stream pruned
    while r.sismember(KEYS.routed_workers, "ghost") and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert not r.exists(KEYS.routed("ghost")) and not r.sismember(KEYS.routed_workers, "ghost")
    r.close()


def test_an_entry_waiting_on_a_live_busy_worker_is_stolen_once(
    start_worker: Any, redis_server: RedisServer
) -> None:
    start_worker("w1", routing=True, steal_after_ms=300)
    fake_worker(redis_server, "slow")  # joins later; alive (heartbeat), but never reads
    started_s = time.monotonic()
    request_id = routed_submit(redis_server, "slow", "stolen")
    with Client(redis_server.url) as client:
        events = list(client.resume(request_id, timeout_s=30))
    assert time.monotonic() - started_s >= 0.3  # not before it waited steal_after_ms
    assert not any(isinstance(e, RestartEvent) for e in events)
    assert [type(e).__name__ for e in events].count("DoneEvent") == 1
    assert isinstance(events[-1], protocol.DoneEvent) and events[-1].worker == "w1"
    r = redis_server.client()
    # acknowledged and deleted from the slow one's stream, just after its done event
    assert wait_for(lambda: r.xlen(KEYS.routed("slow")) == 0)
    assert r.sismember(KEYS.routed_workers, "slow")  # live: its stream is kept
    r.close()


def test_the_gateway_passes_a_session_and_refuses_an_empty_one() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "session": "chat-7"}
    assert decode_chat(json.dumps(body).encode(), chat_max_tokens=8).inputs["session"] == "chat-7"
    plain = decode_completion(json.dumps({"prompt": "hi"}).encode()).inputs
    assert "session" not in plain  # no pin unless asked: `user` is never taken as one
    with pytest.raises(OpenAIError) as error:
        decode_completion(json.dumps({"prompt": "hi", "session": ""}).encode())
    assert (error.value.status, error.value.body.param) == (400, "session")
