"""The client's side of prefix-aware routing (docs/routing.md): which stream an entry goes to.

With routing on, ``AsyncClient.submit`` reads, in one pipelined round trip, the holders of
each link of the request's chain (``{p}:px:{link}``, sorted sets the workers write) and the
session's pin, then the heartbeats of those workers, and enqueues to the chosen worker's own
stream, ``{p}:requests:{name}``, or to the shared ``{p}:requests``. The enqueue is a script
that checks the chosen worker's heartbeat in the same atomic step: an entry never lands in the
stream of a worker already gone (its stream may be pruned), only on the shared stream.
"""

from __future__ import annotations

import os
from typing import Any

from clients import protocol
from clients.protocol import Keys, Request, WorkerStatus
from clients.routing import WorkerLoad, choose_worker, link_key, request_chain

ROUTING_ENV = "PAGESTREAM_ROUTING"

# KEYS: the chosen worker's heartbeat, its stream, the shared stream. ARGV: the payload.
# Returns {1 if routed else 0, entry id}.
ENQUEUE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {1, redis.call('XADD', KEYS[2], '*', 'msg', ARGV[1])}
end
return {0, redis.call('XADD', KEYS[3], '*', 'msg', ARGV[1])}
"""


def routing_from_env() -> bool:
    """``PAGESTREAM_ROUTING``: 1/true/yes/on turns routing on where the caller does not say."""
    return os.environ.get(ROUTING_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class Router:
    """Chooses a request's stream and enqueues it there (``route``)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._enqueue = redis.register_script(ENQUEUE_SCRIPT)

    async def choose(self, request: Request) -> str | None:
        """The worker to route ``request`` to, or None for the shared stream."""
        chain = request_chain(request)
        pipe = self.redis.pipeline(transaction=False)
        for link in chain:
            pipe.zrange(link_key(self.keys.prefix, link), 0, -1)
        if request.session is not None:
            pipe.get(self.keys.session(request.session))
        replies = await pipe.execute() if chain or request.session is not None else []
        holders = [[protocol_text(name) for name in names] for names in replies[: len(chain)]]
        pinned = protocol_text(replies[-1]) if request.session is not None and replies[-1] else None
        named = {name for names in holders for name in names}
        names = sorted(named if pinned is None else named | {pinned})
        if not names:
            return None
        beats = await self.redis.mget([self.keys.worker(name) for name in names])
        loads = {name: _load(beat) for name, beat in zip(names, beats, strict=True) if beat}
        live = {name: load for name, load in loads.items() if load is not None}
        return choose_worker(holders, live, pinned)

    async def enqueue(self, request: Request, payload: bytes) -> str | None:
        """Enqueue ``payload`` (the encoded ``request``); returns the worker it was routed to,
        None when it went to the shared stream."""
        chosen = await self.choose(request)
        if chosen is None:
            await self.redis.xadd(self.keys.requests, {protocol.PAYLOAD_FIELD: payload})
            return None
        keys = [self.keys.worker(chosen), self.keys.routed(chosen), self.keys.requests]
        routed, _ = await self._enqueue(keys=keys, args=[payload])
        return chosen if int(routed) else None


def _load(beat: bytes) -> WorkerLoad | None:
    try:
        status: WorkerStatus = protocol.decode_struct(beat, WorkerStatus)
    except ValueError:  # a heartbeat this client cannot read: not a worker to route to
        return None
    return WorkerLoad(status.num_in_flight, status.max_in_flight, status.num_waiting)


def protocol_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
