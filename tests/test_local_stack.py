"""The local stack behind ``bench serve``: an embedded redis-server that leaves nothing behind."""

from __future__ import annotations

import glob
import os
import socket
import tempfile

import redis

from worker.local_stack import embedded_redis, free_port, redis_server_binary


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_embedded_redis_serves_then_leaves_no_process_port_or_folder() -> None:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "pagestream-redis-*")))
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _port_open(port)
    assert not _port_open(port)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "pagestream-redis-*"))) == before


def test_redis_binary_and_free_port() -> None:
    assert os.access(redis_server_binary(), os.X_OK)
    port = free_port()
    assert 0 < port < 65536 and not _port_open(port)
