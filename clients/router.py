"""The client's side of prefix-aware routing (docs/routing.md): which stream an entry goes to.

With routing on, ``AsyncClient.submit`` reads, in one pipelined round trip, the holders of
each link of the request's chain (``{p}:px:{link}``, sorted sets the workers write), the
session's pin; takes every routing worker's load from their heartbeats (read at most once a
second, for the fleet's balance); and enqueues to the chosen worker's own
stream, ``{p}:requests:{name}``, or to the request's shard (``{p}:requests`` with one). The
enqueue is a script that appends only while the chosen worker's stream exists, in the same
atomic step: an entry never lands in a stream already pruned (a worker's stream is pruned
only when its heartbeat is gone and it is empty), only on the shard. The script touches that
one key, so it runs in a Redis Cluster too.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from clients import protocol
from clients.connect import env_switch, get_many
from clients.protocol import Keys, Request, WorkerStatus
from clients.routing import (
    WorkerLoad,
    choose_worker_why,
    link_key,
    probed_links,
    request_chain,
)

ROUTING_ENV = "PAGESTREAM_ROUTING"
FLEET_REFRESH_S = 1.0  # how long a client reuses its reading of the fleet's heartbeats
SHARDS_ENV = "PAGESTREAM_SHARDS"

# KEYS: the chosen worker's stream. ARGV: the payload. Returns the entry id, or false when
# the stream is gone (the caller enqueues on the shard instead).
ENQUEUE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('XADD', KEYS[1], '*', 'msg', ARGV[1])
end
return false
"""


def routing_from_env() -> bool:
    """``PAGESTREAM_ROUTING``: on turns routing on where the caller does not say."""
    return env_switch(ROUTING_ENV)


def shards_from_env() -> int:
    """``PAGESTREAM_SHARDS``: the deployment's number of request streams (unset: 1)."""
    value = os.environ.get(SHARDS_ENV, "").strip()
    if not value:
        return 1
    if not value.isdigit() or not 1 <= int(value) <= protocol.MAX_SHARDS:
        raise ValueError(
            f"{SHARDS_ENV}={value!r}: give the number of request streams, 1..{protocol.MAX_SHARDS}"
        )
    return int(value)


class Router:
    """Chooses a request's stream and enqueues it there (``route``)."""

    def __init__(self, redis: Any, keys: Keys, fleet_refresh_s: float = FLEET_REFRESH_S) -> None:
        self.redis = redis
        self.keys = keys
        self.fleet_refresh_s = fleet_refresh_s
        self._enqueue = redis.register_script(ENQUEUE_SCRIPT)
        # where this client's entries went and why (``choose_worker_why``'s reasons, and
        # ``stream gone`` for a routed entry whose stream was pruned): benchmarks read it
        self.choices: Counter[str] = Counter()
        self._fleet: dict[str, WorkerLoad] = {}
        self._fleet_read_s = -float("inf")  # never read

    async def choose(self, request: Request) -> str | None:
        """The worker to route ``request`` to, or None for the shared stream."""
        return (await self.choose_why(request))[0]

    async def choose_why(self, request: Request) -> tuple[str | None, str]:
        """``choose``'s answer and its reason (``routing.choose_worker_why``)."""
        chain = request_chain(request)
        if not chain and request.session is None:
            return None, "no holder"
        chain = [chain[index] for index in probed_links(len(chain))]  # about log2 of them
        pipe = self.redis.pipeline(transaction=False)
        for link in chain:
            pipe.zrange(link_key(self.keys.prefix, link), 0, -1)
        if request.session is not None:
            pipe.get(self.keys.session(request.session))
        replies = await pipe.execute()
        holders = [[protocol_text(name) for name in names] for names in replies[: len(chain)]]
        pinned = protocol_text(replies[-1]) if request.session is not None and replies[-1] else None
        named = {name for names in holders for name in names}
        if not named and pinned is None:
            return None, "no holder"
        live = await self._fleet_loads()
        wanted = named if pinned is None else named | {pinned}
        unseen = sorted(name for name in wanted if name not in live)
        if unseen:  # a worker newer than the fleet's last reading
            beats = await get_many(self.redis, [self.keys.worker(name) for name in unseen])
            live.update(_live_loads(unseen, beats))
        return choose_worker_why(holders, live, pinned)

    async def _fleet_loads(self) -> dict[str, WorkerLoad]:
        """Every live routing worker's load from its heartbeat (``{p}:routed``'s members),
        read at most every ``fleet_refresh_s``: a heartbeat is seconds old already, and a
        fleet of a hundred workers is not read again for every request."""
        now_s = time.monotonic()
        if now_s - self._fleet_read_s >= self.fleet_refresh_s:
            names = sorted(
                protocol_text(n) for n in await self.redis.smembers(self.keys.routed_workers)
            )
            beats = await get_many(self.redis, [self.keys.worker(name) for name in names])
            self._fleet, self._fleet_read_s = _live_loads(names, beats), now_s
        return dict(self._fleet)

    async def enqueue(self, request: Request, payload: bytes) -> str | None:
        """Enqueue ``payload`` (the encoded ``request``); returns the worker it was routed to,
        None when it went to the shared stream."""
        chosen, why = await self.choose_why(request)
        if chosen is not None and await self._enqueue(
            keys=[self.keys.routed(chosen)], args=[payload]
        ):
            self.choices[why] += 1
            return chosen
        self.choices[why if chosen is None else "stream gone"] += 1
        shard = self.keys.shard_for(request.id, request.session)
        await self.redis.xadd(shard, {protocol.PAYLOAD_FIELD: payload})
        return None


def _live_loads(names: list[str], beats: list[Any]) -> dict[str, WorkerLoad]:
    """The loads of the workers whose heartbeat is there and readable."""
    loads = {name: _load(beat) for name, beat in zip(names, beats, strict=True) if beat}
    return {name: load for name, load in loads.items() if load is not None}


def _load(beat: bytes) -> WorkerLoad | None:
    try:
        status: WorkerStatus = protocol.decode_struct(beat, WorkerStatus)
    except ValueError:  # a heartbeat this client cannot read: not a worker to route to
        return None
    return WorkerLoad(status.num_in_flight, status.max_in_flight, status.num_waiting)


def protocol_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
