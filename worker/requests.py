"""One request's way through a worker: decode, own, admit, stream events, finish.

Every write to ``{p}:out:{id}`` happens only after this worker's entry owns ``{p}:claim:{id}``,
so neither a duplicate id nor a hostile entry can write into another request's stream; each
write checks that claim in the same script call. An entry is acknowledged only after its
terminal event is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from redis.exceptions import OutOfMemoryError

from clients import protocol
from clients.protocol import DeadLetter, ErrorCode, ErrorEvent, Keys, Request, RestartEvent
from engine import InvalidRequestError, StepOutput
from worker.admission import EngineInputs, MalformedEntry, decode_entry, engine_inputs
from worker.delivery import REDIS_ERRORS, Entry, EntryRef, OutEvent, Ownership, RequestStream
from worker.engine_thread import EngineThread
from worker.events import InFlight, coalesce, queue_ms, wall_ms
from worker.logs import get_logger
from worker.prometheus import WorkerCounters
from worker.routing import WorkerRouting
from worker.settings import WorkerSettings
from worker.telemetry import Telemetry

log = get_logger(__name__)

# In a dead letter's message when the entry reused an id another entry owns.
DUPLICATE_NOTE = "the id belongs to another entry: no error event written to its stream"


class ServiceParts(Protocol):
    """What a ``RequestHandler`` uses of the ``WorkerService`` that owns it (the service
    implements it; naming it here keeps the two files from importing each other)."""

    settings: WorkerSettings
    engine_thread: EngineThread
    keys: Keys
    redis: Any  # redis.asyncio.Redis
    telemetry: Telemetry
    stream: RequestStream
    in_flight: dict[str, InFlight]
    counters: WorkerCounters
    routing: WorkerRouting | None

    async def retrying(self, what: str, operation: Callable[[], Awaitable[Any]]) -> Any: ...

    def drop(self, flight: InFlight, *, error: str) -> None: ...

    def release(self, flight: InFlight) -> None: ...

    def owns(self, out: StepOutput) -> InFlight | None: ...


class RequestHandler:
    """Serves the entries a ``WorkerService`` reads, and writes its engine's outputs."""

    def __init__(self, service: ServiceParts) -> None:
        self.service = service
        self.writes_idle = asyncio.Event()
        self.writes_idle.set()

    # -- intake ----------------------------------------------------------------------------------

    async def serve(self, entry: Entry) -> None:
        """Serve one delivered entry; nothing an entry holds can make this raise.

        Redis errors propagate (the caller retries later; the entry stays pending and is
        redelivered when its lease expires).
        """
        try:
            await self._serve(entry)
        except asyncio.CancelledError:
            self._forget_unstarted(entry, "cancelled")
            raise
        except Exception as exc:
            self._forget_unstarted(entry, type(exc).__name__)
            if isinstance(exc, REDIS_ERRORS):
                raise
            log.exception("unexpected error serving an entry", entry_id=entry.entry_id)
            await self._reject(entry, MalformedEntry(ErrorCode.INTERNAL, f"worker error: {exc!r}"))

    def _forget_unstarted(self, entry: Entry, error: str) -> None:
        # Admission stopped half-way: the entry stays pending and is redelivered later.
        flight = next((f for f in self.service.in_flight.values() if f.entry is entry), None)
        if flight is not None and not flight.in_engine:
            self.service.drop(flight, error=error)

    async def _serve(self, entry: Entry) -> None:
        service = self.service
        try:
            request = decode_entry(entry.fields, service.settings.limits)
        except MalformedEntry as exc:
            await self._reject(entry, exc)
            return
        if entry.times_delivered > service.settings.max_deliveries:
            message = (
                f"delivered {entry.times_delivered} times, more than max_deliveries "
                f"({service.settings.max_deliveries}): workers died while running it"
            )
            await self._reject(
                entry, MalformedEntry(ErrorCode.TOO_MANY_DELIVERIES, message, request.id)
            )
            return
        # Checked before the id is owned: an invalid entry reusing the id of a running request
        # is dead-lettered (without touching that request's stream), not dropped as a duplicate.
        now_ms = wall_ms()
        try:
            inputs = engine_inputs(
                request, service.engine_thread.engine, service.settings.limits, now_ms
            )
            await service.engine_thread.compile_grammar(inputs.sampling)  # off the loop
        except InvalidRequestError as exc:
            invalid = MalformedEntry(ErrorCode.INVALID_REQUEST, str(exc), request.id, exc.field)
            await self._reject(entry, invalid)
            return
        ownership = await service.stream.own(request.id, entry)
        if ownership is Ownership.DUPLICATE:
            if await service.stream.answer_expired(request.id):
                await self._answer_expired(request.id, entry)
                return
            log.warning("duplicate request id; not run", request_id=request.id)
            await self._ack(entry)
            return
        retry = ownership is Ownership.RETRY
        if retry and await service.stream.has_terminal_event(request.id):
            await self._ack(entry)  # finished before its worker could acknowledge
            return
        await self._admit(request, inputs, entry, now_ms, retry)

    async def _admit(
        self, request: Request, inputs: EngineInputs, entry: Entry, now_ms: int, retry: bool
    ) -> None:
        """Hand ``request`` (valid: ``inputs``) to the engine. A redelivered one (``retry``)
        writes ``restart`` first, also when it was cancelled before it ran again: the dead
        attempt's tokens are in its stream, and a caller must see that they do not count."""
        service = self.service
        flight = InFlight(
            request=request,
            entry=entry,
            trace=service.telemetry.start_request(
                request.id,
                traceparent=request.traceparent,
                enqueued_at_s=None
                if request.enqueued_at_ms is None
                else request.enqueued_at_ms / 1000,
                attributes=self._attributes(request),
            ),
            admitted_s=time.monotonic(),
            queue_ms=queue_ms(request, now_ms),
        )
        # Registered before the cancel key is read: a notice arriving meanwhile finds it.
        service.in_flight[request.id] = flight
        if await service.redis.exists(service.keys.cancel(request.id)):
            flight.cancel_requested = True
        if retry:  # the client learns the run starts over, before any of its tokens
            await self._write_restart(request.id, entry)
        if flight.cancel_requested:  # before it ran here, or a notice that came meanwhile
            await self._finish_unstarted(flight)
            return
        try:
            service.engine_thread.add_request(
                request.id,
                prompt_token_ids=inputs.prompt_token_ids,
                sampling=inputs.sampling,
                priority=inputs.priority,
                tenant=inputs.tenant,
                timeout_s=inputs.timeout_s,
            )
        except InvalidRequestError as exc:
            await self._refuse(flight, exc)
            return
        flight.in_engine = True
        flight.trace.admitted()
        if service.routing is not None:  # after the engine has it: its prefix is cached from now
            service.routing.note_served_soon(request)

    def _attributes(self, request: Request) -> dict[str, str | int | float]:
        return span_attributes(request, self.service.engine_thread.engine.config.model)

    # -- writes outside the engine -------------------------------------------------------------

    async def _ack(self, entry: Entry) -> None:
        await self.service.stream.ack([entry.entry_id], entry.stream)

    async def _write_event(
        self, request_id: str, entry: Entry, event: protocol.Event, *, ack: bool = False
    ) -> None:
        """Write one event outside the engine's steps (fenced by the claim, as they are), and
        acknowledge ``entry`` after it when ``ack``."""
        terminal = isinstance(event, protocol.TERMINAL_EVENTS)
        out = OutEvent(
            request_id, entry.entry_id, protocol.encode(event), True, terminal, entry.stream
        )
        acks = [entry.ref] if ack else []

        async def execute() -> None:
            published = await self.service.stream.publish([out], acks)
            if published.unwritten:
                raise OutOfMemoryError("an event waits for memory")

        await self.service.retrying("write event", execute)

    async def _write_restart(self, request_id: str, entry: Entry) -> None:
        # numbered by the request's own count: a hand-back keeps the entry's delivery count
        attempt, reason = await self.service.stream.next_restart(request_id)
        event = RestartEvent(attempt=attempt, worker=self.service.settings.name, reason=reason)
        log.info("restarting", request_id=request_id, attempt=attempt, reason=reason)
        await self._write_event(request_id, entry, event)

    async def _answer_expired(self, request_id: str, entry: Entry) -> None:
        """A duplicate of a request answered so long ago that its events have expired: its
        caller gets an error saying so, on the id's stream (which no worker writes to any
        more), rather than waiting for events that are gone."""
        service = self.service
        message = (f"request id {request_id!r} was answered already and its events have "
                   "expired: send the request again under a new id")  # fmt: skip
        log.warning("duplicate of an expired answer", request_id=request_id)
        error = ErrorEvent(code=ErrorCode.INVALID_REQUEST, message=message, field="id")
        out, payload = service.keys.out(request_id), protocol.encode(error)

        async def write() -> None:
            pipe = service.redis.pipeline(transaction=False)
            pipe.xadd(out, {protocol.PAYLOAD_FIELD: payload})
            pipe.expire(out, protocol.OUT_STREAM_TTL_S)
            await pipe.execute()

        await service.retrying("write event", write)
        await self._ack(entry)

    async def _reject(self, entry: Entry, exc: MalformedEntry) -> None:
        """Dead-letter ``entry``, with an error event when its id is readable and this entry
        owns it. An entry reusing another entry's id (a running or finished request) gets no
        event: that id's stream is its owner's, and its caller must not see a foreign error."""
        service = self.service
        error: ErrorEvent | None = None
        message = exc.message
        if exc.request_id is not None:
            ownership = await service.stream.own(exc.request_id, entry)
            if ownership is Ownership.DUPLICATE:
                message += f"; {DUPLICATE_NOTE}"
            elif not (
                ownership is Ownership.RETRY
                and await service.stream.has_terminal_event(exc.request_id)
            ):  # a redelivery after its error was written gets no second one
                error = ErrorEvent(code=exc.code, message=exc.message, field=exc.field)
        log.warning("entry rejected", entry_id=entry.entry_id, code=exc.code.value, error=message)
        service.counters.finished["error"] += 1
        letter = DeadLetter(
            entry_id=entry.entry_id,
            request_id=exc.request_id,
            code=exc.code,
            message=message,
            worker=service.settings.name,
            times_delivered=entry.times_delivered,
            payload=_kept_payload(entry.payload, service.settings.limits.max_entry_bytes),
        )
        if error is not None and exc.request_id is not None:
            await self._write_event(exc.request_id, entry, error)
        await service.stream.dead_letter(entry, letter)

    async def _refuse(self, flight: InFlight, exc: InvalidRequestError) -> None:
        malformed = MalformedEntry(
            ErrorCode.INVALID_REQUEST, str(exc), flight.request_id, exc.field
        )
        await self._reject(flight.entry, malformed)
        flight.trace.finish(
            finish_reason="error", prompt_tokens=0, completion_tokens=0, error="invalid_request"
        )
        self.service.release(flight)

    async def _finish_unstarted(self, flight: InFlight) -> None:
        """A request cancelled before it reached the engine: ``done`` with ``cancelled``."""
        out = StepOutput(flight.request_id, [], "", [], finished=True)
        event = flight.done_event(out, self.service.settings.name)
        event.finish_reason = protocol.FinishReason.CANCELLED
        await self._write_event(flight.request_id, flight.entry, event, ack=True)
        flight.trace.finish(finish_reason="cancelled", prompt_tokens=0, completion_tokens=0)
        self.service.counters.finished["cancelled"] += 1
        self.service.release(flight)

    # -- engine outputs --------------------------------------------------------------------------

    async def write_outputs(self, outputs: list[StepOutput]) -> None:
        """Write one or more steps' outputs in one publish, whatever request streams their
        entries came through (shards, and with routing this worker's own or a stolen one's):
        one script call per hash slot of their out streams, retried until Redis takes it."""
        service = self.service
        events, owners, finished = self._events_of(outputs)
        if not events:
            return
        acks = [flight.entry.ref for flight, _ in finished]
        unwritten = events
        lost: set[EntryRef] = set()  # entries another worker took over: nothing of theirs written

        async def execute() -> None:
            nonlocal unwritten
            published = await service.stream.publish(unwritten, acks)
            for failure in published.refused:
                log.error("redis refused an event", error=failure)
            lost.update(published.lost)
            unwritten = published.unwritten
            if unwritten:  # written in order up to here; the rest and the acks come later
                raise OutOfMemoryError(f"{len(unwritten)} events wait for memory")

        self.writes_idle.clear()
        try:
            await service.retrying("write events", execute)
        finally:
            self.writes_idle.set()
        self._settle(owners, finished, lost)

    def _events_of(
        self, outputs: list[StepOutput]
    ) -> tuple[list[OutEvent], dict[EntryRef, InFlight], list[tuple[InFlight, StepOutput]]]:
        """The encoded events of this worker's outputs, their flights by entry, and the
        flights these outputs finish."""
        events: list[OutEvent] = []
        owners: dict[EntryRef, InFlight] = {}
        finished: list[tuple[InFlight, StepOutput]] = []
        now_s = time.monotonic()
        for out in coalesce(outputs):
            flight = self.service.owns(out)
            if flight is None:
                continue  # dropped (lease lost, handed back) or not ours
            entry_id, stream = flight.entry.entry_id, flight.entry.stream
            owners[flight.entry.ref] = flight
            if flight.wants_token_event(out):
                self.service.counters.generated_tokens += len(out.new_token_ids)
                event = protocol.encode(flight.token_event(out))
                ttl_due = flight.ttl_due(now_s)
                events.append(OutEvent(flight.request_id, entry_id, event, ttl_due, stream=stream))
            if out.finished:  # the terminal event gets a full TTL after the end
                done = protocol.encode(flight.done_event(out, self.service.settings.name))
                events.append(OutEvent(flight.request_id, entry_id, done, True, True, stream))
                finished.append((flight, out))
        return events, owners, finished

    def _settle(
        self,
        owners: dict[EntryRef, InFlight],
        finished: list[tuple[InFlight, StepOutput]],
        lost: set[EntryRef],
    ) -> None:
        """After a write: drop the flights another worker took over, release the finished."""
        for ref in lost & owners.keys():
            flight = owners[ref]
            log.warning("lease lost; another worker runs it", request_id=flight.request_id)
            self.service.drop(flight, error="lease_lost")
        counters = self.service.counters
        for flight, out in finished:
            if flight.entry.ref in lost:
                continue
            reason = out.finish_reason.value if out.finish_reason else "stop"
            counters.finished[reason] += 1
            counters.prompt_tokens += out.usage.prompt_tokens if out.usage else 0
            flight.trace.finish(
                finish_reason=reason,
                prompt_tokens=out.usage.prompt_tokens if out.usage else 0,
                completion_tokens=flight.num_tokens,
            )
            self.service.release(flight)


def span_attributes(request: Request, model: str) -> dict[str, str | int | float]:
    """The request span's attributes from the request (OpenTelemetry's GenAI conventions, and
    the service's own under ``pagestream.``)."""
    attributes: dict[str, str | int | float] = {
        "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
        "pagestream.tenant": request.tenant,
        "pagestream.priority": request.priority,
    }
    if request.top_k > 0:  # 0 and -1: off
        attributes["gen_ai.request.top_k"] = request.top_k
    if request.max_tokens is not None:  # none: the engine's default, within the context
        attributes["gen_ai.request.max_tokens"] = request.max_tokens
    return attributes


def _kept_payload(payload: bytes | None, max_entry_bytes: int) -> bytes | None:
    """What a dead letter keeps of the payload: all of it, unless it was refused for its size
    (then nothing: ``{p}:dead`` holds up to 100,000 letters, and its message gives the size)."""
    return payload if payload is not None and len(payload) <= max_entry_bytes else None
