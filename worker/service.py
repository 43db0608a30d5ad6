"""The worker service: Redis streams in, the engine in the middle, token streams out.

One asyncio loop does all Redis I/O in a few tasks, each a loop that survives Redis errors
(backing off, reconnecting): the readers (an ``XREADGROUP`` per request stream, shard or
routed, together only as many entries as there are free slots), the claimer (``XAUTOCLAIM`` of entries whose lease expired), the renewer (leases
of the entries in flight), the cancel tail (``{p}:cancels``), the heartbeat, and the writer
(each engine step's outputs in one fenced script call; on a Redis Cluster one per hash slot,
that is per shard with K > 1, sent at once). The engine steps on its own thread
(``EngineThread``). ``request_stop`` (SIGTERM) drains: stop reading, let in-flight requests
finish for ``grace_s``, hand the rest back to other workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ResponseError

from clients import protocol
from clients.connect import connect
from clients.protocol import CancelNotice, Keys, WorkerStatus
from engine import StepOutput
from worker.chat_formats import detect_chat_formats
from worker.delivery import REDIS_ERRORS, RequestStream, text
from worker.engine_thread import EngineThread, StepBatch
from worker.events import InFlight, wall_ms
from worker.logs import get_logger
from worker.loop_lag import LoopLag
from worker.prometheus import (
    MetricsServer,
    QueueReading,
    WorkerCounters,
    WorkerReading,
    queue_reading,
    render,
)
from worker.requests import RequestHandler
from worker.routing import (
    BUSY_READ_INTERVAL_S,
    SHARD_BLOCK_S,
    WorkerRouting,
    shard_yield_threshold,
)
from worker.settings import WorkerSettings
from worker.telemetry import EngineGauges, Telemetry

log = get_logger(__name__)

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
CANCEL_READ_COUNT = 100
HAND_BACK_IDLE_FACTOR = 10  # handed-back entries look idle for 10 leases: claimable at once


class WorkerService:
    """One worker: serves ``{p}:requests`` with an engine thread until ``request_stop``."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine_thread: EngineThread,
        *,
        redis: aioredis.Redis | Any = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.engine_thread = engine_thread
        self.keys = Keys(settings.prefix, settings.num_shards)
        self.redis = redis or connect(settings.redis_url, cluster=settings.redis_cluster)
        self.telemetry = telemetry or Telemetry.from_env(worker_name=settings.name)
        self.stream = RequestStream(self.redis, self.keys, settings.name)
        self.routing: WorkerRouting | None = None
        if settings.routing:
            self.routing = WorkerRouting(
                self.redis, self.keys, settings.name,
                prefix_ttl_s=settings.prefix_ttl_s, steal_after_ms=settings.steal_after_ms,
            )  # fmt: skip
        self.yield_shards_at = shard_yield_threshold(
            settings.routing, settings.yield_shards_at, settings.max_in_flight,
            engine_thread.engine.device.type,
        )  # fmt: skip
        self.in_flight: dict[str, InFlight] = {}
        self.requests = RequestHandler(self)
        self._batches: asyncio.Queue[StepBatch] = asyncio.Queue()
        self._slots_changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._started_at_ms = wall_ms()
        self._queue_depth = 0
        self.counters = WorkerCounters()
        self.loop_lag = LoopLag()
        self.queue = QueueReading()
        self._metrics: MetricsServer | None = None
        if settings.metrics_port:
            self._metrics = MetricsServer(
                self.render_metrics, settings.metrics_host, settings.metrics_port
            )

    # -- life cycle ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin draining (SIGTERM): stop reading, finish or hand back, then ``run`` returns."""
        self._stop.set()
        self._slots_changed.set()  # wake a reader waiting for a free slot

    async def run(self) -> None:
        """Serve until ``request_stop``; raises if the engine thread fails."""
        if not self.engine_thread.is_running:
            self.engine_thread.start()
        self.engine_thread.add_listener(self._batches.put_nowait)
        self.telemetry.observe_engine(self._gauges)
        assert self.engine_thread.failed is not None
        stop = asyncio.create_task(self._stop.wait())
        waiters: list[asyncio.Future[Any]] = [stop, self.engine_thread.failed]
        try:
            if self._metrics is not None:  # before Redis answers: a scrape shows it starting
                await self._metrics.start()
                log.info("serving metrics", port=self._metrics.port, host=self._metrics.host)
            # Until Redis first answers (it may be down, or refuse the password) a stop request
            # ends the worker at once: nothing is in flight yet.
            first_contact = asyncio.create_task(self._first_contact())
            await asyncio.wait([first_contact, *waiters], return_when=asyncio.FIRST_COMPLETED)
            if first_contact.done():
                await self._serve(first_contact.result(), waiters)
            else:
                await _cancel([first_contact])
                log.info("stopped before redis answered", worker=self.settings.name)
        finally:
            stop.cancel()
            if self._metrics is not None:
                await self._metrics.close()
            await self.engine_thread.stop()
            self.telemetry.shutdown()
            await self.redis.aclose()
        if self.engine_thread.failed.done():
            self.engine_thread.failed.result()  # re-raise an engine failure

    def sources(self) -> list[str]:
        """The request streams this worker reads new entries from: every shard, and with
        routing its own stream."""
        own = [] if self.routing is None else [self.routing.own]
        return [*self.keys.shards, *own]

    async def _serve(self, cancels_from: str, waiters: list[asyncio.Future[Any]]) -> None:
        # One reader per stream, each blocked on its stream alone (streams in a Redis Cluster
        # lie in different slots, which one XREADGROUP cannot span): a busy shard cannot
        # starve the others, and each reader takes its share of the free slots.
        intake = [
            *(self._spawn(self._reader(stream), intake=True) for stream in self.sources()),
            self._spawn(self._claim_once, intake=True),
        ]
        if self.routing is not None:
            intake.append(self._spawn(self._steal_once, intake=True))
        upkeep = [
            self._spawn(self._write_once),
            self._spawn(self._renew_once),
            self._spawn(self._heartbeat_once),
            asyncio.create_task(self._tail_cancels(cancels_from)),
            asyncio.create_task(self.loop_lag.probe()),
        ]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        await self._drain(intake, upkeep)

    async def _first_contact(self) -> str:
        """Make sure the groups exist; returns the cancel stream's position to tail from."""
        await self.retrying("create groups", self.ensure_groups)
        if self.routing is not None:
            await self.retrying("register routed stream", self.routing.register)
            await self.retrying("list routed streams", self.routing.streams)
        cancels_from: str = await self.retrying("read cancels", self._last_cancel_id)
        return cancels_from

    async def _drain(
        self, intake: list[asyncio.Task[None]], upkeep: list[asyncio.Task[None]]
    ) -> None:
        # Intake ends on its own (at most one blocking read later): cancelling it could cut
        # an entry's admission in half.
        _, late = await asyncio.wait(intake, timeout=self.settings.read_block_ms / 1000 + 5)
        await _cancel(list(late))
        log.info("draining", num_in_flight=len(self.in_flight), grace_s=self.settings.grace_s)
        deadline_s = time.monotonic() + self.settings.grace_s
        while self.in_flight and self.engine_thread.is_running:
            self._slots_changed.clear()
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slots_changed.wait(), remaining_s)
        await self._hand_back_all()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flush_writes(), self.settings.lease_s)
        await _cancel(upkeep)
        with contextlib.suppress(*REDIS_ERRORS):
            await self.redis.delete(self.keys.worker(self.settings.name))
        log.info("stopped", worker=self.settings.name)

    async def _hand_back_all(self) -> None:
        flights = list(self.in_flight.values())
        for flight in flights:
            self.drop(flight, error="handed_back")
        if flights:
            log.info("handing back", num_requests=len(flights))
            idle_ms = int(self.settings.lease_s * 1000 * HAND_BACK_IDLE_FACTOR)
            with contextlib.suppress(*REDIS_ERRORS):
                await self.stream.hand_back([(f.request_id, f.entry) for f in flights], idle_ms)

    async def _flush_writes(self) -> None:
        while not self._batches.empty():
            await asyncio.sleep(0.01)
        await self._writes_idle.wait()

    # -- resilience ------------------------------------------------------------------------------

    def _spawn(
        self, once: Callable[[], Awaitable[None]], *, intake: bool = False
    ) -> asyncio.Task[None]:
        return asyncio.create_task(self._forever(once, intake=intake), name=once.__name__)

    async def _forever(self, once: Callable[[], Awaitable[None]], *, intake: bool = False) -> None:
        """Run ``once`` again and again (intake: until stopping); Redis errors back off and retry."""
        while not (intake and self._stop.is_set()):
            await self.retrying(once.__name__, once)

    async def retrying(self, what: str, operation: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``operation()`` until it succeeds, backing off on Redis errors."""
        delay_s = BACKOFF_MIN_S
        while True:
            try:
                return await operation()
            except REDIS_ERRORS as exc:
                log.warning("redis unavailable; retrying", during=what, error=str(exc))
            except OutOfMemoryError as exc:  # before ResponseError, its base class
                log.warning("redis is out of memory; retrying", during=what, error=str(exc))
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    log.exception("redis refused a command", during=what)
                with contextlib.suppress(*REDIS_ERRORS, ResponseError):
                    await self.ensure_groups()  # Redis came back without our groups
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, BACKOFF_MAX_S)

    # -- intake ----------------------------------------------------------------------------------

    def free_slots(self) -> int:
        return 0 if self._stop.is_set() else self.settings.max_in_flight - len(self.in_flight)

    def read_count(self, stream: str, free: int) -> int:
        """How many new entries one read of ``stream`` may take: its share of the ``free``
        slots; with routing, one at a time from a shard. A shard's entry there is a new
        conversation (or one whose worker yielded it), and the worker that takes it keeps its
        later turns: a reader that took a whole burst at once kept the burst's conversations
        for the rest of their lives (two workers on two H100s finished 116 and 76 requests,
        and routed TTFT p50 was 1.5x the shared group's). One at a time, the fleet's blocked
        readers take turns, as a queue's prefetch of one shares work fairly."""
        if self.routing is not None and stream != self.routing.own:
            return 1
        return -(-free // len(self.sources()))  # ceil: one free slot is still read for

    async def ensure_groups(self) -> None:
        """Create each shard and its group where missing (at start, or when Redis lost them)."""
        for shard in self.keys.shards:
            await self.stream.ensure_group(shard)

    def _reader(self, stream: str) -> Callable[[], Awaitable[None]]:
        async def read_once() -> None:
            await self._read_once(stream)

        read_once.__name__ = f"read {stream}"
        return read_once

    async def _read_once(self, stream: str) -> None:
        """One read of ``stream`` (blocking, unless this worker yields it): up to its share of
        the free slots (the readers of a burst on every stream may admit a few more than that;
        the engine queues them)."""
        free = self.free_slots()
        if free <= 0:
            self._slots_changed.clear()
            if not self._stop.is_set():
                await self._slots_changed.wait()
            return
        block_ms: int | None = self.settings.read_block_ms
        if self.yields_shard(stream):  # busy: what no idle worker took, every interval
            self._slots_changed.clear()  # set when a request ends (or at stop): look again
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slots_changed.wait(), BUSY_READ_INTERVAL_S)
            if self._stop.is_set() or not self.yields_shard(stream):
                return  # idle again (or stopping): the next read blocks as usual
            block_ms = None
        elif self._may_yield(stream):  # idle: blocked, but leaving the queue now and then
            block_ms = min(self.settings.read_block_ms, int(SHARD_BLOCK_S * 1000))
        entries = await self.stream.read_new(self.read_count(stream, free), block_ms, (stream,))
        for entry in entries:
            await self.requests.serve(entry)

    def yields_shard(self, stream: str) -> bool:
        """Whether this worker leaves ``stream``'s new entries to idler workers now: it may
        (``_may_yield``), and it holds ``yield_shards_at`` requests or more."""
        return self._may_yield(stream) and len(self.in_flight) >= self.yield_shards_at

    def _may_yield(self, stream: str) -> bool:
        """``stream`` is a shard of a worker that yields shards when busy (with routing)."""
        return (
            bool(self.yield_shards_at) and self.routing is not None and stream != self.routing.own
        )

    async def _claim_once(self) -> None:
        streams = list(self.keys.shards)
        if self.routing is not None:
            streams += await self.routing.streams()
        for stream in streams:
            await self._claim_stream(stream)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.settings.claim_interval_s)

    async def _claim_stream(self, stream: str) -> None:
        cursor = "0-0"
        while self.free_slots() > 0:
            min_idle_ms = int(self.settings.lease_s * 1000)
            cursor, entries = await self.stream.claim_expired(
                self.free_slots(), min_idle_ms, cursor, stream
            )
            mine = {(f.entry.stream, f.entry.entry_id) for f in self.in_flight.values()}
            for entry in entries:
                if (entry.stream, entry.entry_id) not in mine:
                    log.info(
                        "taking over", entry_id=entry.entry_id, stream=entry.stream or "shared",
                        times=entry.times_delivered,
                    )  # fmt: skip
                    await self.requests.serve(entry)
            if cursor == "0-0":
                break

    async def _steal_once(self) -> None:
        """With routing: take other workers' routed entries that waited too long."""
        assert self.routing is not None
        await asyncio.sleep(max(self.settings.steal_after_ms, 20) / 2000)
        for entry in await self.routing.steal(self.stream, self.free_slots()):
            log.info("stealing", entry_id=entry.entry_id, stream=entry.stream)
            await self.requests.serve(entry)

    async def _renew_once(self) -> None:
        await asyncio.sleep(self.settings.renew_interval_s)
        by_stream: dict[str, dict[str, InFlight]] = {}
        for flight in self.in_flight.values():
            by_stream.setdefault(flight.entry.stream, {})[flight.entry.entry_id] = flight
        for stream, by_entry in by_stream.items():
            for entry_id in await self.stream.renew(list(by_entry), stream):
                flight = by_entry[entry_id]
                if self.in_flight.get(flight.request_id) is flight:
                    log.warning("lease lost; another worker runs it", request_id=flight.request_id)
                    self.drop(flight, error="lease_lost")

    async def _last_cancel_id(self) -> str:
        last = await self.redis.xrevrange(self.keys.cancels, count=1)
        return text(last[0][0]) if last else "0-0"

    async def _tail_cancels(self, last_id: str) -> None:
        async def once() -> None:
            nonlocal last_id
            reply = await self.redis.xread(
                {self.keys.cancels: last_id}, count=CANCEL_READ_COUNT, block=1000
            )
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = text(entry_id)
                    self._apply_cancel(fields.get(protocol.PAYLOAD_FIELD.encode(), b""))

        await self._forever(once)

    def _apply_cancel(self, payload: bytes) -> None:
        try:
            notice: CancelNotice = protocol.decode_struct(payload, CancelNotice)
        except ValueError:
            return
        flight = self.in_flight.get(notice.id)
        if flight is not None:
            flight.cancel_requested = True
            if flight.in_engine:
                self.engine_thread.abort(notice.id)

    # -- output ----------------------------------------------------------------------------------

    @property
    def _writes_idle(self) -> asyncio.Event:
        return self.requests.writes_idle

    async def _write_once(self) -> None:
        batches = [await self._batches.get()]
        while not self._batches.empty():  # Redis was slow: coalesce into one call
            batches.append(self._batches.get_nowait())
        outputs = [out for batch in batches for out in batch.outputs]
        await self.requests.write_outputs(outputs)

    def drop(self, flight: InFlight, *, error: str) -> None:
        """Forget a request without a terminal event (lease lost, handed back)."""
        if self.in_flight.pop(flight.request_id, None) is None:
            return
        if flight.in_engine:
            self.engine_thread.abort(flight.request_id)
        flight.trace.finish(
            finish_reason="cancelled", prompt_tokens=0, completion_tokens=flight.num_tokens,
            error=error,
        )  # fmt: skip
        self._slots_changed.set()

    def release(self, flight: InFlight) -> None:
        """A request's terminal event is written: free its slot."""
        if self.in_flight.get(flight.request_id) is flight:
            del self.in_flight[flight.request_id]
        self._slots_changed.set()

    def owns(self, out: StepOutput) -> InFlight | None:
        return self.in_flight.get(out.request_id)

    # -- heartbeat -------------------------------------------------------------------------------

    async def _heartbeat_once(self) -> None:
        stats = self.engine_thread.stats
        tool_call_parser, reasoning_parser = detect_chat_formats(
            self.engine_thread.engine.tokenizer
        )
        status = WorkerStatus(
            name=self.settings.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.engine_thread.engine.config.model,
            started_at_ms=self._started_at_ms,
            updated_at_ms=wall_ms(),
            num_in_flight=len(self.in_flight),
            max_in_flight=self.settings.max_in_flight,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_pages_free=stats.num_pages_free,
            num_steps=stats.num_steps,
            step_time_s=stats.step_time_s,
            loop_lag_max_ms=self.loop_lag.take_window_max_s() * 1000,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(
            self.keys.worker(self.settings.name),
            protocol.encode(status),
            ex=protocol.HEARTBEAT_TTL_S,
        )
        if self.routing is not None:
            await self.routing.register()
        for stream in self.sources():  # the queue this worker serves: every shard, its own
            pipe.xlen(stream)
            pipe.xpending(stream, self.keys.group)  # commands the worker's ACL has
        replies = await pipe.execute()
        self._queue_depth = sum(int(depth) for depth in replies[1::2])
        pending = sum(int(reply["pending"]) for reply in replies[2::2])
        self.queue = queue_reading(self._queue_depth, pending)
        await asyncio.sleep(self.settings.heartbeat_interval_s)

    def render_metrics(self) -> str:
        """The Prometheus page of ``--metrics-port`` (see ``worker/prometheus.py``)."""
        return render(
            WorkerReading(
                worker=self.settings.name,
                model=self.engine_thread.engine.config.model,
                stats=self.engine_thread.stats,
                num_in_flight=len(self.in_flight),
                max_in_flight=self.settings.max_in_flight,
                queue=self.queue,
                counters=self.counters,
                loop_lag=self.loop_lag,
            )
        )

    def _gauges(self) -> EngineGauges:
        stats = self.engine_thread.stats
        return EngineGauges(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_pages_used=stats.num_pages_used,
            num_pages_free=stats.num_pages_free,
            prefix_hit_rate=stats.prefix_hit_rate,
            num_preemptions=stats.num_preemptions,
            queue_depth=self._queue_depth,
            num_swapped=stats.num_swapped,
            spec_acceptance_rate=stats.acceptance_rate,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            num_device_hit_tokens=stats.num_device_hit_tokens,
            num_host_hit_tokens=stats.num_host_hit_tokens,
            num_deferred_admissions=stats.num_deferred_admissions,
            num_offloaded_pages=stats.num_offloaded_pages,
            num_offload_evictions=stats.num_offload_evictions,
        )


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
