"""``AsyncClient``: enqueue requests on Redis and read their events as workers write them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from clients import protocol
from clients.batch import BatchClient, BatchResult, BatchStatus
from clients.connect import cluster_from_env, connect, is_cluster
from clients.protocol import (
    CancelNotice,
    DoneEvent,
    ErrorEvent,
    Event,
    FinishReason,
    Keys,
    RestartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from clients.reader import (
    PerStreamReader,
    Reader,
    ShardedReader,
    StreamReader,
    Subscription,
    checked_entry_id,
)
from clients.router import Router, routing_from_env, shards_from_env

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEADLINE_GRACE_S = 5.0  # after a request's deadline, wait this long for its `timeout` event


BATCH_NEEDS_STANDALONE = (
    "batch jobs need a single Redis (arq's transactions span keys of several slots); give "
    "the batch client a standalone Redis's URL"
)


class ClientError(Exception):
    """Base class of the errors the client raises."""


class RequestFailedError(ClientError):
    """The request ended with an ``error`` event (invalid request, dead-lettered, ...)."""

    def __init__(self, request_id: str, event: ErrorEvent) -> None:
        super().__init__(f"request {request_id} failed ({event.code.value}): {event.message}")
        self.request_id = request_id
        self.code = event.code
        self.message = event.message
        self.field = event.field


class ClientClosedError(ClientError):
    """The client was closed while the call was waiting."""


class RequestTimeoutError(ClientError, TimeoutError):
    """No terminal event arrived in time (no worker running, or the request is too slow)."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"request {request_id}: no result within {timeout_s:g} s")
        self.request_id = request_id


@dataclass
class Choice:
    """One sample of a request's answer (``n`` > 1 gives several, by ``index``)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass
class Completion:
    """The whole answer to one request (``complete``). ``choices`` holds its samples by
    index; ``text``, ``token_ids`` and ``logprobs`` are the first one's, ``usage`` covers
    them all."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    num_restarts: int = 0  # attempts that died on a worker before this answer
    worker: str = ""  # the worker that finished it
    choices: list[Choice] = field(default_factory=lambda: [Choice()])

    def add(self, event: Event) -> None:
        """Fold one event in; a ``restart`` forgets what the dead attempt produced."""
        if isinstance(event, TokenEvent):
            self._add_tokens(event)
        elif isinstance(event, RestartEvent):
            self.text, self.token_ids, self.logprobs = "", [], []
            self.choices = [Choice()]
            self.num_restarts += 1
        elif isinstance(event, DoneEvent):
            self.finish_reason, self.usage, self.timings = (
                event.finish_reason, event.usage, event.timings,
            )  # fmt: skip
            self.worker = event.worker
            if len(self.choices) == 1 and self.choices[0].finish_reason is None:
                self.choices[0].finish_reason = event.finish_reason
                self.choices[0].stop_reason = event.stop_reason
            self.finish_reason = self.choices[0].finish_reason

    def _add_tokens(self, event: TokenEvent) -> None:
        while len(self.choices) <= event.index:
            self.choices.append(Choice(len(self.choices)))
        choice = self.choices[event.index]
        choice.text += event.text
        choice.token_ids += event.token_ids
        choice.logprobs += event.logprobs or []
        if event.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = event.finish_reason, event.stop_reason
        if event.index == 0:
            self.text, self.token_ids, self.logprobs = (
                choice.text, choice.token_ids, choice.logprobs,
            )  # fmt: skip


