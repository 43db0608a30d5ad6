"""``Client``: the blocking face of ``AsyncClient``, for scripts and threads without a loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from clients.aio import DEFAULT_REDIS_URL, AsyncClient, ClientClosedError, Completion
from clients.batch import BatchResult, BatchStatus
from clients.protocol import DEFAULT_PREFIX, DoneEvent, Event, RestartEvent, TokenEvent

T = TypeVar("T")
CLOSE_TIMEOUT_S = 10.0  # closing waits this long for Redis before stopping the loop anyway


class Client:
    """Every ``AsyncClient`` call, blocking; the async client runs on a private loop thread.

    >>> with Client("redis://localhost:6379/0") as client:
    ...     print(client.complete(prompt="Hello", max_tokens=8, temperature=0).text)

    A client that is never closed closes itself when garbage-collected or at interpreter exit.
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float | None = None,
        routing: bool | None = None,
        shards: int | None = None,
        cluster: bool | None = None,
        home_shard: int | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=_run_loop, args=(self._loop,), name="pagestream-client", daemon=True
        )
        self._thread.start()
        try:
            self._client = AsyncClient(
                redis_url, prefix=prefix, timeout_s=timeout_s, routing=routing, shards=shards,
                cluster=cluster, home_shard=home_shard,
            )  # fmt: skip
        except BaseException:  # a bad setting: no loop thread left behind
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise
        # Without this, a client left open leaves its stream reader blocked in XREAD on a loop
        # that interpreter exit freezes; the garbage collector then destroys the pending task
        # off its loop ("Task was destroyed but it is pending!"). The finalizer holds no
        # reference to ``self``, so dropping the client runs it; ``atexit`` runs the rest.
        self._finalizer = weakref.finalize(self, _shut_down, self._loop, self._thread, self._client)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise ClientClosedError("the client is closed") from None
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # closed while it waited (``_shut_down``)
            raise ClientClosedError("the client was closed") from None

    def _iterate(self, events: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(events.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():  # the client may be closed before the iterator
                self._run(events.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close the Redis connections and stop the loop thread (again: a no-op)."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(self, prompt: str | None = None, **options: Any) -> str:
        """See ``AsyncClient.submit``."""
        return self._run(self._client.submit(prompt, **options))

    def stream(
        self, prompt: str | None = None, **options: Any
    ) -> Iterator[TokenEvent | RestartEvent | DoneEvent]:
        """See ``AsyncClient.stream``."""
        return self._iterate(self._client.stream(prompt, **options))

    def resume(
        self, request_id: str, *, after: str = "0-0", timeout_s: float | None = None
    ) -> Iterator[TokenEvent | RestartEvent | DoneEvent]:
        """See ``AsyncClient.resume``."""
        return self._iterate(self._client.resume(request_id, after=after, timeout_s=timeout_s))

    def events(
        self, request_id: str, *, after: str = "0-0", timeout_s: float | None = None
    ) -> Iterator[Event]:
        """See ``AsyncClient.events``: every event, ``error`` included."""
        return self._iterate(self._client.events(request_id, after=after, timeout_s=timeout_s))

    def complete(self, prompt: str | None = None, **options: Any) -> Completion:
        """See ``AsyncClient.complete``."""
        return self._run(self._client.complete(prompt, **options))

    def result(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """See ``AsyncClient.result``."""
        return self._run(self._client.result(request_id, timeout_s=timeout_s))

    def cancel(self, request_id: str) -> None:
        """See ``AsyncClient.cancel``."""
        self._run(self._client.cancel(request_id))

    def submit_batch(self, prompts: list[str] | None = None, **options: Any) -> str:
        """See ``AsyncClient.submit_batch``."""
        return self._run(self._client.submit_batch(prompts, **options))

    def batch_status(self, job_id: str) -> BatchStatus:
        """See ``AsyncClient.batch_status``."""
        return self._run(self._client.batch_status(job_id))

    def batch_result(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = None
    ) -> BatchResult:
        """See ``AsyncClient.batch_result``."""
        return self._run(self._client.batch_result(job_id, wait=wait, timeout_s=timeout_s))

    def abort_batch(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = 60.0
    ) -> BatchStatus:
        """See ``AsyncClient.abort_batch``."""
        return self._run(self._client.abort_batch(job_id, wait=wait, timeout_s=timeout_s))


def _shut_down(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: AsyncClient
) -> None:
    """Close ``client`` on its own loop, then stop the loop and its thread."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # dropped by a callback on the loop itself
        loop.create_task(client.close()).add_done_callback(lambda _: loop.stop())
        return
    future = asyncio.run_coroutine_threadsafe(_close(client), loop)
    with contextlib.suppress(concurrent.futures.TimeoutError):  # Redis unreachable: stop anyway
        future.result(CLOSE_TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


async def _close(client: AsyncClient) -> None:
    """Close ``client``, then end every call other threads still wait on (a call in a Redis
    command, say): each raises ``ClientClosedError`` in its thread rather than blocking on a
    stopped loop."""
    try:
        await client.close()
    finally:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=CLOSE_TIMEOUT_S)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_forever()
    loop.close()
