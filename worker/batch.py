"""Batch jobs: ``generate_batch``, the arq function a worker runs on its engine (arq itself runs
in the service's loop: ``worker.batch_runner``).

A job (``clients.batch.BatchSpec``) is a JSONL file or a list of prompts; each line becomes
one request on the shared ``EngineThread`` (``generate``), at most ``max_lines_in_flight`` at
once, and its record (the format of ``pagestream generate --input``) is stored once, by line
index, in ``{p}:batch:{job_id}:results`` together with the ``done``/``failed`` counters (one
Lua script, so a line is never counted twice). A retried job skips the lines already stored.

Worker death: the job renews arq's in-progress key as a lease (``lease_s``); when its worker
dies the key expires and another worker's arq runs the job again (``max_tries``). SIGTERM
cancels running jobs, which arq puts back on the queue at once. Abort: arq cancels the task
(``allow_abort_jobs``); the ``{p}:batch:{job_id}:abort`` key stops a job that starts later.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from arq import Retry
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix

from clients.batch import (
    BATCH_TTL_S,
    BatchKeys,
    BatchSpec,
    BatchState,
    arq_settings,
    deserialize_job,
    serialize_job,
)
from engine import InvalidRequestError, RequestOutput, SamplingParams
from worker.arg_types import non_negative_int, positive_int
from worker.defaults import DEFAULT_TEMPERATURE
from worker.delivery import REDIS_ERRORS
from worker.engine_thread import EngineStoppedError, EngineThread
from worker.jsonl_lines import BatchItem, error_record, parse_line, result_record, sampling_kwargs
from worker.logs import get_logger
from worker.settings import WorkerSettings

__all__ = ["BatchSettings", "deserialize_job", "generate_batch", "serialize_job"]

log = get_logger(__name__)

DEFAULT_MAX_JOBS = 2
DEFAULT_LINES_IN_FLIGHT = 256
DEFAULT_MAX_TRIES = 5
JOB_TIMEOUT_S = 7 * 24 * 3600  # arq's own limit; worker death is caught by the lease instead
FAILURE_RETRY_S = 30.0  # after anything else (a command the ACL refuses, a bug)

# Store a line's record once and count it; a line stored already (by an earlier attempt)
# changes nothing. KEYS: results, status. ARGV: index, record, is_error, ttl_s.
_RECORD_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'done', 1)
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[2], 'failed', 1) end
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


class BatchInputError(ValueError):
    """The job cannot run at all (unreadable input, invalid sampling defaults): no retry."""


@dataclass(frozen=True)
class BatchSettings:
    """How one worker runs batch jobs; ``max_jobs=0`` turns them off."""

    redis_url: str
    worker_name: str
    prefix: str = BatchKeys().prefix
    lease_s: float = 30.0
    max_jobs: int = DEFAULT_MAX_JOBS
    max_lines_in_flight: int = DEFAULT_LINES_IN_FLIGHT
    max_tries: int = DEFAULT_MAX_TRIES
    poll_delay_s: float = 0.5
    failure_retry_s: float = FAILURE_RETRY_S

    def __post_init__(self) -> None:
        if self.max_jobs:
            arq_settings(self.redis_url)  # ValueError now, not in the runner's retry loop

    @classmethod
    def from_args(cls, args: argparse.Namespace, worker: WorkerSettings) -> BatchSettings:
        """From ``pagestream worker``'s flags; Redis, name and lease follow the service's."""
        return cls(
            redis_url=worker.redis_url, worker_name=worker.name, prefix=worker.prefix,
            lease_s=worker.lease_s, max_jobs=args.batch_jobs,
            max_lines_in_flight=args.batch_lines_in_flight,
        )  # fmt: skip


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """``pagestream worker``'s batch flags."""
    g = parser.add_argument_group("batch jobs (arq)")
    g.add_argument("--batch-jobs", type=non_negative_int, default=DEFAULT_MAX_JOBS,
                   help=f"batch jobs run at once; 0 = none (default {DEFAULT_MAX_JOBS})")  # fmt: skip
    g.add_argument("--batch-lines-in-flight", type=positive_int, default=DEFAULT_LINES_IN_FLIGHT,
                   help=f"lines of one job in the engine at once (default {DEFAULT_LINES_IN_FLIGHT})")  # fmt: skip


# -- the job -----------------------------------------------------------------------------------


