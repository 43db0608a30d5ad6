"""The local stack behind ``bench serve``: an embedded redis-server that leaves nothing behind."""

from __future__ import annotations

import contextlib
import glob
import http.server
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker.local_stack import (
    PortTakenError,
    RedisProcess,
    embedded_redis,
    free_port,
    redis_server_binary,
)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_embedded_redis_serves_then_leaves_no_process_port_or_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a temporary folder of its own: the suite's other process makes and removes its own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _port_open(port)
        assert len(glob.glob(os.path.join(tmp_path, "pagestream-redis-*"))) == 1
    assert not _port_open(port)
    assert glob.glob(os.path.join(tmp_path, "pagestream-redis-*")) == []


def test_redis_binary_and_free_port() -> None:
    assert os.access(redis_server_binary(), os.X_OK)
    port = free_port()
    assert 0 < port < 65536 and not _port_open(port)


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def http_server_on(port: int) -> Iterator[None]:
    """A web server on ``port``: it accepts the connection and answers a Redis command with
    an HTTP error, as a server another process started there would."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), http.server.BaseHTTPRequestHandler
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def test_a_redis_on_a_free_port_that_another_server_took_starts_on_another(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path)
    taken = server.port
    with http_server_on(taken):
        server.start()
        try:
            assert server.port != taken and redis.Redis(port=server.port).ping()
            port = server.port
            server.restart()  # up once, it keeps its port
            assert server.port == port and redis.Redis(port=port).ping()
        finally:
            server.stop()


def test_a_redis_that_does_not_exit_on_sigterm_is_killed_and_reaped(tmp_path: Path) -> None:
    """A stopped redis-server (SIGSTOP: it cannot act on SIGTERM) is killed after the
    timeout, not left running nor raised about (CI once saw a redis-server take more than the
    old 10 s to exit, and ``pagestream up`` ended with a traceback)."""
    server = RedisProcess(tmp_path)
    server.start()
    process = server.process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    assert server.stop(timeout_s=0.5) is False
    assert process.returncode == -signal.SIGKILL and server.process is None
    server.start()
    assert server.stop() is True  # a server that can exit on SIGTERM does


def test_a_redis_on_a_given_port_that_another_server_holds_is_refused_by_name(
    tmp_path: Path,
) -> None:
    port = free_port()
    other = RedisProcess(tmp_path / "other", port=port)
    other.directory.mkdir()
    other.start()  # a redis-server, but not this one
    try:
        server = RedisProcess(tmp_path, port=port)
        with pytest.raises(PortTakenError, match=rf"^port {port} is held by another process: "):
            server.start()
        assert server.process is None
    finally:
        other.stop()
    with (
        http_server_on(port),
        pytest.raises(PortTakenError, match=rf"^port {port} is held by another process: "),
    ):
        RedisProcess(tmp_path, port=port).start()
