"""The engine on a thread of its own, handing each step's outputs to the asyncio loop at once.

``LLMEngine.add_request`` and ``abort`` are thread-safe (an inbox), so the loop adds and
cancels requests directly; only ``step`` runs on the engine thread. Every step's outputs go
back to the loop in one ``call_soon_threadsafe`` call, as a ``StepBatch``, to each listener in
turn: the Redis service writes a batch in one call. In-process callers (batch jobs) use
:meth:`EngineThread.generate`, an async iterator over one request's outputs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine import EngineStats, LLMEngine, SamplingParams, StepOutput
from engine.memory import gc_frozen

logger = logging.getLogger("pagestream.worker.engine")

IDLE_WAIT_S = 0.5  # an idle engine thread re-checks its inbox this often (adds also wake it)


@dataclass(frozen=True)
class StepBatch:
    """The outputs of one engine step, and the engine's counters right after it."""

    outputs: list[StepOutput]
    stats: EngineStats


BatchListener = Callable[[StepBatch], None]


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (stopped, or its step raised)."""


class EngineThread:
    """Steps ``engine`` on a daemon thread while it has requests; outputs come back in batches.

    Use it from one asyncio loop: ``start()`` there, then ``add_request``/``abort`` and
    listeners; ``await stop()`` at the end. If a step raises, the thread ends and ``failed``
    (an ``asyncio.Future``) holds the exception.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats: EngineStats = engine.stats()
        self._listeners: list[BatchListener] = [self._route]
        self._streams: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed: asyncio.Future[None] | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start stepping; call from the loop that will receive the outputs."""
        self._loop = asyncio.get_running_loop()
        self.failed = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="pagestream-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop after the current step (requests still in the engine are left as they are)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_listener(self, listener: BatchListener) -> None:
        """Call ``listener`` on the loop with every step's batch (in step order)."""
        self._listeners.append(listener)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, **request: Any) -> None:
        """Validate and queue a request (``request``: ``LLMEngine.add_request``'s keyword
        arguments); raises ``InvalidRequestError`` or ``EngineStoppedError``."""
        if not self.is_running:
            raise EngineStoppedError("the engine thread is not running")
        self.engine.add_request(request_id, **request)
        self._wake.set()

    async def compile_grammar(self, sampling: SamplingParams | None) -> None:
        """Make ``sampling``'s structured-output matchers (one per sample) on a thread, so
        that ``add_request`` takes them ready and neither the loop nor the engine's thread
        waits for a compile (about 1 ms each; the tokenizer's one-time grammar view, ~1 s).
        Raises ``InvalidRequestError`` for a grammar the engine cannot compile."""
        if sampling is not None and sampling.structured is not None:
            await asyncio.to_thread(
                self.engine.grammars.build_ahead, sampling.structured, sampling.num_samples
            )

    def abort(self, request_id: str) -> None:
        """Cancel a request; its final output (``cancelled``) comes with the next step."""
        self.engine.abort(request_id)
        self._wake.set()

    async def generate(self, request_id: str, **request: Any) -> AsyncIterator[StepOutput]:
        """Run one request (``request`` as for ``add_request``); yields its step outputs, the
        last one with ``finished`` set.

        Raises ``InvalidRequestError`` before the first output if the request is refused.
        Leaving the loop early (``break``, task cancelled) aborts the request.
        """
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self.compile_grammar(request.get("sampling"))
            self.add_request(request_id, **request)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineStoppedError("the engine failed") from item
                finished = item.finished
                yield item
        finally:
            del self._streams[request_id]
            if not finished and self.is_running:
                self.abort(request_id)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        """Step while there is work. A step's outputs go to the loop while the *next* step's
        forward runs on the GPU: the loop's work on them (events, Redis writes) then takes
        the GIL while this thread waits for the GPU, not while it prepares the next step
        (the GPU would wait). That costs each token one step's host time in latency, never
        a gap between tokens; an idle engine hands its last outputs over at once."""
        loop = self._loop
        assert loop is not None
        pending: list[StepBatch] = []

        def hand_over() -> None:
            if pending:
                loop.call_soon_threadsafe(self._deliver, pending.pop())

        try:
            self.engine.prepare_thread()  # before any request waits on this thread
            with gc_frozen():  # the engine's objects out of every full collection's walk
                self._step_until_stopped(hand_over, pending)
        except BaseException as exc:
            logger.exception("engine step failed; the engine thread stops")
            hand_over()
            loop.call_soon_threadsafe(self._fail, exc)
        else:
            hand_over()
            loop.call_soon_threadsafe(self._set_stopped)

    def _step_until_stopped(self, hand_over: Callable[[], None], pending: list[StepBatch]) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_unfinished_requests():
                hand_over()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            outputs = self.engine.step(while_gpu_busy=hand_over)
            hand_over()  # the step ran no forward (only swaps or finished requests)
            pending.append(StepBatch(outputs, self.engine.stats()))

    def _deliver(self, batch: StepBatch) -> None:
        self.stats = batch.stats
        for listener in self._listeners:
            try:
                listener(batch)
            except Exception:  # one listener's bug must not starve the others
                logger.exception("step listener failed")

    def _route(self, batch: StepBatch) -> None:
        for out in batch.outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail(self, exc: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(exc)
        if self.failed is not None and not self.failed.done():
            self.failed.set_exception(exc)

    def _set_stopped(self) -> None:
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(None)
