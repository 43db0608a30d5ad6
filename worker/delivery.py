"""At-least-once delivery over one Redis stream and consumer group.

A worker reads entries with ``XREADGROUP``; each stays pending (in the group's PEL) under the
worker's name until it is acknowledged with the request's terminal event. While it runs, the
worker renews its lease (resets the entry's idle time); an entry idle longer than the lease
belongs to a worker that died, and another worker takes it over with ``XAUTOCLAIM``.

``{p}:claim:{id}`` maps a request id to the stream entry that owns it and the consumer that
runs it: only that consumer writes to ``{p}:out:{id}`` (a second entry with the same id is
never run, and a worker whose entry was taken over writes nothing more). The claim and the
out stream share the request's hash slot, so the fenced write is one script call per slot in
a Redis Cluster: with K > 1 shards a slot holds the keys of a whole shard's requests
(``Keys.out``), so a step's events take one call per shard, sent to the primaries at once.
The request streams' own scripts touch one stream each.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clients import protocol
from clients.connect import TRANSIENT_CLUSTER_ERRORS, is_cluster, read_group
from clients.protocol import DeadLetter, Keys, hash_tag

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

# A request id's owner, in {p}:claim:{id}: "ENTRY_ID STREAM CONSUMER" (the entry and the stream
# it came through: entry ids are unique within one stream only). The first entry of an id sets
# it (`new`); a redelivery of that entry (its worker died) moves it to the new consumer (`retry`):
# from then on the old consumer's writes are refused (the fence below); a value naming another
# entry means a duplicate id. A bare ENTRY_ID (written before the consumer was part of it)
# counts as that entry's. The claim lives in the request's hash slot, beside its out stream.
# KEYS: the claim. ARGV: this owner's value, the entry id, "ENTRY_ID STREAM " (any consumer), TTL s.
OWN_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[4]) then return 'new' end
local v = redis.call('GET', KEYS[1])
if v == ARGV[2] or string.sub(v, 1, #ARGV[3]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
  return 'retry'
end
return 'duplicate'
"""

# Events in one call: append each to its request's out stream (refreshing the TTL where asked).
# Fenced: an event is written only while its request's claim names this owner, so a worker
# whose entry another worker took over (it stalled, or Redis was down longer than the lease)
# cannot write after the new owner's `restart`; the entries it lost are returned. Once a
# terminal event is written the claim says so (OWNER + " done"), so that the same call sent
# again (its reply was lost when Redis died, or the acknowledgement after it failed) writes no
# second terminal event and does not count the entry as lost. Every key of one request shares
# its hash slot (with K > 1 shards, every key of its shard's requests); a Redis Cluster gets
# one call per slot, a single Redis one call for all (one
# command to encode where a pipeline has hundreds: the event loop shares the GIL with the
# engine thread). A write Redis refuses for its key (an out key that is not a stream) is
# reported, not retried, and does not stop the others. A full Redis (OOM, under `maxmemory`
# with `noeviction`) stops the call where it is: the caller retries the rest later.
# KEYS: per event its out stream and its claim. ARGV: TTL s, then per event its payload, TTL
# flag ('1' = refresh), owner value (the claim it needs) and terminal flag ('1'). Returns
# {events done (n unless Redis is full), refusals as "key: error", the (1-based) index of the
# first event of each claim no longer this owner's} (indices, not entry ids: the events of one
# call may come from several request streams, whose entry ids may coincide).
WRITE_SCRIPT = """
local n = #KEYS / 2
local state = {}  -- per claim: 'own', 'done' (its terminal event is written) or 'lost'
local lost = {}
local refused = {}
for i = 1, n do
  local key, claim = KEYS[2 * i - 1], KEYS[2 * i]
  local a = 4 * i - 2
  local payload, refresh, owner, terminal = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  if state[claim] == nil then
    local v = redis.call('GET', claim)
    if v == owner then state[claim] = 'own'
    elseif v == owner .. ' done' then state[claim] = 'done'
    else
      state[claim] = 'lost'
      table.insert(lost, i)
    end
  end
  if state[claim] == 'own' then
    local reply = redis.pcall('XADD', key, '*', 'msg', payload)
    if type(reply) == 'table' and reply.err then
      if string.find(reply.err, 'OOM', 1, true) then  -- '-OOM command not allowed ...'
        return {i - 1, refused, lost}
      end
      table.insert(refused, key .. ': ' .. reply.err)
    else
      if refresh == '1' then redis.call('EXPIRE', key, ARGV[1]) end
      if terminal == '1' then
        redis.call('SET', claim, owner .. ' done', 'KEEPTTL')
        state[claim] = 'done'
      end
    end
  end
end
return {n, refused, lost}
"""

