"""Batch jobs on the wire: keys, states, the job spec and status, arq's msgspec serializer.

A batch job is an arq job (function ``generate_batch``) on the queue ``{p}:batch:queue``. Its
progress lives in the hash ``{p}:batch:{job_id}`` (``state``, ``total``, ``done``, ``failed``,
...), its results in the hash ``{p}:batch:{job_id}:results`` (line index -> one JSON record,
the format of ``pagestream generate --input``), so a retried job skips the lines already done.
``{p}:batch:{job_id}:abort`` marks a job aborted even before it starts. See ``docs/batch.md``.

arq jobs are msgpack-encoded with msgspec (``serialize_job``/``deserialize_job``), never
pickled. This module imports msgspec, redis-py and arq only: no torch.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from arq.connections import ArqRedis, RedisSettings
from arq.constants import abort_jobs_ss
from arq.jobs import DeserializationError, Job, SerializationError
from redis.asyncio.connection import SSLConnection, parse_url

from clients.protocol import DEFAULT_PREFIX, PROTOCOL_VERSION

BATCH_FUNCTION = "generate_batch"
BATCH_TTL_S = 7 * 24 * 3600  # status, results and abort keys live this long after a write
STATUS_POLL_S = 0.2  # how often a waiting client re-reads a job's status
_EXCEPTION_MARK = "__exception__"


@dataclass(frozen=True)
class BatchKeys:
    """The Redis keys of batch jobs under one deployment prefix."""

    prefix: str = DEFAULT_PREFIX

    @property
    def queue(self) -> str:
        """arq's queue (a sorted set of job ids) for ``generate_batch``."""
        return f"{self.prefix}:batch:queue"

    def status(self, job_id: str) -> str:
        """Hash: state, total, done, failed, attempt, worker, output, error, times."""
        return f"{self.prefix}:batch:{job_id}"

    def results(self, job_id: str) -> str:
        """Hash: line index (0-based, decimal) -> the line's JSON result record."""
        return f"{self.prefix}:batch:{job_id}:results"

    def abort(self, job_id: str) -> str:
        """Set when the job is aborted; a job that starts later sees it and stops at once."""
        return f"{self.prefix}:batch:{job_id}:abort"


class BatchState(str, enum.Enum):
    QUEUED = "queued"  # waiting for a worker (also after a worker died: it runs again)
    RUNNING = "running"
    COMPLETE = "complete"  # every line has a record (some may be error records)
    ABORTED = "aborted"
    FAILED = "failed"  # the job itself failed (unreadable input, bad settings)

    @property
    def is_final(self) -> bool:
        return self in (BatchState.COMPLETE, BatchState.ABORTED, BatchState.FAILED)


class BatchSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What ``generate_batch`` runs: exactly one of ``prompts``, ``lines``, ``input_path``.

    ``lines`` are JSONL lines (``{"prompt" | "messages", "id"?, <sampling field>?...}``);
    ``input_path`` is such a file on the worker's filesystem. ``sampling`` holds defaults
    that each line may override. ``output_path``: also write the results there as JSONL
    (on the worker's filesystem, atomically at the end); results always go to Redis.
    """

    v: int = PROTOCOL_VERSION
    job_id: str
    prompts: list[str] | None = None
    lines: list[str] | None = None
    input_path: str | None = None
    output_path: str | None = None
    chat: bool = False
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)

    def source_count(self) -> int:
        return sum(x is not None for x in (self.prompts, self.lines, self.input_path))


class BatchStatus(msgspec.Struct, kw_only=True):
    """A job's progress, read from ``{p}:batch:{job_id}``; times are Unix milliseconds."""

    job_id: str
    state: BatchState
    total: int = 0  # lines in the input (0 until a worker has read it)
    done: int = 0  # lines with a record, error records included
    failed: int = 0  # lines whose record is an error record
    attempt: int = 0  # arq's try number: > 1 after a worker died or handed the job back
    worker: str = ""
    output_path: str = ""
    error: str = ""
    created_at_ms: int = 0
    started_at_ms: int = 0
    finished_at_ms: int = 0


@dataclass(frozen=True)
class BatchResult:
    """A job's final status and its records, in input order (partial when aborted)."""

    status: BatchStatus
    records: list[dict[str, Any]]


class BatchNotFoundError(LookupError):
    """No batch job with this id (never submitted, or expired)."""


class BatchTimeoutError(TimeoutError):
    """The job did not reach a final state in time."""


# -- arq's serializer ------------------------------------------------------------------------


def _encode_extra(value: Any) -> Any:
    # arq stores a failed job's exception as its result: keep its type name and message.
    if isinstance(value, BaseException):
        return {_EXCEPTION_MARK: type(value).__name__, "message": str(value)}
    raise NotImplementedError(f"batch jobs cannot carry {type(value).__name__} (msgspec only)")


_job_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)


