"""The connection to a deployment's Redis: one server, or a Redis Cluster.

A cluster client (``redis.asyncio.cluster.RedisCluster``) sends each command to the primary
that holds its keys' hash slot; a command or script whose keys lie in different slots is
refused, so pagestream keeps every call to one slot (docs/operations.md#redis-cluster).

redis-py's cluster client finds the slot of most commands from their arguments, but for
commands whose keys move (``XREAD``, ``XREADGROUP``) it first asks a server (``COMMAND
GETKEYS``): a second round trip, and as much Redis CPU again, for every read. ``read_streams``
and ``read_group`` compute the slot here and send the command to its primary directly.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

CLUSTER_ENV = "PAGESTREAM_REDIS_CLUSTER"
# A cluster's passing states (a primary restarting, slots moving): retried like a lost Redis.
TRANSIENT_CLUSTER_ERRORS = (ClusterDownError, TryAgainError)
UNREACHABLE = "Redis Cluster cannot be connected"  # redis-py's words when no node answers


class ClusterClient(RedisCluster):
    """redis-py's asyncio cluster client, repaired for a primary that dies and comes back.

    At each connection error or timeout on a node, redis-py drops that node from the nodes it
    asks for the slot map, and refills them only from a slot map it got. Errors on every node
    in turn (a restarted primary, timeouts while Redis is slow) leave it none to ask, and from
    then on every call fails ("cannot be connected ... None") although the cluster is back.
    Here each new slot map request also asks every node this client has ever known, and a
    cluster that no node answers for raises ``ConnectionError``, which callers retry like a
    standalone Redis that is down.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._known_nodes = {name: (node.host, node.port)
                             for name, node in self.nodes_manager.startup_nodes.items()}  # fmt: skip

    async def initialize(self) -> RedisCluster:
        manager = self.nodes_manager
        if self._initialize:  # a slot map is due: redis-py reads the nodes under this lock
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                for name, (host, port) in self._known_nodes.items():
                    if name not in manager.startup_nodes:
                        node = ClusterNode(host, port, **manager.connection_kwargs)
                        manager.startup_nodes[name] = node
        try:
            await super().initialize()
        except RedisClusterException as exc:
            if str(exc).startswith(UNREACHABLE):
                raise RedisConnectionError(str(exc)) from exc
            raise
        for name, node in manager.nodes_cache.items():
            self._known_nodes.setdefault(name, (node.host, node.port))
        return self


def env_switch(name: str) -> bool:
    """An on/off environment variable as the worker's flags read it: on/1/true/yes or
    off/0/false/no; unset or empty is off, and another word a ``ValueError`` naming it."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if word in ("", "off", "0", "false", "no"):
        return False
    if word in ("on", "1", "true", "yes"):
        return True
    raise ValueError(f"{name}={raw!r}: expected on or off")


def cluster_from_env() -> bool:
    """``PAGESTREAM_REDIS_CLUSTER``: on means the URL names a Redis Cluster node."""
    return env_switch(CLUSTER_ENV)


def connect(redis_url: str, *, cluster: bool = False) -> Any:
    """An asyncio client of ``redis_url``: of the whole cluster it belongs to when ``cluster``
    (any node's URL will do: the client discovers the others and their slots)."""
    if cluster:
        return ClusterClient.from_url(redis_url)
    return aioredis.Redis.from_url(redis_url)


def is_cluster(redis: Any) -> bool:
    """Whether ``redis`` is a Redis Cluster client (the keys of one call must share a slot)."""
    return isinstance(redis, RedisCluster)


async def read_streams(
    redis: Any, streams: dict[str, str], *, count: int, block_ms: int | None
) -> Any:
    """``XREAD COUNT count [BLOCK block_ms] STREAMS ...`` of ``streams`` (key -> the id to read
    after); on a cluster every key must share one slot, and the command goes straight to its
    primary (no ``COMMAND GETKEYS``). The reply is redis-py's ``xread``'s."""
    if not is_cluster(redis):
        return await redis.xread(streams, count=count, block=block_ms)
    return await _send_to_slot(redis, ["XREAD", *_read_args(streams, count, block_ms)], streams)


async def read_group(
    redis: Any,
    group: str,
    consumer: str,
    streams: dict[str, str],
    *,
    count: int,
    block_ms: int | None,
) -> Any:
    """``XREADGROUP`` of ``streams`` for ``consumer`` of ``group``, sent as ``read_streams``
    sends ``XREAD``. The reply is redis-py's ``xreadgroup``'s."""
    if not is_cluster(redis):
        return await redis.xreadgroup(group, consumer, streams, count=count, block=block_ms)
    args = ["XREADGROUP", "GROUP", group, consumer, *_read_args(streams, count, block_ms)]
    return await _send_to_slot(redis, args, streams)


def _read_args(streams: dict[str, str], count: int, block_ms: int | None) -> list[Any]:
    """``COUNT count [BLOCK block_ms] STREAMS key... id...``."""
    block = [] if block_ms is None else ["BLOCK", block_ms]
    return ["COUNT", count, *block, "STREAMS", *streams, *streams.values()]


async def _send_to_slot(redis: Any, args: list[Any], streams: dict[str, str]) -> Any:
    """``args`` sent to the primary of the streams' slot (the slot table loaded first, if it
    is not yet, or again after a connection error closed the client)."""
    await redis.initialize()  # returns at once when the slots are known
    node = redis.get_node_from_key(next(iter(streams)))
    return await redis.execute_command(*args, target_nodes=node)


async def get_many(redis: Any, keys: list[str]) -> list[Any]:
    """``MGET`` of keys in any slots (a cluster splits it by slot)."""
    if not keys:
        return []
    if is_cluster(redis):
        return list(await redis.mget_nonatomic(keys))
    return list(await redis.mget(keys))
