"""A Redis Cluster on this machine: N primaries, no replicas, from the bundled redis-server.

``RedisClusterProcess`` runs ``num_primaries`` ``redis-server``s with ``--cluster-enabled
yes`` (``worker.local_stack.RedisProcess`` each), node I on port ``port + I`` with its data
and ``nodes.conf`` in ``directory/node-I``, and joins them as ``redis-cli --cluster create``
would: ``CLUSTER MEET``, then a contiguous 1/N of the 16,384 slots each, in port order
(``CLUSTER ADDSLOTS``: ``ADDSLOTSRANGE`` needs Redis 7), which is the layout the request
shards' hash tags assume (docs/operations.md#redis-cluster). Started again on the same
folders and ports, the nodes find each other from their ``nodes.conf`` and keep their data
(with ``appendonly``). ``pagestream up --redis-cluster-primaries N`` and the tests use it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clients.protocol import CLUSTER_SLOTS
from worker.errors import CommandError
from worker.local_stack import (
    BUS_PORT_OFFSET,
    CLUSTER_CONFIG_FILE,
    RedisProcess,
    free_port,
    is_free,
    start_on_free_ports,
    wait_until,
)

CLUSTER_START_TIMEOUT_S = 20.0
MAX_PORT = 65535
# The `myself` line of a nodes.conf: "<id> <ip>:<port>@<bus port>[,<hostname>] myself,master ..."
MYSELF_PORT = re.compile(r"^\S+ [^ ]*:(\d+)@\d+\S* \S*myself", re.MULTILINE)


class NoClusterSupportError(CommandError):
    """The redis-server binary was built without cluster support."""


class RedisClusterProcess:
    """``num_primaries`` cluster nodes on ports ``port``, ``port + 1``, ... (free ones when
    ``port`` is None), each holding an equal, contiguous range of the slots in port order."""

    def __init__(
        self,
        directory: Path,
        *,
        num_primaries: int = 3,
        port: int | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        supervised: bool = False,
    ) -> None:
        if not 1 <= num_primaries <= CLUSTER_SLOTS:
            raise CommandError(f"a cluster needs 1..{CLUSTER_SLOTS} primaries, got {num_primaries}")
        self.directory = directory
        self.free_ports = port is None
        self._node_options: dict[str, Any] = dict(
            appendonly=appendonly, appendfsync=appendfsync, supervised=supervised
        )
        ports = free_node_ports(num_primaries) if port is None else node_ports(port, num_primaries)
        self.nodes = self._make_nodes(ports)

    def _make_nodes(self, ports: list[int]) -> list[RedisProcess]:
        return [
            RedisProcess(self.directory / f"node-{index}", port=node_port, cluster_node=True,
                         **self._node_options)
            for index, node_port in enumerate(ports)
        ]  # fmt: skip

    @property
    def ports(self) -> list[int]:
        """The primaries' client ports, in slot order."""
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL, which names the whole cluster (a client finds the rest)."""
        return self.nodes[0].url

    def start(self) -> None:
        """Start every node, join them into one cluster unless their ``nodes.conf`` already
        does, and wait until the cluster serves every slot. On free ports, a node that fails
        to start (another process bound its port or bus port after it was found free) makes
        the cluster start again on other free ports, up to ``FREE_PORT_ATTEMPTS`` times."""
        self._check_ports_of_earlier_run()

        def move() -> None:
            for node in self.nodes:  # this attempt's own, on ports given up
                (node.directory / CLUSTER_CONFIG_FILE).unlink(missing_ok=True)
            self.nodes = self._make_nodes(free_node_ports(len(self.nodes)))

        start_on_free_ports(self._start_nodes, move if self.free_ports else None)

    def _start_nodes(self) -> None:
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
        try:
            for node in self.nodes:
                node.start()
            with _node_clients(self.ports) as clients:
                self._join(clients)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> bool:
        """SIGTERM each node (AOF flushed) and wait for it (``RedisProcess.stop``: killed
        past its timeout); True when every node exited on SIGTERM."""
        for node in self.nodes:
            if node.process is not None:
                node.process.terminate()
        return all([node.stop() for node in self.nodes])  # every node, not the first few

    def _join(self, clients: list[Any]) -> None:
        if clients[0].info("cluster").get("cluster_enabled") != 1:
            raise NoClusterSupportError("this redis-server was built without cluster support")
        infos = [_cluster_info(client) for client in clients]
        fresh = [info["cluster_known_nodes"] == 1 and info["cluster_slots_assigned"] == 0
                 for info in infos]  # fmt: skip
        if all(fresh):
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
            num_primaries = len(clients)
            for index, client in enumerate(clients):
                low = index * CLUSTER_SLOTS // num_primaries
                high = (index + 1) * CLUSTER_SLOTS // num_primaries
                client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
        elif any(fresh):
            raise CommandError(
                f"{self.directory} holds a cluster of another size than {len(clients)} "
                "primaries: start it with its own number, or use another data folder"
            )
        wait_until(
            lambda: all(self._serves_every_slot(client) for client in clients),
            CLUSTER_START_TIMEOUT_S,
            f"a {len(clients)}-primary redis cluster (cluster_state:ok)",
        )

    def _serves_every_slot(self, client: Any) -> bool:
        info = _cluster_info(client)
        return bool(
            info["cluster_state"] == "ok" and info["cluster_known_nodes"] == len(self.nodes)
        )

    def _check_ports_of_earlier_run(self) -> None:
        """A node's ``nodes.conf`` names its peers by port: the same folders need the same ports."""
        recorded = []
        for node in self.nodes:
            config = node.directory / CLUSTER_CONFIG_FILE
            found = MYSELF_PORT.search(config.read_text()) if config.exists() else None
            recorded.append(int(found[1]) if found else node.port)
        if recorded != self.ports:
            raise CommandError(
                f"{self.directory} holds a cluster on ports {', '.join(map(str, recorded))}, "
                f"not {', '.join(map(str, self.ports))}: start it on its ports again, or use "
                "another data folder"
            )


def node_ports(first: int, count: int) -> list[int]:
    """``first``, ``first + 1``, ...: each with its bus port (+10000) in range."""
    ports = list(range(first, first + count))
    if ports[-1] + BUS_PORT_OFFSET > MAX_PORT:
        raise CommandError(
            f"cluster ports {first}..{ports[-1]} leave no room for their bus ports (+"
            f"{BUS_PORT_OFFSET}): choose a port at most {MAX_PORT - BUS_PORT_OFFSET - count + 1}"
        )
    return ports


def free_node_ports(count: int) -> list[int]:
    """``count`` free ports whose cluster-bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if (
            port + BUS_PORT_OFFSET <= MAX_PORT
            and port not in ports
            and is_free(port + BUS_PORT_OFFSET)
        ):
            ports.append(port)
    return ports


@contextlib.contextmanager
def _node_clients(ports: list[int]) -> Iterator[list[Any]]:
    """One plain client per node (``CLUSTER`` commands go to that node), closed after."""
    import redis

    clients = [redis.Redis(port=port, socket_timeout=2) for port in ports]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def _cluster_info(client: Any) -> dict[str, Any]:
    """``CLUSTER INFO`` as a mapping (numbers as ints)."""
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        fields[key] = int(value) if value.isdigit() else value
    return fields
