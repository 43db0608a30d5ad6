"""arq in the service's loop: ``BatchRunner`` runs arq's ``Worker`` for ``generate_batch``
(``worker.batch``) on the worker's event loop and ``EngineThread``, next to the stream service
(``serve_with_batches``). A failure of arq never stops the stream service: it is logged and arq
restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from arq import Worker
from arq.worker import func

from clients.batch import (
    BATCH_FUNCTION,
    BATCH_TTL_S,
    BatchKeys,
    arq_settings,
    deserialize_job,
    serialize_job,
)
from worker.batch import JOB_TIMEOUT_S, BatchSettings, generate_batch
from worker.delivery import REDIS_ERRORS
from worker.engine_thread import EngineThread
from worker.logs import get_logger
from worker.service import WorkerService

log = get_logger(__name__)
RESTART_BACKOFF_S = 1.0  # after a lost connection; doubles up to MAX_RESTART_BACKOFF_S
MAX_RESTART_BACKOFF_S = 30.0


class BatchRunner:
    """arq's ``Worker`` for ``generate_batch`` on the service's loop and ``EngineThread``."""

    def __init__(self, settings: BatchSettings, engine_thread: EngineThread) -> None:
        self.settings = settings
        self.engine_thread = engine_thread
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        """Stop taking jobs; running jobs are cancelled and go back on the queue."""
        self._stop.set()

    async def run(self) -> None:
        """Run arq until ``request_stop``. A failure never escapes: the stream service goes on.

        A lost connection restarts arq after a backoff that doubles from ``RESTART_BACKOFF_S``
        to ``MAX_RESTART_BACKOFF_S``. Any other failure (Redis refusing a command the worker's
        ACL user lacks, a bug) is logged at once, with its traceback, at error level, and arq
        restarts every ``failure_retry_s``: fixing the ACL recovers batch jobs, no restart.
        """
        backoff_s = RESTART_BACKOFF_S
        while not self._stop.is_set():
            started_s = time.monotonic()
            try:
                await self._run_once()
                continue  # it returns once stopped
            except REDIS_ERRORS as exc:
                if time.monotonic() - started_s > MAX_RESTART_BACKOFF_S:
                    backoff_s = RESTART_BACKOFF_S  # it had been running: a new outage
                log.warning("batch worker lost redis; restarting", error=str(exc),
                            retry_in_s=backoff_s)  # fmt: skip
                delay_s, backoff_s = backoff_s, min(2 * backoff_s, MAX_RESTART_BACKOFF_S)
            except Exception as exc:
                delay_s = self.settings.failure_retry_s
                log.exception("batch worker failed; batch jobs wait until it restarts",
                              error=str(exc), retry_in_s=delay_s)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay_s)

    def make_worker(self) -> Worker:
        """arq's worker: msgspec serialization, aborts allowed, the service owns signals."""
        keys = BatchKeys(self.settings.prefix)
        function = func(generate_batch, name=BATCH_FUNCTION, max_tries=self.settings.max_tries)
        return Worker(
            [function], queue_name=keys.queue,
            redis_settings=arq_settings(self.settings.redis_url),
            handle_signals=False, allow_abort_jobs=True, max_jobs=self.settings.max_jobs,
            job_timeout=JOB_TIMEOUT_S, keep_result=BATCH_TTL_S, poll_delay=self.settings.poll_delay_s,
            job_serializer=serialize_job, job_deserializer=deserialize_job,
            ctx={"engine_thread": self.engine_thread, "batch_settings": self.settings},
        )  # fmt: skip

    async def _run_once(self) -> None:
        worker = self.make_worker()
        main = asyncio.create_task(worker.async_run())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([main, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            await _close(worker)
            with contextlib.suppress(asyncio.CancelledError):
                await main  # raises what stopped arq, if anything did


async def _close(worker: Worker) -> None:
    """Cancel running jobs (arq re-queues them) and close arq's connections, even when Redis
    is gone or refuses arq's goodbye: what stopped arq is the error to report, not this."""
    try:
        await worker.close()
    except Exception as exc:
        log.warning("batch worker closed uncleanly", error=str(exc))
        pool = worker.pool
        if pool is not None:
            await pool.aclose()


async def serve_with_batches(service: WorkerService, runner: BatchRunner | None) -> None:
    """Run the stream service and (unless ``None``) batch jobs on one loop and engine thread.

    Call ``service.request_stop()`` and ``runner.request_stop()`` to drain (SIGTERM).
    """
    if not service.engine_thread.is_running:
        service.engine_thread.start()
    batches = asyncio.create_task(runner.run()) if runner is not None else None
    try:
        await service.run()
    finally:
        if runner is not None and batches is not None:
            runner.request_stop()
            await batches
