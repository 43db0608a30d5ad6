"""The response to a generation request: server-sent events or one JSON body.

Nothing is sent until the request's first event arrives, so a request the worker refuses (a
prompt longer than the context, say) gets a proper error status even when it asked for a
stream. While it runs, the ASGI ``receive`` channel is watched: when the HTTP client goes away
the request is cancelled through the protocol (``{p}:cancel:{id}`` and ``{p}:cancels``), and
the worker frees its pages within a step. An error after the stream began is sent as an
``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from clients.aio import AsyncClient, RequestFailedError, RequestTimeoutError
from clients.protocol import DoneEvent, RestartEvent, TokenEvent
from clients.reader import REDIS_ERRORS
from worker.gateway import errors
from worker.gateway.errors import OpenAIError
from worker.gateway.metrics import Observation
from worker.gateway.responses import ResponseBuilder, Transcripts
from worker.gateway.translate import Generation

DONE_LINE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must pass each event on at once
]
JSON_HEADERS = [(b"content-type", b"application/json")]

Events = AsyncIterator[TokenEvent | RestartEvent | DoneEvent]


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class GenerationResponse(Response):
    """Runs one submitted request and answers with its events (see the module)."""

    def __init__(
        self,
        client: AsyncClient,
        generation: Generation,
        builder: ResponseBuilder,
        observation: Observation,
        timeout_s: float,
    ) -> None:
        super().__init__()
        self.client = client
        self.generation = generation
        self.builder = builder
        self.observation = observation
        self.timeout_s = timeout_s
        self.finished = False  # the request's terminal event was read
        self.headers_sent = False
        self._gone: asyncio.Future[None] | None = None  # ends when the client disconnects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self.client.resume(self.generation.request_id, timeout_s=self.timeout_s)
        pump = asyncio.ensure_future(self._pump(events, send))
        self._gone = gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                self.observation.finish(499)  # nginx's "client closed request"
            else:
                pump.result()  # re-raises a failure of the gateway itself
        finally:
            if not self.finished:  # the client left (or the gateway failed, or stops): cancel
                await _shielded_cancel(self.client, self.generation.request_id)
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            self.observation.finish(500)  # unless counted already
            await _close(events)

    def _client_gone(self) -> bool:
        # Checked per event as well: Python < 3.12 can lose a task's cancellation when the
        # awaited queue read completes at the same moment (asyncio.wait_for).
        return self._gone is not None and self._gone.done()

    async def _pump(self, events: Events, send: Send) -> None:
        try:
            first = await anext(events)
            if self.generation.stream:
                await self._stream(first, events, send)
            else:
                await self._whole(first, events, send)
        except OpenAIError as exc:
            await self._fail(exc, send)
        except RequestFailedError as exc:
            field = self.generation.request_field(exc.field)
            await self._fail(errors.from_worker(exc.code, exc.message, field), send)
            self.finished = True  # an error event is terminal
        except RequestTimeoutError:
            message = f"no answer within {self.timeout_s:g} s"
            await self._fail(OpenAIError(504, message, type="timeout", code="timeout"), send)
        except REDIS_ERRORS as exc:
            await self._fail(errors.redis_unreachable(exc), send)

    async def _stream(self, first: Any, events: Events, send: Send) -> None:
        await self._start(200, SSE_HEADERS, send)
        opening = b"".join(sse(chunk) for chunk in self.builder.opening_chunks())
        if opening:
            await _body(send, opening)
        num_tokens = 0
        event = first
        while not self._client_gone():
            if isinstance(event, DoneEvent):
                self.finished = True
                closing = b"".join(sse(c) for c in self.builder.closing_chunks(event))
                await _body(send, closing + DONE_LINE, more=False)
                self.observation.finish(200, event.usage.completion_tokens)
                return
            if isinstance(event, RestartEvent) and num_tokens:
                raise OpenAIError(
                    500, "the worker serving this request died after streaming part of it; "
                    "send it again", type=errors.SERVER_ERROR, code="worker_restarted",
                )  # fmt: skip
            if isinstance(event, TokenEvent):
                if not num_tokens:
                    self.observation.first_token()
                num_tokens += len(event.token_ids)
                chunks = self.builder.token_chunks(event)
                if chunks:
                    await _body(send, b"".join(sse(chunk) for chunk in chunks))
            event = await anext(events)

    async def _whole(self, first: Any, events: Events, send: Send) -> None:
        transcripts = Transcripts()
        event = first
        while not isinstance(event, DoneEvent):
            if self._client_gone():
                return
            if isinstance(event, TokenEvent) and transcripts.is_empty:
                self.observation.first_token()
            transcripts.add(event)
            event = await anext(events)
        self.finished = True
        await self._start(200, JSON_HEADERS, send)
        await _body(send, self.builder.body(transcripts, event), more=False)
        self.observation.finish(200, event.usage.completion_tokens)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]], send: Send) -> None:
        request_id = self.generation.request_id.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"x-request-id", request_id)]})  # fmt: skip
        self.headers_sent = True

    async def _fail(self, exc: OpenAIError, send: Send) -> None:
        self.observation.finish(exc.status)
        with contextlib.suppress(OSError):  # the client may be gone too
            if self.headers_sent:
                await _body(send, sse(exc.payload()) + DONE_LINE, more=False)
                return
            await self._start(exc.status, JSON_HEADERS, send)
            await _body(send, exc.payload(), more=False)


async def _body(send: Send, data: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request body was read already)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _close(events: Events) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def _shielded_cancel(client: AsyncClient, request_id: str) -> None:
    """Cancel the request even while this task is being cancelled (server shutdown)."""
    task = asyncio.ensure_future(client.cancel(request_id))
    with contextlib.suppress(asyncio.CancelledError, *REDIS_ERRORS):
        await asyncio.shield(task)
