"""``Client``: the blocking face of ``AsyncClient``, for scripts and threads without a loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from clients.aio import DEFAULT_REDIS_URL, AsyncClient, Completion
from clients.batch import BatchResult, BatchStatus
from clients.protocol import DEFAULT_PREFIX, DoneEvent, RestartEvent, TokenEvent

T = TypeVar("T")


class Client:
    """Every ``AsyncClient`` call, blocking; the async client runs on a private loop thread.

    >>> with Client("redis://localhost:6379/0") as client:
    ...     print(client.complete(prompt="Hello", max_tokens=8, temperature=0).text)
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pagestream-client", daemon=True
        )
        self._thread.start()
        self._client = AsyncClient(redis_url, prefix=prefix, timeout_s=timeout_s)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
        """Close the Redis connections and stop the loop thread."""
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

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
