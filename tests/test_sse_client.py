"""The benchmark's SSE client sends a request again when the server had closed the idle
keep-alive connection it meant to reuse (uvicorn closes idle ones after its keep-alive time)."""

from __future__ import annotations

import asyncio

import pytest

from bench.sse_client import SseConnection

REPLY = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"b\r\ndata: one\n\n\r\n0\r\n\r\n"
)


async def _serve_one_request_per_connection() -> tuple[asyncio.Server, list[int]]:
    requests: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        requests.append(length)
        writer.write(REPLY)
        await writer.drain()
        writer.close()  # as an idle keep-alive connection closed by the server

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, requests


def test_a_closed_keep_alive_connection_is_reopened_once() -> None:
    async def scenario() -> tuple[list[list[bytes]], list[int]]:
        server, requests = await _serve_one_request_per_connection()
        port = server.sockets[0].getsockname()[1]
        connection = SseConnection(f"http://127.0.0.1:{port}/v1")
        replies = []
        for _ in range(3):
            replies.append([e async for e in connection.post_events("/completions", b"{}")])
        await connection.close()
        server.close()
        return replies, requests

    replies, requests = asyncio.run(scenario())
    assert replies == [[b"one"]] * 3 and len(requests) == 3


def test_a_fresh_connection_that_closes_is_an_error() -> None:
    async def scenario() -> None:
        async def close_at_once(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connection = SseConnection(f"http://127.0.0.1:{port}/v1")
        try:
            with pytest.raises(ConnectionError):
                async for _ in connection.post_events("/completions", b"{}"):
                    pass
        finally:
            await connection.close()
            server.close()

    asyncio.run(scenario())
