"""Key layout 2 on a real 3-primary Redis Cluster: with K > 1 shards the keys of a request
carry its shard's hash tag, so a worker writes a step's events for a whole shard in one
script call and a client reads a shard's streams with one blocked ``XREAD``, sent straight to
the shard's primary (no ``COMMAND GETKEYS``). Calls are counted on the servers (``INFO
commandstats``, ``CLIENT LIST``), not on mocks. One cluster serves every test here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from clients import AsyncClient, Client, protocol
from clients.protocol import Keys, TokenEvent, key_slot, shard_tag
from tests.redis_cluster import RedisCluster
from worker.delivery import Entry, EntryRef, OutEvent, Ownership, RequestStream

NUM_SHARDS = 3
SETTLE_TIMEOUT_S = 5.0
POLL_S = 0.02


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One 3-primary cluster for the module (each test uses a prefix of its own)."""
    started = RedisCluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def ids_of_shard(keys: Keys, shard: int, count: int, stem: str = "r") -> list[str]:
    """``count`` request ids whose keys lie in shard ``shard``."""
    found = (f"{stem}{i}" for i in range(10_000))
    return [i for i in found if keys.key_shard(i) == shard][:count]


def node_calls(cluster: RedisCluster, command: str) -> list[int]:
    """``INFO commandstats`` calls of ``command`` on each primary, in port order."""
    counts = []
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            stats: dict[str, Any] = node.info("commandstats")
        counts.append(
            sum(v["calls"] for k, v in stats.items() if k.startswith(f"cmdstat_{command}"))
        )
    return counts


def test_a_requests_keys_share_its_shards_slot_and_one_shard_keeps_the_id_as_tag(
    cluster: RedisCluster,
) -> None:
    keys = Keys("slots", NUM_SHARDS)
    assert (Keys().out("a"), Keys().key_layout) == ("pagestream:out:{a}", 1)  # layout 1, as ever
    assert keys.key_layout == protocol.KEY_LAYOUT_PER_SHARD
    placed = [keys.key_shard(f"r{i}") for i in range(300)]
    assert all(placed.count(shard) > 60 for shard in range(NUM_SHARDS))  # crc32 spreads ids
    with redis.RedisCluster.from_url(cluster.url) as r:
        for shard in range(NUM_SHARDS):
            tag = shard_tag(shard, NUM_SHARDS)
            for request_id in ids_of_shard(keys, shard, 2):
                own = (keys.out(request_id), keys.claim(request_id))
                assert own[0] == f"slots:out:{{{tag}}}:{request_id}"
                # the cancel key is the id's, whatever K: cancelling needs the id alone
                assert keys.cancel(request_id) == f"slots:cancel:{{{request_id}}}"
                # the server agrees: every key of the request in its shard's slot, on the
                # primary that holds the shard's request stream
                slots = {r.cluster_keyslot(key) for key in own}
                assert slots == {key_slot(f"{{{tag}}}")} == {key_slot(keys.shard(shard))}
                assert r.get_node_from_key(own[0]).port == cluster.ports[shard]
        odd = "x}{y"  # braces in an id: the shard's tag still comes first
        assert r.cluster_keyslot(keys.out(odd)) == key_slot(keys.shard(keys.key_shard(odd)))


async def _own_pending(
    r: Any, keys: Keys, stream: RequestStream, request_ids: list[str]
) -> dict[str, Entry]:
    """Enqueue each request on its shard, read it as the stream's consumer, claim its id."""
    entries: dict[str, Entry] = {}
    for shard in keys.shards:
        await stream.ensure_group(shard)
    for request_id in request_ids:
        shard = keys.shard_for(request_id)
        entry_id = (await r.xadd(shard, {"msg": b"x"})).decode()
        await stream.read_new(1, None, (shard,))
        entries[request_id] = Entry(entry_id, {}, stream=shard)
        assert await stream.own(request_id, entries[request_id]) is Ownership.NEW
    return entries