# Acknowledge and delete entries of one request stream, each only while it is pending under
# this consumer (a worker that lost its lease must not acknowledge the entry its new owner
# runs). Called only once the entries' terminal events are written. KEYS: the request stream.
# ARGV: group, consumer, entry ids. Returns the entry ids no longer this consumer's.
ACK_SCRIPT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# Dead-letter one entry: append its letter to the dead stream, then acknowledge and delete it,
# in one atomic call, and only while the entry is still pending under this consumer, so that
# the same call sent again (its reply lost when Redis died) or a redelivery of an entry already
# dead-lettered writes no second letter. A single Redis only: in a Redis Cluster the dead
# stream and a request stream sit in different slots (see ``RequestStream.dead_letter``).
# KEYS: the dead stream, the request stream. ARGV: group, consumer, entry id, letter, maxlen.
DEAD_LETTER_SCRIPT = """
local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1)
if not (p[1] and p[1][2] == ARGV[2]) then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[5], '*', 'msg', ARGV[4])
redis.call('XACK', KEYS[2], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return 1
"""

# The letter of one entry on a Redis Cluster, where the dead stream and the request stream lie
# in different slots: written only if the entry's marker (in the dead stream's slot) is new,
# so a worker that died before its acknowledgement, or a call sent again after a lost reply,
# writes no second letter. KEYS: the dead stream, the marker. ARGV: letter, maxlen, TTL.
CLUSTER_DEAD_LETTER_SCRIPT = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[3]) then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'msg', ARGV[1])
return 1
"""

# Errors that mean "Redis is unreachable right now": back off and retry, never give up.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, *TRANSIENT_CLUSTER_ERRORS)


# ``restart`` reasons: another worker took the request over, or its worker gave it back
LEASE_EXPIRED, HANDED_BACK = "lease expired", "handed back"


class Ownership(str, enum.Enum):
    NEW = "new"  # first time this request id is seen: run it
    RETRY = "retry"  # this entry ran before (its worker died): run it again after `restart`
    DUPLICATE = "duplicate"  # another entry owns this id: drop this one


# An entry of a request stream: (stream, entry id). Entry ids are unique within one stream
# only; "" is the shared stream.
EntryRef = tuple[str, str]


@dataclass(frozen=True, slots=True)
class OutEvent:
    """One encoded event for a request's out stream, as ``publish`` writes it."""

    request_id: str
    entry_id: str  # the request-stream entry it answers: written only while this worker owns it
    payload: bytes
    refresh_ttl: bool  # set the stream's TTL again with this write
    terminal: bool = False  # done or error: the request's last event (the claim records it)
    stream: str = ""  # the request stream the entry came through ("" is the shared one)

    @property
    def entry(self) -> EntryRef:
        return (self.stream, self.entry_id)


@dataclass(frozen=True, slots=True)
class Published:
    """What ``publish`` did: ``unwritten`` are the events still to write (Redis is full; none
    otherwise: every other event was written, or skipped as ``lost``); ``refused`` are the
    writes Redis refused for their key, as messages; ``lost`` the entries another worker has
    taken over."""

    unwritten: list[OutEvent]
    refused: list[str]
    lost: list[EntryRef]


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

    @property
    def ref(self) -> EntryRef:
        """(stream, entry id): which entry this is, whatever the stream."""
        return (self.stream, self.entry_id)