async def generate_batch(ctx: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """arq function: run every line of ``spec`` (a ``BatchSpec``); returns the final counters."""
    try:
        job_spec = msgspec.convert(spec, BatchSpec)
    except msgspec.ValidationError as exc:
        raise BatchInputError(f"invalid batch spec: {exc}") from exc
    return await BatchJob(ctx, job_spec).run()


class BatchJob:
    """One attempt at one job, on the ``EngineThread`` in ``ctx``."""

    def __init__(self, ctx: dict[str, Any], spec: BatchSpec) -> None:
        self.spec = spec
        self.settings: BatchSettings = ctx["batch_settings"]
        self.engine_thread: EngineThread = ctx["engine_thread"]
        self.redis: ArqRedis = ctx["redis"]
        self.job_id: str = ctx["job_id"]
        self.attempt: int = ctx["job_try"]
        self.keys = BatchKeys(self.settings.prefix)
        self._record_line = self.redis.register_script(_RECORD_LINE)

    async def run(self) -> dict[str, Any]:
        if await self.redis.exists(self.keys.abort(self.job_id)):
            return await self._finish(BatchState.ABORTED)
        await self._set(
            state=BatchState.RUNNING.value, attempt=self.attempt, worker=self.settings.worker_name,
            started_at_ms=_now_ms(), output_path=self.spec.output_path or "",
        )  # fmt: skip
        log.info("batch job starts", job_id=self.job_id, attempt=self.attempt)
        try:
            async with self._lease():
                return await self._run_all()
        except asyncio.CancelledError:
            aborted = await asyncio.shield(self.redis.exists(self.keys.abort(self.job_id)))
            # Aborted: final. Otherwise (SIGTERM) arq puts the job back on the queue.
            await asyncio.shield(
                self._set(state=(BatchState.ABORTED if aborted else BatchState.QUEUED).value)
            )
            raise
        except BatchInputError as exc:
            await self._finish(BatchState.FAILED, error=str(exc))
            raise
        except EngineStoppedError as exc:
            await self._set(state=BatchState.QUEUED.value)
            raise Retry(defer=self.settings.lease_s) from exc

    async def _run_all(self) -> dict[str, Any]:
        items = await asyncio.to_thread(self._read_items)
        await self._set(total=len(items))
        keys = await self.redis.hkeys(self.keys.results(self.job_id))  # type: ignore[misc]
        stored = {int(i) for i in keys}
        pending = iter([i for i in range(len(items)) if i not in stored])
        num_runners = min(self.settings.max_lines_in_flight, len(items) - len(stored))
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(num_runners):
                    group.create_task(self._run_lines(pending, items))
        except BaseExceptionGroup as failed:  # the group wraps what its runners raised
            stopped = failed.subgroup(EngineStoppedError)
            if stopped is None:
                raise
            raise _first_leaf(stopped) from failed  # ``run`` puts the job back on the queue
        if self.spec.output_path:
            await self._write_output(self.spec.output_path)
        return await self._finish(BatchState.COMPLETE)

    def _read_items(self) -> list[BatchItem]:
        # no max_tokens here: parse_line gives a line that sets none the default, within the context
        defaults = {"temperature": DEFAULT_TEMPERATURE, **self.spec.sampling}
        try:
            SamplingParams(**sampling_kwargs(defaults))
        except (InvalidRequestError, TypeError) as exc:
            raise BatchInputError(f"invalid sampling defaults: {exc}") from exc
        chat = self.spec.chat
        lines = [line for line in self._lines() if line.strip()]
        return [parse_line(no, line, defaults, chat=chat) for no, line in enumerate(lines, 1)]

    def _lines(self) -> list[str]:
        if self.spec.prompts is not None:
            return [json.dumps({"prompt": prompt}) for prompt in self.spec.prompts]
        if self.spec.lines is not None:
            return self.spec.lines
        assert self.spec.input_path is not None
        try:
            return Path(self.spec.input_path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BatchInputError(f"cannot read {self.spec.input_path}: {exc}") from exc

    async def _run_lines(self, pending: Any, items: list[BatchItem]) -> None:
        for index in pending:  # shared by every runner: each line is taken once
            record = await self._generate(index, items[index])
            await self._record_line(
                keys=[self.keys.results(self.job_id), self.keys.status(self.job_id)],
                args=[index, json.dumps(record, ensure_ascii=False), int("error" in record),
                      BATCH_TTL_S],
            )  # fmt: skip

    async def _generate(self, index: int, item: BatchItem) -> dict[str, Any]:
        if item.error is not None or item.request is None:
            return error_record(item)
        result = RequestOutput(f"batch:{self.job_id}:{index}", None, [])
        start_s = time.perf_counter()
        try:
            async for out in self.engine_thread.generate(
                result.request_id, **item.request, sampling=item.sampling
            ):
                result.add_step(out, time.perf_counter() - start_s)
        except InvalidRequestError as exc:
            item.error = exc
            return error_record(item)
        return result_record(item, result)

    async def _write_output(self, path: str) -> None:
        raw = await self.redis.hgetall(self.keys.results(self.job_id))  # type: ignore[misc]
        records = [record.decode() for _, record in sorted((int(i), r) for i, r in raw.items())]
        await asyncio.to_thread(_write_atomically, Path(path), records)

    @contextlib.asynccontextmanager
    async def _lease(self) -> AsyncIterator[None]:
        renewer = asyncio.create_task(self._renew_forever())
        try:
            yield
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def _renew_forever(self) -> None:
        lease_ms = int(self.settings.lease_s * 1000)
        while True:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.redis.pexpire(in_progress_key_prefix + self.job_id, lease_ms)
                await self.redis.expire(self.keys.status(self.job_id), BATCH_TTL_S)
            await asyncio.sleep(self.settings.lease_s / 3)

    async def _set(self, **fields: Any) -> None:
        await self.redis.hset(self.keys.status(self.job_id), mapping=fields)  # type: ignore[misc]

    async def _finish(self, state: BatchState, *, error: str = "") -> dict[str, Any]:
        await self._set(state=state.value, error=error, finished_at_ms=_now_ms())
        status_key = self.keys.status(self.job_id)
        counters = await self.redis.hmget(status_key, ["total", "done", "failed"])  # type: ignore[misc]
        total, done, failed = (int(value or 0) for value in counters)
        log.info("batch job ends", job_id=self.job_id, state=state.value, done=done, total=total)
        return {"state": state.value, "total": total, "done": done, "failed": failed}


def _write_atomically(path: Path, records: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text("".join(record + "\n" for record in records), encoding="utf-8")
    os.replace(partial, path)  # readers see the whole file or none of it


def _now_ms() -> int:
    return int(time.time() * 1000)


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first exception of ``group`` that is not a group itself."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
