"""The Redis a chaos run attacks: one redis-server, or (``--chaos-cluster``) a 3-primary Redis
Cluster with one request shard per primary. Both persist every write (``appendfsync
always``), so ``kill -9`` and a restart on the same port and folder lose nothing."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from clients.protocol import Keys
from tests.chaos.plugin import ChaosSettings
from tests.redis_cluster import NUM_PRIMARIES, RedisCluster
from tests.redis_server import RedisServer
from worker.local_stack import RedisProcess

DOWN_S = 0.5  # between the kill and the restart


class ChaosRedis:
    """What the chaos test needs of its Redis, the same for a server and a cluster."""

    def __init__(self, directory: Path, *, cluster: bool) -> None:
        self.cluster = RedisCluster(directory, appendonly=True) if cluster else None
        self.server = None if cluster else RedisServer(directory)
        self.num_shards = NUM_PRIMARIES if cluster else 1
        self.keys = Keys(num_shards=self.num_shards)

    @property
    def url(self) -> str:
        return self.cluster.url if self.cluster else self._server().url

    @property
    def worker_flags(self) -> tuple[str, ...]:
        """``pagestream worker`` flags for this Redis."""
        if self.cluster is None:
            return ()
        return ("--redis-cluster", "on", "--shards", str(self.num_shards))

    @property
    def client_options(self) -> dict[str, Any]:
        """``AsyncClient`` options for this Redis."""
        return {"cluster": self.cluster is not None, "shards": self.num_shards}

    def health_flags(self) -> list[str]:
        """``pagestream health`` flags for this Redis."""
        cluster = ["--redis-cluster", "on"] if self.cluster else []
        return ["--redis-url", self.url, *cluster]

    def start(self) -> None:
        (self.cluster or self._server()).start()

    def stop(self) -> None:
        (self.cluster or self._server()).stop()

    def client(self) -> Any:
        """A synchronous client: ``redis.Redis`` or ``redis.RedisCluster``."""
        if self.cluster is not None:
            return self.cluster.client()
        return self._server().client()

    def kill_and_restart(self) -> str:
        """``kill -9`` (the one server, or the cluster's second primary) and a restart on the
        same port and folder; says what was done."""
        if self.cluster is None:
            _kill_and_restart(self._server())
            return "redis kill -9 + restart (AOF)"
        node = self.cluster.nodes[1]
        _kill_and_restart(node)
        return f"cluster primary {node.port} (1 of {NUM_PRIMARIES}) kill -9 + restart (AOF)"

    def memory(self) -> str:
        """``used_memory`` / peak, summed over the primaries."""
        nodes = self.cluster.nodes if self.cluster else [self._server()]
        used = peak = 0
        for node in nodes:
            client = redis.Redis(port=node.port)
            info = client.info("memory")
            client.close()
            used += info["used_memory"]
            peak += info["used_memory_peak"]
        return f"{used / 2**20:.1f} MiB / {peak / 2**20:.1f} MiB"

    def _server(self) -> RedisServer:
        assert self.server is not None
        return self.server


def _kill_and_restart(process: RedisProcess) -> None:
    assert process.process is not None
    process.process.send_signal(signal.SIGKILL)
    process.process.wait()
    process.process = None
    time.sleep(DOWN_S)
    process.start()  # same port, same data dir: the AOF (and a node's nodes.conf) bring it back


@pytest.fixture
def chaos_redis(tmp_path: Path, chaos_settings: ChaosSettings) -> Iterator[ChaosRedis]:
    """The run's Redis, started; stopped after the test."""
    target = ChaosRedis(tmp_path / "redis", cluster=chaos_settings.cluster)
    (tmp_path / "redis").mkdir()
    target.start()
    try:
        yield target
    finally:
        target.stop()
