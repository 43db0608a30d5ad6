"""The live workers and the models they serve, from their heartbeats (``{p}:worker:{name}``).

A heartbeat key expires ``HEARTBEAT_TTL_S`` after the worker's last beat, so the keys that
exist are the live workers. They are read with one ``SCAN`` and one ``MGET`` at most every
``cache_s`` seconds, so a busy gateway does not scan Redis per request.

Model names are the workers' ``--model`` values (``smollm2-135m``, a hub id, a path). A request
may name one of them, or omit ``model`` to take whichever the workers serve: all workers of one
prefix read the same request stream, so one prefix should serve one model.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from clients.connect import get_many
from clients.protocol import HEARTBEAT_TTL_S, Keys, WorkerStatus, decode_struct
from worker.gateway.errors import OpenAIError, no_workers


class WorkerDirectory:
    """Reads the heartbeats of one deployment (cached for ``cache_s``)."""

    def __init__(self, redis: Any, keys: Keys, cache_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.cache_s = cache_s
        self._cached: list[WorkerStatus] = []
        self._read_at_s = float("-inf")

    async def live(self) -> list[WorkerStatus]:
        """Workers whose heartbeat is fresh; raises Redis errors."""
        now_s = time.monotonic()
        if now_s - self._read_at_s >= self.cache_s:
            self._cached = await self._read()
            self._read_at_s = now_s
        return self._cached

    async def _read(self) -> list[WorkerStatus]:
        keys = [key async for key in self.redis.scan_iter(self.keys.worker_pattern(), count=1000)]
        values = await get_many(self.redis, keys)
        oldest_ms = (time.time() - HEARTBEAT_TTL_S) * 1000
        statuses = []
        for value in values:
            if not value:
                continue  # expired between SCAN and MGET
            try:
                status: WorkerStatus = decode_struct(value, WorkerStatus)
            except msgspec.DecodeError:
                continue  # not a heartbeat of this protocol version
            if status.updated_at_ms >= oldest_ms:
                statuses.append(status)
        return statuses

    async def chat_formats(self, model: str) -> tuple[str, str]:
        """(tool-call parser, reasoning parser) a live worker of ``model`` found in its chat
        template ("" where none)."""
        for status in await self.live():
            if status.model == model:
                return status.tool_call_parser, status.reasoning_parser
        return "", ""

    async def models(self) -> list[str]:
        """The distinct models of the live workers, sorted."""
        return sorted({status.model for status in await self.live()})

    async def resolve(self, requested: str | None) -> str:
        """The model a request runs on: ``requested`` if a live worker serves it, the served
        model when ``requested`` is None; raises ``OpenAIError`` (404, or 503 with no worker)."""
        models = await self.models()
        if not models:
            raise no_workers(
                f"no worker is serving (no fresh heartbeat under prefix {self.keys.prefix!r})"
            )
        if requested is None:
            return models[0]
        if requested not in models:
            raise OpenAIError(
                404,
                f"the model {requested!r} is not served here; available: {', '.join(models)}",
                param="model",
                code="model_not_found",
            )
        return requested
