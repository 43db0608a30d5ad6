"""Sharded request streams, and the whole service on a real 3-primary Redis Cluster.

The cluster (``tests/redis_cluster.py``) refuses any command or script whose keys lie in
different hash slots, so these tests fail on any call that would not run on a cluster; the
worker reads K = 3 shards, one per primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from clients import Client, DoneEvent, FinishReason, RestartEvent, TokenEvent, protocol
from clients.connect import TRANSIENT_CLUSTER_ERRORS, connect
from clients.protocol import CLUSTER_SLOTS, Keys, key_slot
from tests.gateway_fixtures import wait_for
from tests.redis_cluster import RedisCluster
from tests.service_fixtures import FAST, InProcessWorker, slow_steps
from tests.test_local_stack import http_server_on
from tests.test_worker_routing import published
from worker.delivery import Entry, RequestStream
from worker.local_stack import RedisProcess
from worker.settings import WorkerSettings

NUM_SHARDS = 3
KEYS = Keys(num_shards=NUM_SHARDS)
GREEDY = dict(temperature=0, ignore_eos=True)


def test_shard_keys_lie_in_their_own_third_of_the_slots_and_one_shard_is_the_old_stream() -> None:
    assert Keys().shards == ["pagestream:requests"] and Keys().shard_for("any") == Keys().requests
    slots = [key_slot(key) for key in KEYS.shards]
    assert [slot * NUM_SHARDS // CLUSTER_SLOTS for slot in slots] == [0, 1, 2]
    assert len(set(KEYS.shards)) == NUM_SHARDS and all(
        k.startswith("pagestream:requests:{") for k in KEYS.shards
    )
    # by id, else by session: a conversation's turns share a shard
    placed = {KEYS.shard_for(f"r{i}") for i in range(30)}
    assert placed == set(KEYS.shards)
    assert len({KEYS.shard_for(f"r{i}", session="chat-1") for i in range(30)}) == 1
    with pytest.raises(ValueError, match=r"number of shards must be 1\.\.256, got 0"):
        Keys(num_shards=0)


def ids_on_every_shard(per_shard: int) -> list[str]:
    """Request ids, ``per_shard`` of them placed on each shard."""
    chosen: dict[str, list[str]] = {shard: [] for shard in KEYS.shards}
    for i in range(1000):
        bucket = chosen[KEYS.shard_for(f"c{i}")]
        if len(bucket) < per_shard:
            bucket.append(f"c{i}")
    return [request_id for ids in chosen.values() for request_id in ids]


def cluster_worker(cluster: RedisCluster, model_dir: Path, name: str) -> InProcessWorker:
    settings = WorkerSettings(
        redis_url=cluster.url, redis_cluster=True, num_shards=NUM_SHARDS, name=name, **FAST
    )
    return InProcessWorker(model_dir, settings).start()


def terminal_events(r: Any, request_id: str) -> list[protocol.Event]:
    events = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(KEYS.out(request_id))]
    return [e for e in events if isinstance(e, protocol.TERMINAL_EVENTS)]


@pytest.mark.timeout(60)
def test_requests_on_every_shard_of_a_cluster_are_answered_once(
    redis_cluster: RedisCluster,
    text_model_dir: Path,
) -> None:
    worker = cluster_worker(redis_cluster, text_model_dir, "w1")
    slow_steps(worker.engine)  # the mid-stream cancel lands before the 200 tokens are out
    request_ids = ids_on_every_shard(2)
    try:
        with Client(redis_cluster.url, cluster=True, shards=NUM_SHARDS, timeout_s=30) as client:
            for i, request_id in enumerate(request_ids):
                client.submit("w5 w6 w7", request_id=request_id, max_tokens=4 + i, **GREEDY)
            completions = [client.result(request_id) for request_id in request_ids]
            streamed = list(client.stream("w8 w9", max_tokens=3, **GREEDY))
            # A third party cancels by id alone, without even the shards: the cancel key is
            # the id's whatever K.
            with Client(redis_cluster.url, cluster=True) as other:
                other.cancel("cancelled")  # before it is sent: the worker finds the key
                client.submit("w5", request_id="cancelled", max_tokens=200, **GREEDY)
                stopped = client.result("cancelled")
                running = client.submit("w5", max_tokens=200, **GREEDY)
                events = client.resume(running, timeout_s=30)
                assert isinstance(next(events), TokenEvent)
                other.cancel(running)  # mid-stream: the notice reaches the worker
                ended = list(events)[-1]
    finally:
        worker.stop()
    assert [len(c.token_ids) for c in completions] == [4 + i for i in range(len(request_ids))]
    assert all(c.finish_reason is FinishReason.LENGTH and c.worker == "w1" for c in completions)
    assert (
        isinstance(streamed[-1], DoneEvent)
        and sum(len(e.token_ids) for e in streamed if isinstance(e, TokenEvent)) == 3
    )
    assert stopped.finish_reason is FinishReason.CANCELLED and not stopped.token_ids
    assert isinstance(ended, DoneEvent) and ended.finish_reason is FinishReason.CANCELLED
    assert ended.usage.completion_tokens < 200
    r = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        assert [r.xlen(shard) for shard in KEYS.shards] == [0, 0, 0]  # acknowledged, deleted
        assert all(len(terminal_events(r, request_id)) == 1 for request_id in request_ids)
        nodes = {r.get_node_from_key(shard).port for shard in KEYS.shards}
        assert nodes == set(redis_cluster.ports)  # one shard on each primary
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_a_dead_workers_entry_on_a_shard_is_taken_over_and_answered_once(
    redis_cluster: RedisCluster,
    text_model_dir: Path,
) -> None:
    """A worker reads a request from shard 2, streams a token and dies; a live worker takes
    the entry over when its lease expires: one ``restart``, then the whole answer, once."""
    request_id = next(i for i in ids_on_every_shard(1) if KEYS.shard_for(i) == KEYS.shards[2])
    r = redis.RedisCluster.from_url(redis_cluster.url)
    with Client(redis_cluster.url, cluster=True, shards=NUM_SHARDS) as client:
        reference = None
        client.submit("w5 w6 w7", request_id=request_id, max_tokens=6, **GREEDY)
        shard = KEYS.shards[2]
        r.xgroup_create(shard, KEYS.group, "0", mkstream=True)
        started_s = time.monotonic()  # the entry's idle time counts from its delivery
        ((_, ((entry_id, _),)),) = r.xreadgroup(KEYS.group, "ghost", {shard: ">"})
        r.set(KEYS.claim(request_id), f"{entry_id.decode()} {shard} ghost")
        partial = protocol.TokenEvent(seq=0, text="w99", token_ids=[99])
        r.xadd(KEYS.out(request_id), {"msg": protocol.encode(partial)})
        worker = cluster_worker(redis_cluster, text_model_dir, "w2")
        try:
            events = list(client.resume(request_id, timeout_s=30))
            reference = client.complete("w5 w6 w7", max_tokens=6, **GREEDY)
        finally:
            worker.stop()
    restarts = [e for e in events if isinstance(e, RestartEvent)]
    assert len(restarts) == 1 and restarts[0].worker == "w2"
    after = events[events.index(restarts[0]) + 1 :]
    assert [
        t for e in after if isinstance(e, TokenEvent) for t in e.token_ids
    ] == reference.token_ids
    assert time.monotonic() - started_s >= FAST["lease_s"]  # taken over once the lease ran out
    try:
        assert len(terminal_events(r, request_id)) == 1 and r.xlen(shard) == 0
        # the new owner's, marked finished by its terminal event
        assert r.get(KEYS.claim(request_id)).decode() == f"{entry_id.decode()} {shard} w2 done"
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_routing_on_a_cluster_keeps_a_conversation_on_its_worker(
    redis_cluster: RedisCluster,
    text_model_dir: Path,
) -> None:
    """Prefix-aware routing's scripts (enqueue, peek, prune) each touch one slot: on a
    cluster, a conversation's turns go to the worker that holds its history, each answered
    once, and every stream is empty after."""
    workers = [
        InProcessWorker(
            text_model_dir,
            WorkerSettings(
                redis_url=redis_cluster.url, redis_cluster=True, num_shards=NUM_SHARDS,
                name=name, routing=True, **FAST,
            ),
        ).start()
        for name in ("w1", "w2")
    ]  # fmt: skip
    history = [5 + (i * 37) % 190 for i in range(100)]
    served_by, cached, request_ids = [], [], []
    r = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        with Client(
            redis_cluster.url, cluster=True, shards=NUM_SHARDS, routing=True, timeout_s=30
        ) as client:
            for turn in range(3):
                done = client.complete(token_ids=history, max_tokens=4, **GREEDY)
                wait_for(lambda: published(r, KEYS, done.worker, history))  # noqa: B023
                served_by.append(done.worker)
                cached.append(done.usage.cached_prompt_tokens if done.usage else 0)
                request_ids.append(done.request_id)
                history = history + done.token_ids + [7 + turn] * 6
    finally:
        for worker in workers:
            worker.stop()
    assert len(set(served_by)) == 1, served_by  # where the history's pages are
    assert all(count >= 64 for count in cached[1:]), cached
    try:
        assert all(len(terminal_events(r, request_id)) == 1 for request_id in request_ids)
        streams = [*KEYS.shards, *(KEYS.routed(name) for name in ("w1", "w2"))]
        assert [r.xlen(stream) for stream in streams] == [0] * len(streams)
    finally:
        r.close()


def key_on_primary(index: int) -> str:
    """A key in the slot range of primary ``index``."""
    return next(f"k{n}" for n in range(1000) if key_slot(f"k{n}") * 3 // CLUSTER_SLOTS == index)


def kill(node: RedisProcess) -> None:
    assert node.process is not None
    node.process.send_signal(signal.SIGKILL)
    node.process.wait()
    node.process = None


async def retried(call: Callable[[], Awaitable[object]], tries: int = 50) -> int:
    """Call until it succeeds (Redis errors of a cluster coming back retried); the tries."""
    for attempt in range(1, tries + 1):
        try:
            await call()
            return attempt
        except (RedisConnectionError, *TRANSIENT_CLUSTER_ERRORS):
            await asyncio.sleep(0.1)
    raise AssertionError(f"still failing after {tries} tries")


@pytest.mark.timeout(60)
def test_a_cluster_client_is_back_once_its_killed_primary_is(redis_cluster: RedisCluster) -> None:
    """Blocked reads on all three primaries when one dies: redis-py closes every connection
    and drops each node that failed from those it asks for the slot map, so it has none left
    and never recovers ("cannot be connected ... None"). ``connect``'s client asks the nodes
    it knew, and says ConnectionError (which callers retry) while none answers."""

    async def run() -> tuple[list[str], int, list[int]]:
        client = connect(redis_cluster.url, cluster=True)
        keys = [key_on_primary(index) for index in range(3)]
        try:
            for key in keys:
                await client.xadd(key, {"n": 1})
            reads = [asyncio.create_task(client.xread({key: "$"}, block=5000)) for key in keys]
            await asyncio.sleep(0.3)  # all three blocked
            kill(redis_cluster.nodes[1])
            failures = await asyncio.gather(*reads, return_exceptions=True)
            with pytest.raises(RedisConnectionError):  # down: a ConnectionError, retried
                await client.xadd(keys[1], {"n": 2})
            redis_cluster.nodes[1].start()  # same port and folder: back in the cluster
            attempts = await retried(lambda: client.xadd(keys[1], {"n": 2}))
            lengths = [await client.xlen(key) for key in keys]
            return [type(failure).__name__ for failure in failures], attempts, lengths
        finally:
            await client.aclose()

    failures, attempts, lengths = asyncio.run(run())
    assert failures == ["ConnectionError"] * 3
    # every primary serves; the restarted one (no AOF in this fixture) holds the new entry only
    assert attempts >= 1 and lengths == [1, 1, 1]


def test_an_entry_dead_lettered_on_a_cluster_has_one_letter(redis_cluster: RedisCluster) -> None:
    """The letter (the dead stream's slot) and the acknowledgement (the shard's) are two calls
    on a cluster: the call sent again, or a worker that died between them and the next worker
    that takes the entry over, still leave one letter per entry, and the entry gone."""

    async def scenario() -> tuple[int, list[int], bool]:
        r = connect(redis_cluster.url, cluster=True)
        shard = KEYS.shards[2]
        worker, heir = RequestStream(r, KEYS, "w"), RequestStream(r, KEYS, "v")
        await worker.ensure_group(shard)
        ids = [(await r.xadd(shard, {"msg": b"junk"})).decode() for _ in range(2)]
        await r.xreadgroup(KEYS.group, "w", {shard: ">"}, count=2)
        letters = [
            protocol.DeadLetter(entry_id=entry_id, code=protocol.ErrorCode.INVALID_REQUEST,
                                message="bad", worker="w", payload=b"junk")
            for entry_id in ids
        ]  # fmt: skip
        await worker.dead_letter(Entry(ids[0], {}, stream=shard), letters[0])
        await worker.dead_letter(Entry(ids[0], {}, stream=shard), letters[0])  # reply lost
        # w writes the second entry's letter and dies before its acknowledgement; v takes over
        marker = KEYS.lettered(shard, ids[1])
        await worker._cluster_dead_letter(keys=[KEYS.dead, marker],
                                          args=[protocol.encode(letters[1]), 1000, 60])  # fmt: skip
        await r.xclaim(shard, KEYS.group, "v", 0, [ids[1]])
        await heir.dead_letter(Entry(ids[1], {}, stream=shard, times_delivered=2), letters[1])
        dead = [
            protocol.decode_struct(f[b"msg"], protocol.DeadLetter)
            for _, f in await r.xrange(KEYS.dead)
        ]
        same_slot = key_slot(marker) == key_slot(KEYS.dead)
        length = await r.xlen(shard)
        await r.aclose()
        return length, sorted(ids.index(letter.entry_id) for letter in dead), same_slot

    assert asyncio.run(scenario()) == (0, [0, 1], True)


@pytest.mark.parametrize("squatter", ["socket", "web server"])
def test_a_cluster_on_free_ports_starts_on_others_when_one_is_taken_first(
    tmp_path: Path, squatter: str
) -> None:
    """Another process binds a port after it was found free (another test process, here a
    listening socket, or a server that answers): the cluster starts again on other free
    ports rather than failing."""
    import socket

    cluster = RedisCluster(tmp_path)
    taken = cluster.ports[1]
    with contextlib.ExitStack() as stack:
        if squatter == "web server":
            stack.enter_context(http_server_on(taken))
        else:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", taken))
            sock.listen()
        try:
            cluster.start()
            assert taken not in cluster.ports
            client = cluster.client()
            try:
                assert client.cluster_info()["cluster_state"] == "ok"
            finally:
                client.close()
        finally:
            cluster.stop()
