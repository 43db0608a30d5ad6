"""The load of ``pagestream bench redis-scale``: processes that speak the wire protocol with no
engine behind it, so that Redis, not a model, is what limits the tokens/s.

- A **producer** is a worker without an engine (``LoadWorker``): it reads requests from every
  shard (``XREADGROUP``), claims each (``OWN_SCRIPT``), checks its cancel key, and every
  "step" gives each request in flight ``steps_per_write`` tokens, written through the worker's
  own write path (``RequestHandler.write_outputs``: coalescing, ``token``/``done`` events,
  the TTL cadence, the fenced ``WRITE_SCRIPT`` per hash slot: per shard on a cluster, the acknowledgement). The next
  step starts when the write returns: an engine that is always ready, never ahead.
- A **reader** is a client (``clients.AsyncClient``): ``streams`` tasks that each submit a
  request and read its events with the client's own reader (one ``XREAD`` for every stream on
  one Redis, one per shard on a cluster) until ``done``, then submit the next, until the
  run's time is up. With ``home_shards``, reader i is a client whose ``home_shard`` is
  i mod K: its requests' keys all lie on one shard, read with one ``XREAD``.

Each process runs one asyncio loop, pinned to the generator cores when given, and reports
its counts on the run's result queue.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from clients import AsyncClient
from clients.connect import connect
from clients.protocol import DoneEvent, Keys, Request, TokenEvent
from engine import FinishReason, StepOutput, Usage
from worker.admission import decode_entry
from worker.delivery import Entry, Ownership, RequestStream
from worker.events import InFlight, queue_ms, wall_ms
from worker.prometheus import WorkerCounters
from worker.requests import RequestHandler, ServiceParts
from worker.settings import WorkerSettings
from worker.telemetry import Telemetry

READ_BLOCK_MS = 100  # a producer with nothing in flight waits this long for new entries
PROMPT_TOKEN_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # every request's prompt (the engine never sees it)
TOKEN_ID = 42
TOKEN_TEXT = " tok"  # each token's text delta: a short word, as a real vocabulary's


@dataclass(frozen=True)
class LoadSettings:
    """What every process of one run needs (pickled into each)."""

    redis_url: str
    cluster: bool
    prefix: str
    num_shards: int
    streams_per_producer: int  # requests in flight per producer (its --max-in-flight)
    streams_per_reader: int  # requests in flight per reader
    output_len: int  # tokens per request
    steps_per_write: int  # engine steps per write (>1: tokens per event, through coalescing)
    duration_s: float  # readers submit new requests for this long, then finish theirs
    cores: tuple[int, ...] = ()  # the cores the load runs on; () = not pinned
    home_shards: bool = False  # reader i's requests all on shard i mod K (a client's home_shard)


@dataclass
class RunLink:
    """How the run's parent and its processes talk: each says it is ready, all start at
    ``go``, readers stop submitting after ``duration_s``, producers stop at ``stop``."""

    ready: Any  # mp.Queue of process names
    results: Any  # mp.Queue of (role, index, counts or a traceback string)
    go: Any  # mp.Event
    stop: Any  # mp.Event

    @classmethod
    def create(cls, context: Any) -> RunLink:
        return cls(context.Queue(), context.Queue(), context.Event(), context.Event())


class LoadWorker:
    """A worker without an engine: the parts of ``WorkerService`` that ``RequestHandler``'s
    write path uses (``stream``, ``settings.name``, ``counters``, ``owns``, ``release``,
    ``drop``, ``retrying``), and an admission that claims entries as the worker does."""

    def __init__(self, load: LoadSettings, name: str) -> None:
        self.load = load
        self.settings = WorkerSettings(
            redis_url=load.redis_url, redis_cluster=load.cluster, name=name, prefix=load.prefix,
            num_shards=load.num_shards, max_in_flight=load.streams_per_producer,
        )  # fmt: skip
        self.redis = connect(load.redis_url, cluster=load.cluster)
        self.keys = Keys(load.prefix, load.num_shards)
        self.stream = RequestStream(self.redis, self.keys, name)
        self.telemetry = Telemetry(TracerProvider(), MeterProvider(), worker_name=name)
        self.in_flight: dict[str, InFlight] = {}
        self.counters = WorkerCounters()
        self.num_token_events = 0
        self._tokens_left: dict[str, int] = {}
        self._handler = RequestHandler(cast(ServiceParts, self))

    async def prepare(self) -> None:
        """Create every shard and its group (as a worker does at start)."""
        for shard in self.keys.shards:
            await self.stream.ensure_group(shard)

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Admit and step until ``stopping()`` and nothing is in flight."""
        while True:
            if not stopping():
                await self._admit_new()
            elif not self.in_flight:
                return
            if self.in_flight:
                outputs = self._step_outputs()
                self.num_token_events += len({(out.request_id, out.index) for out in outputs})
                await self._handler.write_outputs(outputs)

    async def close(self) -> None:
        await self.redis.aclose()
        self.telemetry.shutdown()

    # -- what RequestHandler uses of the service --------------------------------------------

    async def retrying(self, what: str, operation: Callable[[], Any]) -> Any:
        """No retries: a benchmark stops on the first Redis error rather than hide it."""
        return await operation()

    def owns(self, out: StepOutput) -> InFlight | None:
        return self.in_flight.get(out.request_id)

    def release(self, flight: InFlight) -> None:
        self.in_flight.pop(flight.request_id, None)
        self._tokens_left.pop(flight.request_id, None)

    def drop(self, flight: InFlight, *, error: str) -> None:
        raise RuntimeError(f"request {flight.request_id} lost its claim ({error}): not in a bench")

    # -- admission and steps -------------------------------------------------------------------

    async def _admit_new(self) -> None:
        """Read up to the free slots from every shard (each its share), and claim each entry."""
        num_free = self.settings.max_in_flight - len(self.in_flight)
        if num_free <= 0:
            return
        block_ms = None if self.in_flight else READ_BLOCK_MS
        shards = self.keys.shards
        share = -(-num_free // len(shards))
        reads = await asyncio.gather(
            *(self.stream.read_new(share, block_ms, (shard,)) for shard in shards)
        )
        await asyncio.gather(*(self._admit(entry) for entries in reads for entry in entries))

    async def _admit(self, entry: Entry) -> None:
        request = decode_entry(entry.fields, self.settings.limits)
        ownership = await self.stream.own(request.id, entry)
        if ownership is not Ownership.NEW:
            raise RuntimeError(f"request {request.id}: {ownership.value}, not new")
        enqueued_s = None if request.enqueued_at_ms is None else request.enqueued_at_ms / 1000
        flight = InFlight(
            request=request,
            entry=entry,
            trace=self.telemetry.start_request(
                request.id,
                traceparent=request.traceparent,
                enqueued_at_s=enqueued_s,
                attributes={"gen_ai.operation.name": "text_completion"},
            ),
            admitted_s=time.monotonic(),
            queue_ms=queue_ms(request, wall_ms()),
        )
        self.in_flight[request.id] = flight
        if await self.redis.exists(self.keys.cancel(request.id)):  # as the worker's admission
            flight.cancel_requested = True
        flight.in_engine = True
        flight.trace.admitted()
        self._tokens_left[request.id] = self._num_tokens(request)

    def _num_tokens(self, request: Request) -> int:
        """The tokens a request gets: its ``max_tokens`` (EOS is ignored)."""
        return request.max_tokens or self.load.output_len

    def _step_outputs(self) -> list[StepOutput]:
        """``steps_per_write`` engine steps: one token per request in flight each."""
        outputs: list[StepOutput] = []
        for _ in range(self.load.steps_per_write):
            for request_id, left in self._tokens_left.items():
                if left == 0:
                    continue
                self._tokens_left[request_id] = left - 1
                outputs.append(self._token(request_id, finished=left == 1))
        return outputs

    def _token(self, request_id: str, *, finished: bool) -> StepOutput:
        if not finished:
            return StepOutput(request_id, [TOKEN_ID], TOKEN_TEXT, [None], finished=False)
        usage = Usage(len(PROMPT_TOKEN_IDS), self._num_tokens(self.in_flight[request_id].request))
        return StepOutput(request_id, [TOKEN_ID], TOKEN_TEXT, [None], finished=True,
                          finish_reason=FinishReason.LENGTH, usage=usage)  # fmt: skip


@dataclass
class ReadTally:
    """What one reader process saw."""

    num_requests: int = 0
    num_tokens: int = 0
    num_token_events: int = 0
    num_mismatched: int = 0  # requests whose `done` counted other tokens than were read


async def read_requests(client: AsyncClient, load: LoadSettings, tally: ReadTally) -> None:
    """One stream's loop: submit, read every event to ``done``, again until time is up."""
    deadline_s = time.monotonic() + load.duration_s
    while time.monotonic() < deadline_s:
        num_tokens = 0
        async for event in client.stream(token_ids=PROMPT_TOKEN_IDS, max_tokens=load.output_len,
                                         ignore_eos=True, temperature=0.0):  # fmt: skip
            if isinstance(event, TokenEvent):
                num_tokens += len(event.token_ids)
                tally.num_token_events += 1
            elif isinstance(event, DoneEvent) and event.usage.completion_tokens != num_tokens:
                tally.num_mismatched += 1
        tally.num_requests += 1
        tally.num_tokens += num_tokens


def run_producer(load: LoadSettings, index: int, link: RunLink) -> None:
    """Process entry: one ``LoadWorker`` until ``link.stop``."""
    pin_to(load.cores)
    _report("producer", index, link, _produce(load, index, link))


def run_reader(load: LoadSettings, index: int, link: RunLink) -> None:
    """Process entry: one client with ``streams_per_reader`` streams for ``duration_s``."""
    pin_to(load.cores)
    _report("reader", index, link, _read(load, index, link))


async def _produce(load: LoadSettings, index: int, link: RunLink) -> dict[str, Any]:
    worker = LoadWorker(load, f"load-{os.getpid()}-{index}")
    try:
        await worker.prepare()
        link.ready.put(f"producer {index}")
        link.go.wait()
        start_s = time.perf_counter()
        await worker.run(link.stop.is_set)
        counters = worker.counters
        return {
            "num_requests": sum(counters.finished.values()),
            "num_tokens": counters.generated_tokens,
            "num_token_events": worker.num_token_events,
            "elapsed_s": time.perf_counter() - start_s,
        }
    finally:
        await worker.close()


async def _read(load: LoadSettings, index: int, link: RunLink) -> dict[str, Any]:
    home_shard = index % load.num_shards if load.home_shards else None
    client = AsyncClient(load.redis_url, prefix=load.prefix, shards=load.num_shards,
                         cluster=load.cluster, home_shard=home_shard)  # fmt: skip
    try:
        await client.redis.ping()  # connected (a cluster client: its slots known) before `go`
        link.ready.put(f"reader {index}")
        link.go.wait()
        start_s = time.perf_counter()
        tally = ReadTally()
        await asyncio.gather(
            *(read_requests(client, load, tally) for _ in range(load.streams_per_reader))
        )
        return {**vars(tally), "elapsed_s": time.perf_counter() - start_s}
    finally:
        await client.close()


def _report(
    role: str, index: int, link: RunLink, work: Coroutine[Any, Any, dict[str, Any]]
) -> None:
    """Run ``work`` on a fresh loop and put its counts, or the traceback, on ``link.results``."""
    try:
        link.results.put((role, index, asyncio.run(work)))
    except BaseException:
        link.results.put(("error", index, f"{role} {index}:\n{traceback.format_exc()}"))
        raise


def pin_to(cores: tuple[int, ...]) -> None:
    """Run this process on ``cores`` (nothing when empty or unsupported)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
