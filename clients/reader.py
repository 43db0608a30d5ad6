"""One blocking ``XREAD`` for every out stream a client is reading.

A client with many requests in flight (an application server, ``pagestream bench serve``)
would otherwise hold one connection per request, each blocked in its own ``XREAD`` and woken
once per engine step: 256 streams at 100 steps per second is 25,600 round trips a second,
more than one Python process can make. ``StreamReader`` reads all of them in one call on one
connection: each step's events arrive in a single reply, and each subscriber gets its
entries through a queue.

A subscriber added while the call is blocked must not wait for it to time out: the reader
also reads a small *wake* stream of its own, and ``subscribe`` appends to it, which ends the
blocked call so that the next one includes the new stream.

On a Redis Cluster one ``XREAD`` cannot span hash slots. With K > 1 shards a request's out
stream carries its shard's hash tag, so ``ShardedReader`` reads all of a shard's streams
with one ``XREAD`` (a ``StreamReader`` per shard, each with a wake stream in its slot);
with one shard every out stream has a slot of its own, and ``PerStreamReader`` reads each
alone. Either way each read goes straight to its primary (``clients.connect.read_streams``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clients import protocol
from clients.connect import TRANSIENT_CLUSTER_ERRORS, read_streams
from clients.protocol import Keys, hash_tag

READ_BLOCK_MS = 1000  # one XREAD waits at most this long (then the subscriber set is rebuilt)
READ_COUNT = 256  # entries per stream per call
WAKE_TTL_S = 3600  # the wake stream outlives a client that exits without closing by this much
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, *TRANSIENT_CLUSTER_ERRORS)

Entry = tuple[str, bytes]  # (entry id, payload)
_ENTRY_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a tuple that orders like Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def checked_entry_id(entry_id: str) -> str:
    """``entry_id`` if it is a stream entry id (``MS-SEQ`` or ``MS``), else ``ValueError``:
    the client checks it before subscribing, since a bad one in the read that serves every
    stream of the client would fail them all."""
    if not isinstance(entry_id, str) or _ENTRY_ID.fullmatch(entry_id) is None:
        raise ValueError(
            f"after must be a stream entry id like '1700000000000-0', got {entry_id!r}"
        )
    return entry_id


class ReaderClosedError(Exception):
    """What a subscriber waiting when its reader is closed gets (unless the closer says)."""


@dataclass(eq=False)
class Subscription:
    """One reader of one out stream: entries after ``last_id`` arrive on ``queue``."""

    key: str
    last_id: str
    queue: asyncio.Queue[Entry | BaseException] = field(default_factory=asyncio.Queue)


class StreamReader:
    """Reads every subscribed stream with one ``XREAD BLOCK`` (started on demand).

    Connection errors are retried with backoff (a restarting Redis is waited for); an error
    reply is handed to the subscribers it concerns, whose queue then yields it.
    """

    def __init__(self, redis: Any, keys: Keys, wake_key: str | None = None) -> None:
        self._redis = redis
        # On a cluster the wake stream must share the slot of the streams read with it.
        self._wake_key = wake_key or keys.client_wake(uuid.uuid4().hex)
        self._wake_last_id = "0-0"
        self._wake_pending = False
        self._subscriptions: dict[str, list[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None

    async def subscribe(self, key: str, after: str) -> Subscription:
        """Start delivering ``key``'s entries after ``after``; ``unsubscribe`` when done."""
        subscription = Subscription(key, after)
        self._subscriptions.setdefault(key, []).append(subscription)
        if self._task is None:  # the first read will include it
            self._task = asyncio.create_task(self._run(), name="pagestream-stream-reader")
        elif not self._wake_pending:
            self._wake_pending = True  # one wake covers every subscriber added until the read
            with contextlib.suppress(*REDIS_ERRORS):  # the reader is retrying anyway
                await self._wake()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop delivering to ``subscription`` (the reader stops when none is left)."""
        subscriptions = self._subscriptions.get(subscription.key, [])
        if subscription in subscriptions:
            subscriptions.remove(subscription)
        if not subscriptions:
            self._subscriptions.pop(subscription.key, None)

    async def close(self, error: BaseException | None = None) -> None:
        """Stop reading and delete the wake stream. Every subscriber still waiting gets
        ``error`` (default: ``ReaderClosedError``) rather than waiting forever."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(error)
        with contextlib.suppress(*REDIS_ERRORS):
            await self._redis.delete(self._wake_key)

    def _fail_all(self, error: BaseException | None) -> None:
        for subscriptions in self._subscriptions.values():
            for subscription in subscriptions:
                subscription.queue.put_nowait(error or ReaderClosedError("the reader was closed"))
        self._subscriptions.clear()

    async def _wake(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._wake_key, {"w": 1}, maxlen=1, approximate=False)
        pipe.expire(self._wake_key, WAKE_TTL_S)
        await pipe.execute()

    async def _run(self) -> None:
        try:
            await self._read_while_subscribed()
        except Exception as exc:  # unexpected: every reader gets it rather than waiting forever
            self._fail_all(exc)
        finally:
            if self._task is asyncio.current_task():
                self._task = None  # the next subscriber starts a new reader

    async def _read_while_subscribed(self) -> None:
        delay_s = BACKOFF_MIN_S
        while self._subscriptions:
            # Each stream is read from the oldest position any of its subscribers needs.
            streams = {self._wake_key: self._wake_last_id}
            for key, subscriptions in self._subscriptions.items():
                streams[key] = min((s.last_id for s in subscriptions), key=stream_id)
            self._wake_pending = False
            try:
                reply = await read_streams(
                    self._redis, streams, count=READ_COUNT, block_ms=READ_BLOCK_MS
                )
            except REDIS_ERRORS:
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, BACKOFF_MAX_S)
                continue
            except ResponseError as exc:  # no retry fixes it: fail whom it concerns
                await self._fail(exc, list(streams)[1:])
                continue
            delay_s = BACKOFF_MIN_S
            for raw_key, entries in reply or []:
                key = _text(raw_key)
                self._deliver(key, entries, read_from=streams.get(key, "0-0"))

    async def _fail(self, exc: ResponseError, keys: list[str]) -> None:
        """Hand ``exc`` to the subscribers of keys that are not streams (a key reused for
        something else fails its own readers only), or to everyone when none is the cause
        (NOPERM, ...)."""
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.type(key)
            types = [_text(t) for t in await pipe.execute()]
            culprits = [k for k, t in zip(keys, types, strict=True) if t not in ("stream", "none")]
        except (*REDIS_ERRORS, ResponseError):
            culprits = []
        for key in culprits or keys:
            for subscription in self._subscriptions.pop(key, []):
                subscription.queue.put_nowait(exc)

    def _deliver(
        self, key: str, entries: list[tuple[bytes, dict[bytes, bytes]]], read_from: str
    ) -> None:
        """Hand ``entries`` (read after ``read_from``) to the key's subscribers. A subscriber
        that needs older entries (it subscribed while this read was under way) gets none of
        them: the next read starts at its position, so it misses nothing in between."""
        if key == self._wake_key:
            self._wake_last_id = _text(entries[-1][0])
            return
        payload_field = protocol.PAYLOAD_FIELD.encode()
        decoded = [
            (_text(entry_id), fields.get(payload_field, b"")) for entry_id, fields in entries
        ]
        start = stream_id(read_from)
        for subscription in self._subscriptions.get(key, []):
            after = stream_id(subscription.last_id)
            if after < start:
                continue
            for entry_id, payload in decoded:
                if stream_id(entry_id) > after:
                    subscription.queue.put_nowait((entry_id, payload))
                    subscription.last_id = entry_id


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class PerStreamReader(StreamReader):
    """``StreamReader`` for a Redis Cluster, where one ``XREAD`` cannot span hash slots (and
    every out stream has a slot of its own): each stream is read by a blocked ``XREAD`` of its
    own, on a connection to the primary that holds it, started with its first subscriber and
    ended once it has none (within a read's block time)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        super().__init__(redis, keys)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def subscribe(self, key: str, after: str) -> Subscription:
        subscription = Subscription(key, after)
        self._subscriptions.setdefault(key, []).append(subscription)
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._read_stream(key), name=f"read {key}")
        return subscription

    async def close(self, error: BaseException | None = None) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(error)

    async def _read_stream(self, key: str) -> None:
        delay_s = BACKOFF_MIN_S
        try:
            while self._subscriptions.get(key):
                read_from = min((s.last_id for s in self._subscriptions[key]), key=stream_id)
                try:
                    reply = await read_streams(
                        self._redis, {key: read_from}, count=READ_COUNT, block_ms=READ_BLOCK_MS
                    )
                except REDIS_ERRORS:
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, BACKOFF_MAX_S)
                    continue
                except ResponseError as exc:  # not a stream: its readers fail
                    for subscription in self._subscriptions.pop(key, []):
                        subscription.queue.put_nowait(exc)
                    return
                delay_s = BACKOFF_MIN_S
                for _, entries in reply or []:
                    self._deliver(key, entries, read_from=read_from)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]


class ShardedReader:
    """The reader of a Redis Cluster deployment with K > 1 shards: a ``StreamReader`` per hash
    tag (shard) of the streams subscribed, so that one blocked ``XREAD`` on the shard's
    primary reads every in-flight stream of that shard (at most K reads at a time)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._client_id = uuid.uuid4().hex
        self._readers: dict[str, StreamReader] = {}

    async def subscribe(self, key: str, after: str) -> Subscription:
        """Start delivering ``key``'s entries after ``after``; ``unsubscribe`` when done."""
        tag = hash_tag(key)
        reader = self._readers.get(tag)
        if reader is None:
            wake_key = self._keys.client_wake(self._client_id, tag)
            reader = self._readers[tag] = StreamReader(self._redis, self._keys, wake_key)
        return await reader.subscribe(key, after)

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop delivering to ``subscription``."""
        reader = self._readers.get(hash_tag(subscription.key))
        if reader is not None:
            reader.unsubscribe(subscription)

    async def close(self, error: BaseException | None = None) -> None:
        """Stop every shard's read and delete the wake streams (waiting subscribers get
        ``error``, as ``StreamReader.close``)."""
        readers, self._readers = list(self._readers.values()), {}
        await asyncio.gather(*(reader.close(error) for reader in readers))


Reader = StreamReader | ShardedReader