def test_a_steps_events_for_a_shards_requests_take_one_script_call_per_shard(
    cluster: RedisCluster,
) -> None:
    """Nine requests, three per shard, one of them taken over by another worker: one step's
    events go in one fenced ``EVALSHA`` per primary; the taken-over request gets nothing and
    is reported lost by its entry; the terminal events mark the claims done, acknowledge the
    entries, and a resend of the same step writes no second ``done``."""
    keys = Keys("batch", NUM_SHARDS)
    request_ids = [i for shard in range(NUM_SHARDS) for i in ids_of_shard(keys, shard, 3)]

    async def scenario() -> None:
        r = AsyncRedisCluster.from_url(cluster.url)
        try:
            await steps(r)
        finally:
            await r.aclose()

    async def steps(r: Any) -> None:
        stream = RequestStream(r, keys, "w")
        entries = await _own_pending(r, keys, stream, request_ids)
        taken, lost = request_ids[1], entries[request_ids[1]]  # another worker took it over
        await r.xclaim(lost.stream, keys.group, "other", 0, [lost.entry_id])
        await r.set(keys.claim(taken), f"{lost.entry_id} {lost.stream} other")
        warm = [OutEvent(i, entries[i].entry_id, b"warm", True, stream=entries[i].stream)
                for i in request_ids[::3]]  # fmt: skip
        await stream.publish(warm, [])  # the script is loaded on every primary
        before = node_calls(cluster, "evalsha")
        tokens = [OutEvent(i, entries[i].entry_id, b"token", False, stream=entries[i].stream)
                  for i in request_ids]  # fmt: skip
        published = await stream.publish(tokens, [])
        assert node_calls(cluster, "evalsha") == [n + 1 for n in before]  # one call per shard
        assert published.lost == [lost.ref] and published.unwritten == []
        done = [OutEvent(i, entries[i].entry_id, b"done", True, True, entries[i].stream)
                for i in request_ids]  # fmt: skip
        acks: list[EntryRef] = [entries[i].ref for i in request_ids]
        for step_acks in ([], acks):  # the reply "lost", then the same call with the acks
            published = await stream.publish(done, step_acks)
            assert published.lost == [lost.ref] and published.unwritten == []
        for request_id in request_ids:
            written = [f[b"msg"] for _, f in await r.xrange(keys.out(request_id))]
            if request_id == taken:
                assert written == []
                continue
            expected = [b"warm"] * (request_id in request_ids[::3]) + [b"token", b"done"]
            assert written == expected, request_id
            claim = f"{entries[request_id].entry_id} {entries[request_id].stream} w done"
            assert (await r.get(keys.claim(request_id))).decode() == claim
        pending = [await r.xpending(shard, keys.group) for shard in keys.shards]
        assert [p["pending"] for p in pending] == [1, 0, 0]  # only the taken-over entry

    asyncio.run(scenario())


def blocked_xreads(cluster: RedisCluster, client_name: str) -> list[int]:
    """Connections of ``client_name`` blocked in ``XREAD``, per primary."""
    counts = []
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            clients = node.client_list()
        counts.append(
            sum(c["name"] == client_name and c["cmd"] == "xread" and "b" in c["flags"]
                for c in clients)
        )  # fmt: skip
    return counts


def test_a_client_reads_each_shards_streams_with_one_xread_and_no_command_getkeys(
    cluster: RedisCluster,
) -> None:
    """Twelve requests in flight, four per shard: one blocked ``XREAD`` per primary reads all
    of its shard's, and no read asks the server for its keys."""
    keys = Keys("read", NUM_SHARDS)
    request_ids = [i for shard in range(NUM_SHARDS) for i in ids_of_shard(keys, shard, 4)]

    async def scenario() -> None:
        r = AsyncRedisCluster.from_url(cluster.url, client_name="reader-under-test")
        async with AsyncClient(prefix="read", redis=r, shards=NUM_SHARDS) as client:
            writer = AsyncRedisCluster.from_url(cluster.url)
            await asyncio.gather(r.ping(), writer.ping())  # both initialized (COMMAND ran)
            getkeys_before = node_calls(cluster, "command")
            reads = [asyncio.create_task(client.result(i, timeout_s=10)) for i in request_ids]
            await _until(lambda: blocked_xreads(cluster, "reader-under-test") == [1, 1, 1])
            await asyncio.sleep(0.2)  # settled: still one per primary
            assert blocked_xreads(cluster, "reader-under-test") == [1, 1, 1]
            for request_id in request_ids:
                token = TokenEvent(seq=0, text=" a", token_ids=[7])
                end = protocol.DoneEvent(
                    finish_reason=protocol.FinishReason.LENGTH,
                    usage=protocol.Usage(prompt_tokens=1, completion_tokens=1),
                )
                for event in (token, end):
                    await writer.xadd(keys.out(request_id), {"msg": protocol.encode(event)})
            completions = await asyncio.gather(*reads)
            await writer.aclose()
            assert [c.token_ids for c in completions] == [[7]] * len(request_ids)
            assert node_calls(cluster, "command") == getkeys_before

    asyncio.run(scenario())