class RemoteJobError(RuntimeError):
    """The exception a job raised on a worker, rebuilt from its type name and message."""


def serialize_job(data: dict[str, Any]) -> bytes:
    """arq's ``job_serializer``: msgpack via msgspec; anything msgspec cannot encode is refused."""
    try:
        return _job_encoder.encode(data)
    except (NotImplementedError, TypeError) as exc:
        raise SerializationError(str(exc)) from exc


def deserialize_job(payload: bytes) -> dict[str, Any]:
    """arq's ``job_deserializer``: msgpack only (a pickled job is refused, never unpickled)."""
    try:
        data = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise DeserializationError(f"not a msgpack job payload ({exc}); pickle is refused") from exc
    if not isinstance(data, dict):
        raise DeserializationError("a job payload must be a msgpack map")
    result = data.get("r")
    if isinstance(result, dict) and _EXCEPTION_MARK in result:
        data["r"] = RemoteJobError(f"{result[_EXCEPTION_MARK]}: {result.get('message', '')}")
    return data


# -- arq's connection ---------------------------------------------------------------------------

# What redis-py's parse_url returns -> the RedisSettings field that carries it to arq's pool.
_ARQ_FIELDS = {
    "host": "host", "port": "port", "path": "unix_socket_path", "db": "database",
    "username": "username", "password": "password", "ssl_keyfile": "ssl_keyfile",
    "ssl_certfile": "ssl_certfile", "ssl_cert_reqs": "ssl_cert_reqs",
    "ssl_ca_certs": "ssl_ca_certs", "ssl_ca_data": "ssl_ca_data",
    "ssl_check_hostname": "ssl_check_hostname", "socket_connect_timeout": "conn_timeout",
    "max_connections": "max_connections", "retry_on_timeout": "retry_on_timeout",
}  # fmt: skip


def arq_settings(redis_url: str) -> RedisSettings:
    """arq's connection settings for ``redis_url``, read the way the stream service reads it.

    redis-py's ``parse_url`` (what ``Redis.from_url`` uses) decodes ``%``-escaped user names
    and passwords and reads the TLS options of the query string (``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``); arq's own
    ``RedisSettings.from_dsn`` does neither. ``redis://``, ``rediss://`` and ``unix://`` URLs.
    arq's other settings (connection retries) keep their defaults.

    Raises ``ValueError`` for a URL option arq has no setting for (``socket_timeout``, ...).
    """
    options = parse_url(redis_url)
    connection_class = options.pop("connection_class", None)
    unknown = sorted(set(options) - set(_ARQ_FIELDS))
    if unknown:
        raise ValueError(
            f"batch jobs cannot apply {', '.join(unknown)} from the Redis URL (arq has no such "
            "setting): drop it from the URL, or run the worker with --batch-jobs 0"
        )
    fields: dict[str, Any] = {_ARQ_FIELDS[name]: value for name, value in options.items()}
    return RedisSettings(ssl=connection_class is SSLConnection, **fields)


# -- the client side -------------------------------------------------------------------------


