"""The client's multiplexed reader: many out streams, one blocked ``XREAD``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis.exceptions import ResponseError

from clients import (
    AsyncClient,
    Client,
    ClientClosedError,
    ErrorCode,
    ErrorEvent,
    RequestTimeoutError,
    TokenEvent,
    aio,
    protocol,
    reader,
)
from tests.redis_server import RedisServer


def _token(seq: int) -> dict[str, bytes]:
    event = TokenEvent(seq=seq, text=f"t{seq}", token_ids=[seq])
    return {protocol.PAYLOAD_FIELD: protocol.encode(event)}


def _end() -> dict[str, bytes]:
    event = ErrorEvent(code=ErrorCode.INTERNAL, message="end of test stream")
    return {protocol.PAYLOAD_FIELD: protocol.encode(event)}


async def _read_all(client: AsyncClient, request_id: str, after: str = "0-0") -> list[int]:
    seqs = []
    async for event in client.events(request_id, after=after, timeout_s=30):
        if isinstance(event, TokenEvent):
            seqs.append(event.seq)
    return seqs


async def _blocked_clients(client: AsyncClient) -> int:
    """Redis's count of blocked connections, once the reader has blocked (5 s at most)."""
    for _ in range(100):
        blocked = int((await client.redis.info("clients"))["blocked_clients"])
        if blocked:
            return blocked
        await asyncio.sleep(0.05)
    return 0