async def _until(ready: Any) -> None:
    deadline_s = asyncio.get_running_loop().time() + SETTLE_TIMEOUT_S
    while not ready():
        if asyncio.get_running_loop().time() > deadline_s:
            raise TimeoutError("not settled")
        await asyncio.sleep(POLL_S)


def test_a_client_on_a_home_shard_keeps_its_requests_on_one_primary(
    cluster: RedisCluster,
) -> None:
    """Twelve requests of a client whose home shard is 1: their entries, out streams and
    claims all lie on shard 1, and one blocked ``XREAD``, on that shard's primary alone,
    reads them all; an id the caller names keeps its own shard."""
    keys = Keys("home", NUM_SHARDS)

    async def scenario() -> None:
        r = AsyncRedisCluster.from_url(cluster.url, client_name="homed-reader")
        async with AsyncClient(prefix="home", redis=r, shards=NUM_SHARDS, home_shard=1) as client:
            writer = AsyncRedisCluster.from_url(cluster.url)
            await writer.ping()
            request_ids = [await client.submit(token_ids=[1, 2], max_tokens=1) for _ in range(12)]
            assert {keys.key_shard(i) for i in request_ids} == {1}
            entries = [await writer.xlen(shard) for shard in keys.shards]
            assert entries == [0, 12, 0]
            assert {key_slot(keys.out(i)) for i in request_ids} == {key_slot(keys.shards[1])}
            reads = [asyncio.create_task(client.result(i, timeout_s=10)) for i in request_ids]
            await _until(lambda: blocked_xreads(cluster, "homed-reader") == [0, 1, 0])
            for request_id in request_ids:
                end = protocol.DoneEvent(
                    finish_reason=protocol.FinishReason.LENGTH,
                    usage=protocol.Usage(prompt_tokens=2, completion_tokens=1),
                )
                for event in (TokenEvent(seq=0, text=" a", token_ids=[7]), end):
                    await writer.xadd(keys.out(request_id), {"msg": protocol.encode(event)})
            completions = await asyncio.gather(*reads)
            assert [c.token_ids for c in completions] == [[7]] * len(request_ids)
            named = ids_of_shard(keys, 2, 1, stem="named")[0]
            assert await client.submit(token_ids=[1], max_tokens=1, request_id=named) == named
            assert await writer.xlen(keys.shards[2]) == 1
            await writer.aclose()

    asyncio.run(scenario())


def test_a_home_shard_must_be_one_of_the_shards() -> None:
    keys = Keys("home", NUM_SHARDS)
    assert keys.key_shard(keys.new_request_id(2, label="chatcmpl-")) == 2
    assert keys.new_request_id(2, label="chatcmpl-").startswith("chatcmpl-")
    for bad in (-1, NUM_SHARDS):
        with pytest.raises(ValueError, match=r"home shard must be 0\.\.2"):
            keys.new_request_id(bad)
        with pytest.raises(ValueError, match=r"home_shard must be 0\.\.2 with 3 shards"):
            AsyncClient(redis=object(), shards=NUM_SHARDS, home_shard=bad)
        threads = threading.active_count()
        with pytest.raises(ValueError, match=r"home_shard must be 0\.\.2 with 3 shards"):
            Client(shards=NUM_SHARDS, home_shard=bad)
        assert threading.active_count() == threads  # its loop thread stopped