class BatchClient:
    """Submit, watch, read and abort batch jobs (``AsyncClient`` delegates here)."""

    def __init__(self, redis: aioredis.Redis, prefix: str = DEFAULT_PREFIX) -> None:
        self.redis = redis
        self.keys = BatchKeys(prefix)
        self._arq = ArqRedis(
            connection_pool=redis.connection_pool,
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            default_queue_name=self.keys.queue,
        )

    async def submit(
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
        """Enqueue ``generate_batch``; returns the job id (submitting an id twice runs it once)."""
        spec = BatchSpec(
            job_id=job_id or uuid.uuid4().hex, prompts=prompts, lines=lines,
            input_path=input_path, output_path=output_path, chat=chat, sampling=sampling,
        )  # fmt: skip
        if spec.source_count() != 1:
            raise ValueError("give exactly one of prompts, lines or input_path")
        total = len(spec.prompts or spec.lines or [])
        status: dict[str, str] = {
            "job_id": spec.job_id, "state": BatchState.QUEUED.value, "total": str(total),
            "created_at_ms": str(_now_ms()),
        }  # fmt: skip
        status_key = self.keys.status(spec.job_id)
        async with self.redis.pipeline(transaction=True) as pipe:  # its connection released
            for name, value in status.items():  # a second submit of the same id changes nothing
                pipe.hsetnx(status_key, name, value)
            pipe.expire(status_key, BATCH_TTL_S)
            await pipe.execute()
        await self._arq.enqueue_job(
            BATCH_FUNCTION, msgspec.to_builtins(spec), _job_id=spec.job_id,
            _expires=BATCH_TTL_S,
        )  # fmt: skip
        return spec.job_id

    async def status(self, job_id: str) -> BatchStatus:
        """The job's progress now; raises ``BatchNotFoundError``."""
        raw = await _hgetall(self.redis, self.keys.status(job_id))
        if not raw:
            raise BatchNotFoundError(f"no batch job {job_id!r} (never submitted, or expired)")
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        status = msgspec.convert(fields, BatchStatus, strict=False)
        return status if status.state.is_final else await self._ended_by_arq(status)

    async def _ended_by_arq(self, status: BatchStatus) -> BatchStatus:
        # arq ends a job without running it when it was aborted before it started (again),
        # or ran out of tries: its result then says so, and the status hash does not.
        info = await Job(status.job_id, self._arq, _deserializer=deserialize_job).result_info()
        if info is None or info.success:
            return status
        aborted = bool(await self.redis.exists(self.keys.abort(status.job_id)))
        status.state = BatchState.ABORTED if aborted else BatchState.FAILED
        status.error = "" if aborted else str(info.result)
        return status

    async def wait(self, job_id: str, *, timeout_s: float | None = None) -> BatchStatus:
        """Wait until the job is complete, aborted or failed; raises ``BatchTimeoutError``."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while not (status := await self.status(job_id)).state.is_final:
            if deadline_s is not None and time.monotonic() > deadline_s:
                raise BatchTimeoutError(f"batch job {job_id}: not finished within {timeout_s:g} s")
            await asyncio.sleep(STATUS_POLL_S)
        return status

    async def result(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = None
    ) -> BatchResult:
        """The job's records in input order (after waiting for its end unless ``wait=False``)."""
        status = await (self.wait(job_id, timeout_s=timeout_s) if wait else self.status(job_id))
        raw = await _hgetall(self.redis, self.keys.results(job_id))
        ordered = sorted((int(index), record) for index, record in raw.items())
        return BatchResult(status, [json.loads(record) for _, record in ordered])

    async def abort(
        self, job_id: str, *, wait: bool = True, timeout_s: float | None = 60.0
    ) -> BatchStatus:
        """Abort a queued or running job; lines already done keep their records."""
        await self.status(job_id)  # BatchNotFoundError for an unknown id
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.abort(job_id), 1, ex=BATCH_TTL_S)
            pipe.zadd(abort_jobs_ss, {job_id: _now_ms()})  # arq cancels the running task
            await pipe.execute()
        return await (self.wait(job_id, timeout_s=timeout_s) if wait else self.status(job_id))


async def _hgetall(redis: aioredis.Redis, key: str) -> dict[bytes, bytes]:
    return await redis.hgetall(key)  # type: ignore[misc]


def _now_ms() -> int:
    return int(time.time() * 1000)
