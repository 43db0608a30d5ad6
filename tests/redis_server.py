"""A real redis-server on a free port, for the service tests: the product's own
``worker.local_stack.RedisProcess``, with AOF persistence fsynced on every write."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker.local_stack import RedisProcess


class RedisServer(RedisProcess):
    """One redis-server process; ``restart`` keeps its port and (with AOF) its data."""

    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        super().__init__(directory, appendonly=appendonly, appendfsync="always")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server with AOF persistence, stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
