"""Local Redis for the Redis benchmarks: one primary (``worker.local_stack.RedisProcess``) or an
N-primary Redis Cluster (``worker.local_cluster.RedisClusterProcess``, laid out as the request
shards' hash tags assume: docs/protocol.md#shards), on free local ports, each node optionally
pinned to a core of its own. No replicas, no persistence unless asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import redis

from worker.local_cluster import RedisClusterProcess
from worker.local_stack import RedisProcess


@dataclass
class RedisNodes:
    """``num_primaries`` redis-servers: a standalone one when ``cluster`` is false (then one
    node), else the primaries of one cluster. ``cores``: the core each node is pinned to
    (empty: not pinned)."""

    directory: Path
    num_primaries: int = 1
    cluster: bool = False
    cores: list[int] = field(default_factory=list)
    appendonly: bool = False

    def __post_init__(self) -> None:
        if not self.cluster and self.num_primaries != 1:
            raise ValueError("a standalone Redis has one primary")
        if self.cores and len(self.cores) != self.num_primaries:
            raise ValueError(f"{self.num_primaries} primaries need as many cores, got {self.cores}")
        self._servers: RedisClusterProcess | RedisProcess
        if self.cluster:
            self._servers = RedisClusterProcess(
                self.directory, num_primaries=self.num_primaries, appendonly=self.appendonly
            )
        else:
            self._servers = RedisProcess(self.directory, appendonly=self.appendonly)

    @property
    def nodes(self) -> list[RedisProcess]:
        servers = self._servers
        return servers.nodes if isinstance(servers, RedisClusterProcess) else [servers]

    @property
    def url(self) -> str:
        """The first node's URL (for a cluster, any node's names the whole cluster)."""
        return self._servers.url

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.process.pid for node in self.nodes if node.process is not None]

    def clients(self) -> list[redis.Redis]:
        """A plain (non-cluster) client of each node, for ``INFO`` (close them after use)."""
        return [redis.Redis(port=port, socket_timeout=5) for port in self.ports]

    def start(self) -> None:
        """Start every node (a cluster: joined, every slot served), then pin each to its core."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._servers.start()
        for pid, core in zip(self.pids, self.cores, strict=False):
            os.sched_setaffinity(pid, {core})

    def stop(self) -> None:
        """SIGTERM every node and wait for it."""
        self._servers.stop()
