"""A lean HTTP/1.1 client for server-sent events: the load generator of ``bench serve --through
gateway``.

One benchmark process stands for hundreds of independent HTTP clients, so its cost per event
must stay well below the gateway's, or the benchmark measures itself. On the 2-core CPU, per
streamed token: httpx 136 µs, this client 35 µs (the bundled Redis client's reader: 33 µs),
the gateway itself 65 µs. It does only what the benchmark needs: POST a JSON body
on a keep-alive connection, read a chunked (or sized) reply, yield each event's ``data``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

READ_LIMIT_BYTES = 1 << 20  # one line (an event, a header) may be this long


class HttpError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status
        self.body = body


class SseConnection:
    """One keep-alive connection to ``base_url`` (``http://host:port/prefix``), opened on first
    use. A stream must be read to its end before the next request."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"expected an http://host:port/... URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.path_prefix = parts.path.rstrip("/")
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self._head = f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n{extra}"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST ``body`` to ``path``; yields the ``data`` of each event of the reply."""
        request = f"POST {self.path_prefix}{path} HTTP/1.1\r\n{self._head}"
        message = f"{request}Content-Length: {len(body)}\r\n\r\n".encode() + body
        reused = self._writer is not None
        try:
            status, headers = await self._send(message)
        except ConnectionError:
            if not reused:
                raise
            # The server closed the idle keep-alive connection before it read the request, as
            # HTTP allows: send it once more on a new connection.
            await self.close()
            status, headers = await self._send(message)
        assert self._reader is not None
        if headers.get("transfer-encoding") != "chunked":
            data = await self._reader.readexactly(int(headers.get("content-length", "0")))
            if status != 200:
                raise HttpError(status, data)
            for event in _events(data + b"\n\n")[0]:
                yield event
            return
        if status != 200:
            raise HttpError(status, b"".join([chunk async for chunk in self._chunks()]))
        pending = b""
        async for chunk in self._chunks():
            events, pending = _events(pending + chunk)
            for event in events:
                yield event

    async def _send(self, message: bytes) -> tuple[int, dict[str, str]]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=READ_LIMIT_BYTES
            )
        assert self._reader is not None
        self._writer.write(message)
        return await self._read_head(self._reader)

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):  # the server may have reset it first
                await writer.wait_closed()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        return status, headers

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The chunks of a chunked body, up to the last (empty) one."""
        assert self._reader is not None
        while True:
            size = int((await self._reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await self._reader.readline()  # the blank line after the (absent) trailers
                return
            yield (await self._reader.readexactly(size + 2))[:-2]


def _events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data`` of each complete event in ``buffer``, and the incomplete rest."""
    *complete, rest = buffer.split(b"\n\n")
    return [event[6:] for event in complete if event.startswith(b"data: ")], rest