class AsyncClient:
    """Talks to pagestream workers through Redis (``redis://`` or ``rediss://``, with auth).

    >>> async with AsyncClient("redis://localhost:6379/0") as client:
    ...     async for event in client.stream(prompt="Hello", max_tokens=8, temperature=0):
    ...         print(event)

    ``timeout_s`` (here, or per call) bounds how long a call waits for the request's end; it
    also becomes the request's deadline, after which a worker ends it as ``timeout``.
    ``shards``: how many request streams the deployment's workers read (its ``--shards``);
    each request goes to one, by its session or its id. ``cluster``: ``redis_url`` names a
    node of a Redis Cluster (batch jobs then are not available: arq needs one Redis).
    ``home_shard`` (0..shards-1): the requests this client names get ids whose keys lie on
    that shard, so that on a cluster it reads them all with one blocked ``XREAD`` on one
    primary instead of one per shard (docs/operations.md#home-shards); a fleet of clients
    spreads its home shards over the shards.
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = protocol.DEFAULT_PREFIX,
        timeout_s: float | None = None,
        redis: aioredis.Redis | Any = None,
        routing: bool | None = None,
        shards: int | None = None,
        cluster: bool | None = None,
        home_shard: int | None = None,
    ) -> None:
        # A Redis Cluster when ``cluster`` (None: PAGESTREAM_REDIS_CLUSTER) or ``redis`` is one.
        if redis is None:
            redis = connect(redis_url, cluster=cluster_from_env() if cluster is None else cluster)
        self.redis = redis
        # The deployment's request streams (docs/protocol.md#shards); None: PAGESTREAM_SHARDS.
        self.keys = Keys(prefix, shards_from_env() if shards is None else shards)
        if home_shard is not None and (
            error := self.keys.home_shard_error(home_shard, "home_shard")
        ):
            raise ValueError(error)
        self.home_shard = home_shard
        # Prefix-aware routing (docs/routing.md); None: PAGESTREAM_ROUTING decides.
        self.router = Router(self.redis, self.keys) if _routing(routing) else None
        self.timeout_s = timeout_s
        # arq's transactions span keys of several slots: no batch jobs on a Redis Cluster
        self._batches = None if is_cluster(self.redis) else BatchClient(self.redis, prefix)
        self._reader = _reader(self.redis, self.keys)

    async def close(self) -> None:
        """Close the Redis connections; a call still reading a request raises
        ``ClientClosedError``."""
        await self._reader.close(ClientClosedError("the client was closed"))
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        timeout_s: float | None = None,
        traceparent: str | None = None,
        **sampling: Any,
    ) -> str:
        """Enqueue a request (exactly one of ``prompt``/``messages``/``token_ids``); returns its id.

        ``sampling``: any ``Request`` sampling field (``max_tokens``, ``temperature``, ...);
        ``structured_outputs={"json_schema": {...}}`` (or ``json_schema={...}``, a dict or its
        JSON text), ``{"regex": ...}``, ``{"choice": [...]}``, ... constrain the output.
        Submitting an id again is safe: the second entry is not run, and both callers read
        the first one's events. An id must be 1..256 printable characters, and integers must
        fit 64 bits (``ValueError``).
        """
        if request_id is None:
            request_id = self.keys.new_request_id(self.home_shard)
        # A worker cannot answer on a stream named by a bad id: it would only dead-letter the
        # entry, and the caller would wait for nothing.
        protocol.check_request_id(request_id)
        request = protocol.new_request(
            request_id, prompt=prompt, messages=messages, token_ids=token_ids,
            priority=priority, tenant=tenant,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            traceparent=traceparent, now_ms=int(time.time() * 1000), **sampling,
        )  # fmt: skip
        payload = protocol.encode_request(request)
        if self.router is not None:
            await self.router.enqueue(request, payload)
        else:
            shard = self.keys.shard_for(request.id, request.session)
            await self.redis.xadd(shard, {protocol.PAYLOAD_FIELD: payload})
        return request_id

    async def events(
        self, request_id: str, *, after: str = "0-0", timeout_s: float | None = None
    ) -> AsyncIterator[Event]:
        """Every event of a request after stream entry ``after`` (each has ``event_id``).

        Ends after the terminal event (``done`` or ``error``, both yielded). Resume an
        interrupted read with ``after=`` the last ``event_id`` seen. Survives Redis restarts.
        """
        timeout_s = self._wait_s(timeout_s)
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        key = self.keys.out(request_id)
        subscription = await self._reader.subscribe(key, checked_entry_id(after))
        try:
            while True:
                try:  # an entry already delivered needs no timer (wait_for costs a task)
                    item = subscription.queue.get_nowait()
                except asyncio.QueueEmpty:
                    item = await self._next_entry(subscription, request_id, deadline_s, timeout_s)
                if isinstance(item, BaseException):
                    raise item
                entry_id, payload = item
                event = protocol.decode_event(payload, entry_id)
                yield event
                if isinstance(event, protocol.TERMINAL_EVENTS):
                    return
        finally:
            self._reader.unsubscribe(subscription)

    @staticmethod
    async def _next_entry(
        subscription: Subscription,
        request_id: str,
        deadline_s: float | None,
        timeout_s: float | None,
    ) -> tuple[str, bytes] | BaseException:
        if deadline_s is None:
            return await subscription.queue.get()
        try:
            return await asyncio.wait_for(subscription.queue.get(), deadline_s - time.monotonic())
        except TimeoutError:
            raise RequestTimeoutError(request_id, timeout_s or 0.0) from None

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> AsyncIterator[TokenEvent | RestartEvent | DoneEvent]:
        """Submit a request and yield its ``token`` events as they arrive, then ``done``.

        A ``restart`` event means a worker died and the request runs again from the start:
        drop the text received so far. An ``error`` event raises ``RequestFailedError``; no
        event in time raises ``RequestTimeoutError``, and the request is then cancelled.
        ``options``: ``submit``'s keyword arguments (sampling, priority, tenant, ...).
        """
        request_id = await self.submit(
            prompt, messages=messages, token_ids=token_ids, request_id=request_id,
            timeout_s=timeout_s, **options,
        )  # fmt: skip
        try:
            async for event in self.resume(request_id, timeout_s=timeout_s):
                yield event
        except RequestTimeoutError:  # as ``result``: nobody waits for it any more
            await self.cancel(request_id)
            raise

    async def resume(
        self, request_id: str, *, after: str = "0-0", timeout_s: float | None = None
    ) -> AsyncIterator[TokenEvent | RestartEvent | DoneEvent]:
        """``stream`` for a request already submitted, from the event after ``after``.

        A token event written twice (a worker's write retried across a Redis failure) is
        dropped by its ``seq``.
        """
        next_seq = 0
        async for event in self.events(request_id, after=after, timeout_s=timeout_s):
            if isinstance(event, ErrorEvent):
                raise RequestFailedError(request_id, event)
            if isinstance(event, RestartEvent):
                next_seq = 0
            elif isinstance(event, TokenEvent):
                if event.seq < next_seq:
                    continue
                next_seq = event.seq + 1
            yield event

    async def complete(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Completion:
        """Submit a request and wait for its whole answer (restarts are hidden).

        Raises ``RequestFailedError``, or ``RequestTimeoutError`` (the request is then
        cancelled).
        """
        request_id = await self.submit(
            prompt, messages=messages, token_ids=token_ids, request_id=request_id,
            timeout_s=timeout_s, **options,
        )  # fmt: skip
        return await self.result(request_id, timeout_s=timeout_s)

    async def result(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """The whole answer of a request already submitted (see ``complete``)."""
        completion = Completion(request_id)
        try:
            async for event in self.resume(request_id, timeout_s=timeout_s):
                completion.add(event)
        except RequestTimeoutError:
            await self.cancel(request_id)
            raise
        return completion

    async def cancel(self, request_id: str) -> None:
        """Cancel a request, queued or running; its stream then ends with ``done``/``cancelled``.
        An id no request can have is a ``ValueError``."""
        protocol.check_request_id(request_id)
        # Two slots in a Redis Cluster, so not one transaction: the key first, which a worker
        # reads when it admits the request; the notice wakes the worker running it.
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(request_id), 1, ex=protocol.CANCEL_TTL_S)
        pipe.xadd(
            self.keys.cancels,
            {protocol.PAYLOAD_FIELD: protocol.encode(CancelNotice(id=request_id))},
            maxlen=protocol.CANCELS_MAXLEN,
            approximate=True,
        )
        await pipe.execute()

    def _wait_s(self, timeout_s: float | None) -> float | None:
        # The worker ends a request at its deadline (= timeout_s): allow for that event.
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return None if timeout_s is None else timeout_s + DEADLINE_GRACE_S

    # -- batch jobs (see clients.batch and docs/batch.md) -----------------------------------------

    @property
    def batches(self) -> BatchClient:
        """The batch jobs' client; ``ClientError`` on a Redis Cluster."""
        if self._batches is None:
            raise ClientError(f"not on a Redis Cluster: {BATCH_NEEDS_STANDALONE}")
        return self._batches

    async def submit_batch(
        self,
        prompts: list[str] | None = None,
        *,
        lines: list[str] | None = None,
        input_path: str | None = None,
        output_path: str | None = None,
        job_id: str | None = None,
        chat: bool = False,
        **sampling: Any,
    ) -> str:
        """Enqueue a batch job over ``prompts``, JSONL ``lines``, or a JSONL file on the worker.

        ``sampling``: defaults for every line (a line's own fields win); greedy, 256 tokens
        unless set. ``output_path``: the worker also writes the records there (JSONL, in input
        order). Returns the job id; ``batch_status``/``batch_result``/``abort_batch`` take it.
        """
        return await self.batches.submit(
            prompts, lines=lines, input_path=input_path, output_path=output_path, job_id=job_id,
            chat=chat, **sampling,
        )  # fmt: skip

    async def batch_status(self, job_id: str) -> BatchStatus:
        """A batch job's state and ``done``/``total``/``failed`` counters, readable while it runs."""
        return await self.batches.status(job_id)

    async def batch_result(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = None
    ) -> BatchResult:
        """A batch job's records in input order, after it ends (``wait=False``: as they are now)."""
        return await self.batches.result(job_id, wait=wait, timeout_s=timeout_s)

    async def abort_batch(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = 60.0
    ) -> BatchStatus:
        """Abort a batch job; its finished lines keep their records. Returns its status."""
        return await self.batches.abort(job_id, wait=wait, timeout_s=timeout_s)


def _reader(redis: Any, keys: Keys) -> Reader:
    """One ``XREAD`` for every stream on one Redis; on a cluster one per shard (K > 1: a
    shard's streams share its slot), else one per stream (each has a slot of its own)."""
    if not is_cluster(redis):
        return StreamReader(redis, keys)
    if keys.key_layout == protocol.KEY_LAYOUT_PER_SHARD:
        return ShardedReader(redis, keys)
    return PerStreamReader(redis, keys)


def _routing(routing: bool | None) -> bool:
    return routing_from_env() if routing is None else routing