class RequestStream:
    """The request streams seen by one consumer (worker) of the group."""

    def __init__(self, redis: Any, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.cluster = is_cluster(redis)
        self._renew = redis.register_script(RENEW_SCRIPT)
        self._own = redis.register_script(OWN_SCRIPT)
        self._write = redis.register_script(WRITE_SCRIPT)
        self._ack = redis.register_script(ACK_SCRIPT)
        self._dead_letter = redis.register_script(DEAD_LETTER_SCRIPT)
        self._cluster_dead_letter = redis.register_script(CLUSTER_DEAD_LETTER_SCRIPT)

    async def ensure_group(self, stream: str = "") -> None:
        """Create ``stream`` ("" is the shared one) and its group if missing (e.g. Redis
        restarted without data)."""
        try:
            await self.redis.xgroup_create(self.key(stream), self.keys.group, "0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def key(self, stream: str) -> str:
        """The Redis key of ``stream`` ("" is the shared one)."""
        return stream or self.keys.requests

    def owner(self, entry_id: str, stream: str) -> str:
        """The value of a request's claim while this consumer owns it through ``entry_id``."""
        return f"{entry_id} {self.key(stream)} {self.consumer}"

    async def read_new(
        self, count: int, block_ms: int | None, streams: tuple[str, ...] = ("",)
    ) -> list[Entry]:
        """Up to ``count`` entries (per stream) never delivered before, from ``streams``
        (keys; "" is the shared stream); waits up to ``block_ms`` (None: not at all). In a
        Redis Cluster, ``streams`` must share a hash slot (one stream, in practice)."""
        by_key = {self.key(stream): stream for stream in streams}
        reply = await read_group(
            self.redis, self.keys.group, self.consumer, dict.fromkeys(by_key, ">"),
            count=count, block_ms=block_ms,
        )  # fmt: skip
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

    async def hand_back(self, entries: list[tuple[str, Entry]], idle_ms: int) -> None:
        """Make ``entries`` (request id, entry) claimable by other workers at once (idle time
        set to ``idle_ms``).

        The retry count is kept as it was, so handing back is not counted as a failure; the
        request's restarts record why its next one happens (``restart``'s ``reason``).
        """
        pipe = self.redis.pipeline(transaction=False)
        for request_id, entry in entries:
            pipe.hset(self.keys.restarts(request_id), "reason", HANDED_BACK)
            pipe.expire(self.keys.restarts(request_id), protocol.CLAIM_TTL_S)
            pipe.xclaim(
                self.key(entry.stream), self.keys.group, self.consumer, 0, [entry.entry_id],
                idle=idle_ms, retrycount=max(entry.times_delivered - 1, 0), justid=True,
            )  # fmt: skip
        await pipe.execute()

    async def next_restart(self, request_id: str) -> tuple[int, str]:
        """Count a restart of ``request_id``: its number (1 for the first) and why."""
        key = self.keys.restarts(request_id)
        pipe = self.redis.pipeline(transaction=False)  # one key; only its owner restarts it
        pipe.hincrby(key, "n", 1)
        pipe.hget(key, "reason")
        pipe.hdel(key, "reason")
        pipe.expire(key, protocol.CLAIM_TTL_S)
        attempt, reason, _, _ = await pipe.execute()
        return int(attempt), text(reason) if reason else LEASE_EXPIRED

    async def answer_expired(self, request_id: str) -> bool:
        """Whether ``request_id`` was answered (its claim says so) and its out stream has
        expired since: a duplicate of it would otherwise wait for events that are gone."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.claim(request_id))
        pipe.exists(self.keys.out(request_id))
        claim, out_exists = await pipe.execute()
        return claim is not None and text(claim).endswith(" done") and not out_exists

    async def own(self, request_id: str, entry: Entry) -> Ownership:
        """Claim ``request_id`` for ``entry``, or take the claim over from the consumer that
        ran ``entry`` before (after this, that consumer writes nothing more), or say that
        another entry owns the id (see ``OWN_SCRIPT``)."""
        stream_key = self.key(entry.stream)
        reply = await self._own(
            keys=[self.keys.claim(request_id)],
            args=[
                self.owner(entry.entry_id, entry.stream), entry.entry_id,
                f"{entry.entry_id} {stream_key} ", protocol.CLAIM_TTL_S,
            ],
        )  # fmt: skip
        return Ownership(text(reply))

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

    async def ack(self, entry_ids: list[str], stream: str = "") -> list[str]:
        """Acknowledge and delete ``entry_ids`` of ``stream``, those still this consumer's;
        returns the others (see ``ACK_SCRIPT``)."""
        if not entry_ids:
            return []
        lost = await self._ack(
            keys=[self.key(stream)], args=[self.keys.group, self.consumer, *entry_ids]
        )
        return [text(entry_id) for entry_id in lost]

    async def publish(self, events: list[OutEvent], acks: list[EntryRef]) -> Published:
        """Write ``events`` (each only while its request's claim names this consumer), then,
        once all are written, acknowledge ``acks`` (those still this consumer's). The events
        go in one script call per hash slot (one on a single Redis; on a cluster one per
        shard with K > 1, else per request), the calls to different primaries at once. A full
        Redis leaves events unwritten and nothing acknowledged (see ``WRITE_SCRIPT``), or
        refuses the whole call (``OutOfMemoryError``)."""
        assert protocol.PAYLOAD_FIELD == "msg"  # the script's field name
        groups = self._by_slot(events)
        replies = await asyncio.gather(*(self._write_group(group) for group in groups))
        unwritten: list[OutEvent] = []
        refused: list[str] = []
        lost: list[EntryRef] = []
        for group, (num_done, group_refused, group_lost) in zip(groups, replies, strict=True):
            unwritten += group[int(num_done) :]
            refused += [text(message) for message in group_refused]
            lost += [group[int(index) - 1].entry for index in group_lost]
        if not unwritten:
            lost += [ref for ref in await self._ack_all(acks) if ref not in lost]
        return Published(unwritten=unwritten, refused=refused, lost=lost)

    async def _ack_all(self, acks: list[EntryRef]) -> list[EntryRef]:
        """``ack`` of entries of any streams: one call per stream, all at once."""
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in acks:
            by_stream.setdefault(stream, []).append(entry_id)
        streams = list(by_stream)
        replies = await asyncio.gather(*(self.ack(by_stream[s], s) for s in streams))
        return [
            (s, entry_id) for s, lost in zip(streams, replies, strict=True) for entry_id in lost
        ]

    def _by_slot(self, events: list[OutEvent]) -> list[list[OutEvent]]:
        """``events`` in calls: one per hash tag in a Redis Cluster (a shard's, or with one
        shard a request's: keys that share a tag share a slot), else one; order kept within
        each request. Grouping by the tag costs no CRC16 per event, as the slot would."""
        if not self.cluster:
            return [events] if events else []
        groups: dict[str, list[OutEvent]] = {}
        for event in events:
            groups.setdefault(hash_tag(self.keys.out(event.request_id)), []).append(event)
        return list(groups.values())

    async def _write_group(self, events: list[OutEvent]) -> Any:
        keys: list[str] = []
        args: list[Any] = [protocol.OUT_STREAM_TTL_S]
        for event in events:
            keys += [self.keys.out(event.request_id), self.keys.claim(event.request_id)]
            args += [event.payload, "1" if event.refresh_ttl else "0"]
            args += [self.owner(event.entry_id, event.stream), "1" if event.terminal else "0"]
        return await self._write(keys=keys, args=args)

    async def dead_letter(self, entry: Entry, letter: DeadLetter) -> None:
        """Move ``entry`` to the dead stream and acknowledge it (its error event, if any, is
        already written: a redelivery finds it and writes no second one). On a single Redis
        one atomic call (``DEAD_LETTER_SCRIPT``): one letter per entry, however often it is
        sent or redelivered. In a Redis Cluster two calls, the letter first (written once per
        entry: ``CLUSTER_DEAD_LETTER_SCRIPT``), then the acknowledgement: a worker that dies
        between them leaves its entry to be acknowledged by the next, with no second letter."""
        payload = protocol.encode(letter)
        if not self.cluster:
            await self._dead_letter(
                keys=[self.keys.dead, self.key(entry.stream)],
                args=[self.keys.group, self.consumer, entry.entry_id, payload,
                      protocol.DEAD_MAXLEN],
            )  # fmt: skip
            return
        stream = self.key(entry.stream)
        await self._cluster_dead_letter(
            keys=[self.keys.dead, self.keys.lettered(stream, entry.entry_id)],
            args=[payload, protocol.DEAD_MAXLEN, protocol.CLAIM_TTL_S],
        )
        await self.ack([entry.entry_id], entry.stream)


def text(value: bytes | str) -> str:
    """A Redis reply (bytes) as str."""
    return value.decode() if isinstance(value, bytes) else value
