"""The worker's side of prefix-aware routing (docs/routing.md).

A routing worker has a stream of its own, ``{p}:requests:{name}``, read by the same consumer
group as the shared ``{p}:requests``, and listed in the set ``{p}:routed``. It

- publishes, for each request it admits, the links of the request's chain: it joins each link's
  sorted set ``{p}:px:{link}`` (score: now, Unix ms; the key's TTL refreshed; members older than
  the TTL trimmed), and the session's pin;
- steals: with free slots, it reads another worker's stream when its oldest undelivered entry
  has waited ``steal_after_ms`` (at once when that worker's heartbeat is gone), so a busy or
  dead worker's routed entries are not stuck;
- takes over (``XAUTOCLAIM``) on every listed stream as on the shared one;
- prunes a listed stream whose worker is gone and that holds nothing.

The consumer group hands each entry to one consumer, so neither a steal nor a takeover doubles
a request; fencing, dead letters and duplicate ids work per entry whatever its stream.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from redis.exceptions import RedisError, ResponseError

from clients.connect import get_many, is_cluster
from clients.protocol import Keys, Request
from clients.routing import balance_gap, link_key, request_chain
from worker.delivery import REDIS_ERRORS, Entry, RequestStream, text
from worker.logs import get_logger

log = get_logger(__name__)

# Per stream, the id of its oldest entry not yet delivered to any consumer, or ''.
# KEYS: streams (in a Redis Cluster, one per call: streams lie in different slots). ARGV: group.
PEEK_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = ''
  if redis.call('EXISTS', key) == 1 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
      local name, last
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
      end
      if name == ARGV[1] then
        local r = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', 1)
        if r[1] then out[i] = r[1][1] end
      end
    end
  end
end
return out
"""