def test_fifty_streams_share_one_blocked_read(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            keys = client.keys
            readers = [asyncio.create_task(_read_all(client, f"r{i}")) for i in range(50)]
            assert await _blocked_clients(client) == 1  # one XREAD, not fifty
            for seq in range(5):
                pipe = client.redis.pipeline(transaction=False)
                for i in range(50):
                    pipe.xadd(keys.out(f"r{i}"), _token(seq))
                await pipe.execute()
            for i in range(50):
                await client.redis.xadd(keys.out(f"r{i}"), _end())
            assert await asyncio.gather(*readers) == [list(range(5))] * 50
            wake_keys = [k async for k in client.redis.scan_iter(keys.client_wake("*"))]
            assert len(wake_keys) == 1
        check = redis_server.client()
        assert list(check.scan_iter(keys.client_wake("*"))) == []  # close() deleted it
        check.close()

    asyncio.run(scenario())


def test_a_stream_subscribed_during_a_blocked_read_is_read_at_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the wake, the second stream would wait out the first one's block (an hour).
    monkeypatch.setattr(reader, "READ_BLOCK_MS", 3_600_000)

    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            first = asyncio.create_task(_read_all(client, "first"))
            assert await _blocked_clients(client) == 1  # the read under way waits in Redis
            second = asyncio.create_task(_read_all(client, "second"))
            await asyncio.sleep(0.2)
            await client.redis.xadd(client.keys.out("second"), _token(0))
            await client.redis.xadd(client.keys.out("second"), _end())
            assert await asyncio.wait_for(second, 10) == [0]
            await client.redis.xadd(client.keys.out("first"), _end())
            assert await asyncio.wait_for(first, 10) == []

    asyncio.run(scenario())


def test_two_readers_of_one_stream_from_different_positions(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            out = client.keys.out("shared")
            ids = [await client.redis.xadd(out, _token(seq)) for seq in range(3)]
            whole = asyncio.create_task(_read_all(client, "shared"))
            tail = asyncio.create_task(_read_all(client, "shared", after=ids[1].decode()))
            assert await _blocked_clients(client) == 1  # both read what was there, and wait
            await client.redis.xadd(out, _token(3))
            await client.redis.xadd(out, _end())
            assert await whole == [0, 1, 2, 3]
            assert await tail == [2, 3]

    asyncio.run(scenario())


def test_a_reader_that_joins_a_stream_during_a_read_from_further_on_misses_nothing(
    redis_server: RedisServer,
) -> None:
    """The second reader of a stream subscribes while the read under way started past its
    position (``resume`` then ``result`` of a running request): it gets every entry, not
    those of that read only."""

    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            out = client.keys.out("joined")
            for seq in range(3):
                await client.redis.xadd(out, _token(seq))
            first = asyncio.create_task(_read_all(client, "joined"))
            await _blocked_clients(client)  # the first reader has seen 0..2 and waits after 2
            read = client.redis.xread
            late: list[asyncio.Task[list[int]]] = []

            async def read_then_subscribe(streams: dict[str, str], **kwargs: object) -> object:
                reply = await read(streams, **kwargs)  # type: ignore[arg-type]
                if reply and not late:  # the read came back with token 3: a reader joins now
                    late.append(asyncio.create_task(_read_all(client, "joined")))
                    await asyncio.sleep(0.1)  # it subscribes before this reply is delivered
                return reply

            client.redis.xread = read_then_subscribe  # type: ignore[method-assign]
            await client.redis.xadd(out, _token(3))
            await asyncio.sleep(0.3)
            await client.redis.xadd(out, _end())
            assert await first == [0, 1, 2, 3]
            assert late and await late[0] == [0, 1, 2, 3]

    asyncio.run(scenario())


def test_a_key_of_the_wrong_type_fails_only_its_own_reader(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            await client.redis.set(client.keys.out("not-a-stream"), "x")
            good = asyncio.create_task(_read_all(client, "good"))
            await asyncio.sleep(0.2)
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await _read_all(client, "not-a-stream")
            await client.redis.xadd(client.keys.out("good"), _token(0))
            await client.redis.xadd(client.keys.out("good"), _end())
            assert await asyncio.wait_for(good, 10) == [0]

    asyncio.run(scenario())


def test_stream_ids_order_like_redis() -> None:
    ids = ["10-2", "9-5", "10-10", "0-0", "10-0"]
    assert sorted(ids, key=reader.stream_id) == ["0-0", "9-5", "10-0", "10-2", "10-10"]


def test_an_unexpected_read_error_reaches_its_readers_and_the_next_read_recovers(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            real_xread, num_calls = client.redis.xread, 0

            async def fails_once(*args: object, **kwargs: object) -> object:
                nonlocal num_calls
                num_calls += 1
                if num_calls == 1:
                    raise RuntimeError("a bug in the read")
                return await real_xread(*args, **kwargs)

            monkeypatch.setattr(client.redis, "xread", fails_once)
            with pytest.raises(RuntimeError, match="a bug in the read"):
                await asyncio.wait_for(_read_all(client, "first"), 10)
            await client.redis.xadd(client.keys.out("second"), _token(0))
            await client.redis.xadd(client.keys.out("second"), _end())
            assert await asyncio.wait_for(_read_all(client, "second"), 10) == [0]

    asyncio.run(scenario())


def test_a_bad_after_fails_its_own_caller_not_the_other_readers(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            good = asyncio.create_task(_read_all(client, "good"))
            await _blocked_clients(client)
            for bad in ("not-an-id", "1-x", "-1", "", "1-2-3"):
                with pytest.raises(ValueError, match="after must be a stream entry id"):
                    await _read_all(client, "other", after=bad)
            await client.redis.xadd(client.keys.out("good"), _token(0))
            await client.redis.xadd(client.keys.out("good"), _end())
            assert await asyncio.wait_for(good, 10) == [0]  # untouched by the bad ones

    asyncio.run(scenario())


def test_closing_the_client_ends_the_reads_waiting_on_it(redis_server: RedisServer) -> None:
    """Closed while reads wait (no worker answers them): each raises ``ClientClosedError``
    at once rather than waiting for ever, the async client's and the blocking client's."""

    async def scenario() -> None:
        client = AsyncClient(redis_server.url, prefix="closing")
        waiting = [asyncio.create_task(_read_all(client, f"r{i}")) for i in range(3)]
        await _blocked_clients(client)
        await client.close()
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(r, ClientClosedError) for r in results), results

    asyncio.run(scenario())

    blocking = Client(redis_server.url, prefix="closing", timeout_s=600)
    outcome: list[BaseException | None] = []

    def wait_for_an_answer() -> None:
        try:
            blocking.complete(prompt="nobody serves this", max_tokens=4)
            outcome.append(None)
        except BaseException as exc:  # the test reads which
            outcome.append(exc)

    thread = threading.Thread(target=wait_for_an_answer)
    thread.start()
    time.sleep(0.5)
    blocking.close()
    thread.join(timeout=15)
    assert not thread.is_alive() and isinstance(outcome[0], ClientClosedError), outcome
    with pytest.raises(ClientClosedError):
        blocking.submit(prompt="after close", max_tokens=1)


def test_a_stream_that_times_out_cancels_its_request(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``complete`` does: nobody reads the request any more, so no worker should run it."""
    monkeypatch.setattr(aio, "DEADLINE_GRACE_S", 0.0)

    async def scenario() -> None:
        async with AsyncClient(redis_server.url, prefix="nobody") as client:
            with pytest.raises(RequestTimeoutError):
                async for _ in client.stream(prompt="x", max_tokens=2, timeout_s=0.3,
                                             request_id="streamed"):  # fmt: skip
                    pass
            assert await client.redis.get(client.keys.cancel("streamed")) is not None

    asyncio.run(scenario())


def test_the_sync_client_reads_every_event_as_the_async_one_does(
    redis_server: RedisServer,
) -> None:
    """``Client.events`` yields tokens and the terminal event, ``error`` included, and resumes
    after an ``event_id`` as ``AsyncClient.events`` does."""
    with Client(redis_server.url) as client:
        keys, redis = protocol.Keys(protocol.DEFAULT_PREFIX), redis_server.client()
        for seq in range(3):
            redis.xadd(keys.out("sync"), _token(seq))
        redis.xadd(keys.out("sync"), _end())
        redis.close()
        events = list(client.events("sync", timeout_s=30))
        assert [type(e).__name__ for e in events] == [*["TokenEvent"] * 3, "ErrorEvent"]
        assert isinstance(events[-1], ErrorEvent) and events[-1].message == "end of test stream"
        resumed = list(client.events("sync", after=events[0].event_id, timeout_s=30))
        assert [e.seq for e in resumed if isinstance(e, TokenEvent)] == [1, 2]
