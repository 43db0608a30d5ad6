"""At-least-once delivery over one Redis stream and consumer group.

A worker reads entries with ``XREADGROUP``; each stays pending (in the group's PEL) under the
worker's name until it is acknowledged with the request's terminal event. While it runs, the
worker renews its lease (resets the entry's idle time); an entry idle longer than the lease
belongs to a worker that died, and another worker takes it over with ``XAUTOCLAIM``.

``{p}:claim:{id}`` maps a request id to the stream entry that owns it: only that entry's
worker writes to ``{p}:out:{id}``, so a second entry with the same id is never run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clients import protocol
from clients.protocol import DeadLetter, ErrorEvent, Keys

# Renew only the entries still pending under this consumer; return the ids that are not (a
# worker that took them over owns them now). Atomic, so a takeover cannot slip in between.
RENEW_SCRIPT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# One engine step's events in one call: append each to its request's out stream (refreshing
# the TTL where asked), then acknowledge and delete the finished requests' entries. Atomic
# like MULTI, and one command to encode where a pipeline has hundreds (the event loop shares
# the GIL with the engine thread). Fenced: an event or acknowledgement is written only while
# its entry is still pending under this consumer, so a worker whose lease was taken over (it
# stalled, or Redis was down longer than the lease) cannot write after the new owner's
# `restart` or acknowledge the entry the new owner runs; its lost entries are returned. A
# write Redis refuses for its key (an out key that is not a stream) is reported, not retried,
# and does not stop the others. A full Redis (OOM, under `maxmemory` with `noeviction`) stops
# the call where it is, before any acknowledgement: the caller retries the rest later, so no
# event is lost and no entry is acknowledged without its terminal event.
# KEYS: the request stream, then each event's out stream. ARGV: group, consumer, TTL s,
# n events, n payloads, n TTL flags ('1' = refresh), n entry ids (the events' owners), then the
# entry ids to acknowledge. Returns {events done (n unless Redis is full), refusals as
# "key: error", entry ids no longer this consumer's}.
PUBLISH_SCRIPT = """
local group, consumer, n = ARGV[1], ARGV[2], tonumber(ARGV[4])
local owned = {}
local lost = {}
local function owns(entry_id)
  if owned[entry_id] == nil then
    local p = redis.call('XPENDING', KEYS[1], group, entry_id, entry_id, 1)
    owned[entry_id] = (p[1] ~= nil and p[1][2] == consumer)
    if not owned[entry_id] then table.insert(lost, entry_id) end
  end
  return owned[entry_id]
end
local refused = {}
for i = 1, n do
  local key = KEYS[i + 1]
  if owns(ARGV[4 + 2 * n + i]) then
    local reply = redis.pcall('XADD', key, '*', 'msg', ARGV[4 + i])
    if type(reply) == 'table' and reply.err then
      if string.find(reply.err, 'OOM', 1, true) then  -- '-OOM command not allowed ...'
        return {i - 1, refused, lost}
      end
      table.insert(refused, key .. ': ' .. reply.err)
    elseif ARGV[4 + n + i] == '1' then
      redis.call('EXPIRE', key, ARGV[3])
    end
  end
end
for j = 5 + 3 * n, #ARGV do
  if owns(ARGV[j]) then
    redis.pcall('XACK', KEYS[1], group, ARGV[j])
    redis.pcall('XDEL', KEYS[1], ARGV[j])
  end
end
return {n, refused, lost}
"""

# Errors that mean "Redis is unreachable right now": back off and retry, never give up.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class Ownership(str, enum.Enum):
    NEW = "new"  # first time this request id is seen: run it
    RETRY = "retry"  # this entry ran before (its worker died): run it again after `restart`
    DUPLICATE = "duplicate"  # another entry owns this id: drop this one


@dataclass(frozen=True, slots=True)
class OutEvent:
    """One encoded event for a request's out stream, as ``publish`` writes it."""

    request_id: str
    entry_id: str  # the request-stream entry it answers: written only while this worker owns it
    payload: bytes
    refresh_ttl: bool  # set the stream's TTL again with this write


