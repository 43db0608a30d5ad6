"""The connection to a deployment's Redis: one server, or a Redis Cluster.

A cluster client (``redis.asyncio.cluster.RedisCluster``) sends each command to the primary
that holds its keys' hash slot; a command or script whose keys lie in different slots is
refused, so pagestream keeps every call to one slot (docs/operations.md#redis-cluster).
"""

from __future__ import annotations

import os
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

CLUSTER_ENV = "PAGESTREAM_REDIS_CLUSTER"


def cluster_from_env() -> bool:
    """``PAGESTREAM_REDIS_CLUSTER``: 1/true/yes/on means the URL names a Redis Cluster node."""
    return os.environ.get(CLUSTER_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def connect(redis_url: str, *, cluster: bool = False) -> Any:
    """An asyncio client of ``redis_url``: of the whole cluster it belongs to when ``cluster``
    (any node's URL will do: the client discovers the others and their slots)."""
    if cluster:
        return RedisCluster.from_url(redis_url)
    return aioredis.Redis.from_url(redis_url)


def is_cluster(redis: Any) -> bool:
    """Whether ``redis`` is a Redis Cluster client (the keys of one call must share a slot)."""
    return isinstance(redis, RedisCluster)


async def get_many(redis: Any, keys: list[str]) -> list[Any]:
    """``MGET`` of keys in any slots (a cluster splits it by slot)."""
    if not keys:
        return []
    if is_cluster(redis):
        return list(await redis.mget_nonatomic(keys))
    return list(await redis.mget(keys))