# Delete a worker's stream when it is empty (its heartbeat was found gone just before): atomic
# with the emptiness check, as the client's enqueue is with the stream's existence, so an
# entry is either in the stream before (which is then kept, and stolen) or goes to its shard.
# A worker that comes back makes its stream again at its next heartbeat.
# KEYS: the stream.
PRUNE_SCRIPT = """
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


# Idle first: a routing worker holding ``shard_yield_threshold`` requests or more does not
# block on the shards (the shared streams). An idle worker blocked there takes a new entry at
# once; a busy one reads every BUSY_READ_INTERVAL_S what no idle worker took. A shard entry is
# a new conversation (or one a worker yielded), and where it starts it stays: placed by which
# reader Redis served first, four CPU workers started 14, 14, 11 and 9 of 48 conversations and
# the busiest ran two at once, at twice the time a turn. Idle readers block on a shard at most
# SHARD_BLOCK_S at a time, so that one that turned busy meanwhile (an entry of its own stream)
# soon leaves the shard's queue of blocked readers.
BUSY_READ_INTERVAL_S = 0.02
SHARD_BLOCK_S = 0.1


def shard_yield_threshold(
    routing: bool, yield_shards_at: int | None, max_in_flight: int, device_type: str
) -> int:
    """The requests at which a worker leaves new shard entries to idler ones (0: never): the
    setting, else 1 on a CPU (a second request halves the first one's pace) and the affinity
    balance gap on a GPU (a step takes about as long at 8 sequences as at 2)."""
    if not routing:
        return 0
    if yield_shards_at is not None:
        return yield_shards_at
    return 1 if device_type == "cpu" else balance_gap(max_in_flight)


MAX_REMEMBERED_LINKS = 100_000  # about 6 MB of a worker's memory
PEERS_REFRESH_S = 1.0  # how often a stealing worker reads the list of routed streams again


class WorkerRouting:
    """One worker's routing: its stream, what it publishes, what it steals."""

    def __init__(
        self, redis: Any, keys: Keys, name: str, *, prefix_ttl_s: int, steal_after_ms: int
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.name = name
        self.prefix_ttl_s = prefix_ttl_s
        self.steal_after_ms = steal_after_ms
        self.own = keys.routed(name)
        self.peers: list[str] = []  # the other workers with a routed stream (as of ``streams``)
        self._notes: set[asyncio.Task[None]] = set()
        self._listed_at_s = 0.0  # when ``peers`` was last read
        self._published: OrderedDict[bytes, int] = OrderedDict()  # link -> Unix ms, oldest first
        self._peek = redis.register_script(PEEK_SCRIPT)
        self._prune = redis.register_script(PRUNE_SCRIPT)

    async def register(self) -> None:
        """Make sure this worker's stream, group and listing exist (at start, each heartbeat:
        Redis may have restarted without data, or a pruner removed them while this worker's
        heartbeat had lapsed)."""
        await self.redis.sadd(self.keys.routed_workers, self.name)
        try:
            await self.redis.xgroup_create(self.own, self.keys.group, "0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def streams(self) -> list[str]:
        """Every listed worker's stream (this one's included): what takeover scans."""
        names = sorted(text(name) for name in await self.redis.smembers(self.keys.routed_workers))
        self.peers = [name for name in names if name != self.name]
        self._listed_at_s = time.monotonic()
        return [self.keys.routed(name) for name in names]

    def note_served_soon(self, request: Request) -> None:
        """``note_served`` in the background: a hint, not worth delaying the request's first
        token (the write shares the event loop); one lost to a Redis error costs a miss."""
        task = asyncio.create_task(self._note_quietly(request))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    async def _note_quietly(self, request: Request) -> None:
        try:
            await self.note_served(request)
        except (*REDIS_ERRORS, RedisError) as exc:
            log.warning("prefix links not published", request_id=request.id, error=str(exc))

    async def note_served(self, request: Request) -> None:
        """Publish that this worker now holds ``request``'s chain (and its session's pin).
        Links this worker published within half the TTL are skipped: a conversation's next
        turn repeats all of this turn's links, and only its new ones need writing."""
        now_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for link in self._fresh(request_chain(request), now_ms):
            key = link_key(self.keys.prefix, link)
            pipe.zadd(key, {self.name: now_ms})
            pipe.zremrangebyscore(key, 0, now_ms - self.prefix_ttl_s * 1000)
            pipe.expire(key, self.prefix_ttl_s)
        if request.session is not None:
            pipe.set(self.keys.session(request.session), self.name, ex=self.prefix_ttl_s)
        await pipe.execute()

    def _fresh(self, chain: list[bytes], now_ms: int) -> list[bytes]:
        """The links of ``chain`` not published by this worker within half the TTL (and
        remember them as published now; the memory is bounded, oldest forgotten first)."""
        due_ms = now_ms - self.prefix_ttl_s * 500
        fresh = [link for link in chain if self._published.get(link, due_ms) <= due_ms]
        for link in fresh:
            self._published[link] = now_ms
            self._published.move_to_end(link)
        while len(self._published) > MAX_REMEMBERED_LINKS:
            self._published.popitem(last=False)
        return fresh

    async def steal(self, stream: RequestStream, count: int) -> list[Entry]:
        """Up to ``count`` entries from other workers' streams whose oldest undelivered entry
        waited ``steal_after_ms``, or whose worker is gone; each stream also pruned when its
        worker is gone and it is empty."""
        if count <= 0:
            return []
        if time.monotonic() - self._listed_at_s > PEERS_REFRESH_S:  # workers come and go
            await self.streams()
        if not self.peers:
            return []
        streams = [self.keys.routed(name) for name in self.peers]
        oldest, beats = await self._peek_all(streams)
        now_ms = int(time.time() * 1000)
        stolen: list[Entry] = []
        for name, key, entry_id, beat in zip(self.peers, streams, oldest, beats, strict=True):
            if not entry_id:
                if not beat and await self._prune(keys=[key]):
                    await self.redis.srem(self.keys.routed_workers, name)
                continue
            waited_ms = now_ms - int(entry_id.split("-")[0])
            if beat and waited_ms < self.steal_after_ms:
                continue
            got = await stream.read_new(count - len(stolen), None, (key,))
            stolen += got
            if len(stolen) >= count:
                break
        return stolen

    async def _peek_all(self, streams: list[str]) -> tuple[list[str], list[bool]]:
        """Each stream's oldest undelivered entry id ('' when none), and whether its worker's
        heartbeat is there, in one round trip."""
        groups = [[key] for key in streams] if is_cluster(self.redis) else [streams]
        peeks, beats = await asyncio.gather(
            asyncio.gather(*(self._peek(keys=keys, args=[self.keys.group]) for keys in groups)),
            get_many(self.redis, [self.keys.worker(name) for name in self.peers]),
        )
        oldest = [entry_id for peek in peeks for entry_id in peek]
        return [text(entry_id) for entry_id in oldest], [beat is not None for beat in beats]