@dataclass(frozen=True, slots=True)
class Published:
    """What ``publish`` did: the first ``num_written`` events are done (written, or skipped
    as ``lost``; all of them unless Redis is full); ``refused`` are the writes Redis refused
    for their key, as messages; ``lost`` the entries another worker has taken over."""

    num_written: int
    refused: list[str]
    lost: list[str]


@dataclass(frozen=True)
class Entry:
    """One request-stream entry as delivered to this worker."""

    entry_id: str
    fields: dict[bytes, bytes]
    times_delivered: int = 1
    stream: str = ""  # the stream it came through: "" is the shared one (docs/routing.md)

    @property
    def payload(self) -> bytes | None:
        return self.fields.get(protocol.PAYLOAD_FIELD.encode())


class RequestStream:
    """The request stream seen by one consumer (worker) of the group."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._renew = redis.register_script(RENEW_SCRIPT)
        self._publish = redis.register_script(PUBLISH_SCRIPT)

    async def ensure_group(self) -> None:
        """Create the stream and its group if missing (e.g. Redis restarted without data)."""
        try:
            await self.redis.xgroup_create(self.keys.requests, self.keys.group, "0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def key(self, stream: str) -> str:
        """The Redis key of ``stream`` ("" is the shared one)."""
        return stream or self.keys.requests

    async def read_new(
        self, count: int, block_ms: int | None, streams: tuple[str, ...] = ("",)
    ) -> list[Entry]:
        """Up to ``count`` entries (per stream) never delivered before, from ``streams``
        (keys; "" is the shared stream); waits up to ``block_ms`` (None: not at all)."""
        by_key = {self.key(stream): stream for stream in streams}
        reply = await self.redis.xreadgroup(
            self.keys.group, self.consumer, dict.fromkeys(by_key, ">"), count=count, block=block_ms
        )
        return [
            Entry(text(entry_id), fields or {}, stream=by_key[text(key)])
            for key, entries in reply or []
            for entry_id, fields in entries
        ]

    async def claim_expired(
        self, count: int, min_idle_ms: int, cursor: str, stream: str = ""
    ) -> tuple[str, list[Entry]]:
        """Take over up to ``count`` entries of ``stream`` idle for ``min_idle_ms``; returns
        (next cursor, entries)."""
        reply = await self.redis.xautoclaim(
            self.key(stream), self.keys.group, self.consumer, min_idle_ms, cursor, count=count
        )
        next_cursor, claimed = text(reply[0]), reply[1]
        # Entries deleted while pending come back as nil (Redis 6.2): nothing to run.
        entries = [(text(i), f) for i, f in claimed if i is not None]
        counts = await self._delivery_counts([entry_id for entry_id, _ in entries], stream)
        return next_cursor, [Entry(i, f or {}, counts.get(i, 1), stream) for i, f in entries]

    async def _delivery_counts(self, entry_ids: list[str], stream: str) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(self.key(stream), self.keys.group, entry_id, entry_id, 1)
        replies = await pipe.execute() if entry_ids else []
        return {
            text(row["message_id"]): int(row["times_delivered"]) for rows in replies for row in rows
        }

    async def renew(self, entry_ids: list[str], stream: str = "") -> list[str]:
        """Reset the idle time of ``entry_ids`` (of ``stream``); returns those this worker no
        longer owns."""
        if not entry_ids:
            return []
        lost = await self._renew(
            keys=[self.key(stream)], args=[self.keys.group, self.consumer, *entry_ids]
        )
        return [text(entry_id) for entry_id in lost]

    async def hand_back(self, entries: list[Entry], idle_ms: int) -> None:
        """Make ``entries`` claimable by other workers at once (idle time set to ``idle_ms``).

        The retry count is kept as it was, so handing back is not counted as a failure.
        """
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            pipe.xclaim(
                self.key(entry.stream), self.keys.group, self.consumer, 0, [entry.entry_id],
                idle=idle_ms, retrycount=max(entry.times_delivered - 1, 0), justid=True,
            )  # fmt: skip
        await pipe.execute()

    async def own(self, request_id: str, entry_id: str) -> Ownership:
        """Claim ``request_id`` for ``entry_id`` (``SET NX``), or say who owns it."""
        key = self.keys.claim(request_id)
        if await self.redis.set(key, entry_id, nx=True, ex=protocol.CLAIM_TTL_S):
            return Ownership.NEW
        owner = await self.redis.get(key)
        if owner is not None and text(owner) == entry_id:
            return Ownership.RETRY
        return Ownership.DUPLICATE

    async def has_terminal_event(self, request_id: str) -> bool:
        """Whether the request's out stream already ends with ``done`` or ``error``."""
        last = await self.redis.xrevrange(self.keys.out(request_id), count=1)
        if not last:
            return False
        payload = last[0][1].get(protocol.PAYLOAD_FIELD.encode())
        try:
            event = protocol.decode_event(payload or b"")
        except ValueError:  # msgspec.DecodeError is a ValueError
            return False
        return isinstance(event, protocol.TERMINAL_EVENTS)

    def ack(self, pipe: Any, entry: Entry) -> None:
        """Queue on ``pipe``: acknowledge the entry and delete it from its stream."""
        pipe.xack(self.key(entry.stream), self.keys.group, entry.entry_id)
        pipe.xdel(self.key(entry.stream), entry.entry_id)

    def add_event(
        self, pipe: Any, request_id: str, event: protocol.Event, *, refresh_ttl: bool = True
    ) -> None:
        """Queue on ``pipe``: append ``event`` to the request's out stream (and refresh its TTL)."""
        out = self.keys.out(request_id)
        pipe.xadd(out, {protocol.PAYLOAD_FIELD: protocol.encode(event)})
        if refresh_ttl:
            pipe.expire(out, protocol.OUT_STREAM_TTL_S)

    async def publish(self, events: list[OutEvent], acks: list[str], stream: str = "") -> Published:
        """Write ``events`` and acknowledge the entries ``acks`` (all of ``stream``) in one
        atomic call, each only while its entry is this consumer's; a full Redis stops it before
        the acknowledgements (see ``PUBLISH_SCRIPT``), or refuses the whole call
        (``OutOfMemoryError``)."""
        assert protocol.PAYLOAD_FIELD == "msg"  # the script's field name
        keys = [self.key(stream), *(self.keys.out(event.request_id) for event in events)]
        args: list[Any] = [self.keys.group, self.consumer, protocol.OUT_STREAM_TTL_S, len(events)]
        args += [event.payload for event in events]
        args += ["1" if event.refresh_ttl else "0" for event in events]
        args += [event.entry_id for event in events]
        args += acks
        num_done, refused, lost = await self._publish(keys=keys, args=args)
        return Published(
            num_written=int(num_done),
            refused=[text(m) for m in refused],
            lost=[text(entry_id) for entry_id in lost],
        )

    async def dead_letter(
        self, entry: Entry, letter: DeadLetter, error: ErrorEvent | None = None
    ) -> None:
        """Move ``entry`` to the dead stream (acknowledged), with an error event if given."""
        pipe = self.redis.pipeline(transaction=True)
        if error is not None and letter.request_id is not None:
            self.add_event(pipe, letter.request_id, error)
        pipe.xadd(
            self.keys.dead,
            {protocol.PAYLOAD_FIELD: protocol.encode(letter)},
            maxlen=protocol.DEAD_MAXLEN,
            approximate=True,
        )
        self.ack(pipe, entry)
        await pipe.execute()


def text(value: bytes | str) -> str:
    """A Redis reply (bytes) as str."""
    return value.decode() if isinstance(value, bytes) else value
