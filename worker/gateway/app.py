"""The gateway's Starlette application: the OpenAI routes, bearer auth, the body limit.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
need ``Authorization: Bearer KEY`` when keys are set), ``GET /health`` and ``GET /metrics``
(open: load balancers and Prometheus call them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from clients.aio import AsyncClient
from clients.protocol import Keys, WorkerStatus
from clients.reader import REDIS_ERRORS
from worker.gateway import errors
from worker.gateway.config import GatewaySettings
from worker.gateway.errors import OpenAIError
from worker.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from worker.gateway.models import WorkerDirectory
from worker.gateway.openai_types import ModelCard, ModelList
from worker.gateway.responses import ResponseBuilder
from worker.gateway.sse import GenerationResponse
from worker.gateway.translate import Generation, decode_chat, decode_completion

Decoder = Callable[[bytes], Generation]


class Gateway:
    """The state one gateway process shares between requests: a client and the metrics."""

    def __init__(self, settings: GatewaySettings, redis: Any = None) -> None:
        self.settings = settings
        self._redis = redis  # tests may pass one; otherwise made from redis_url at startup
        self.metrics = GatewayMetrics()
        self.client: AsyncClient | None = None
        self.directory: WorkerDirectory | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The Redis client lives in the server's event loop."""
        settings = self.settings
        self.client = AsyncClient(
            settings.redis_url, prefix=settings.prefix, redis=self._redis,
            routing=settings.routing, shards=settings.num_shards,
            cluster=settings.redis_cluster, home_shard=settings.home_shard,
        )  # fmt: skip
        self.directory = WorkerDirectory(self.client.redis, Keys(settings.prefix),
                                         settings.workers_cache_s)  # fmt: skip
        try:
            yield
        finally:
            await self.client.close()

    # -- the OpenAI routes -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, decode_completion, "completions")

    async def chat_completions(self, request: Request) -> Response:
        def decode(body: bytes) -> Generation:
            return decode_chat(body, self.settings.chat_max_tokens)

        return await self._generate(request, decode, "chat.completions")

    async def _generate(self, request: Request, decode: Decoder, endpoint: str) -> Response:
        assert self.client is not None and self.directory is not None
        try:
            self._authorize(request)
            generation = decode(await self._body(request))
            model = await self.directory.resolve(generation.model)
            if generation.is_chat:
                detected = await self.directory.chat_formats(model)
                generation = generation.with_parsers(*self.settings.parsers(detected))
            if self.settings.home_shard is not None:
                generation = self._homed(generation)
            await self.client.submit(request_id=generation.request_id,
                                     timeout_s=self.settings.timeout_s, **generation.inputs)  # fmt: skip
        except OpenAIError as exc:
            self.metrics.count(endpoint, exc.status)
            return exc.response()
        except REDIS_ERRORS as exc:
            self.metrics.count(endpoint, 503)
            return errors.redis_unreachable(exc).response()
        except ClientDisconnect:
            self.metrics.count(endpoint, 499)
            return Response(status_code=499)  # nobody reads it
        builder = ResponseBuilder(generation, model)
        observation = self.metrics.start(endpoint)
        return GenerationResponse(self.client, generation, builder, observation,
                                  self.settings.timeout_s)  # fmt: skip

    def _homed(self, generation: Generation) -> Generation:
        """The generation under an id of its kind (``chatcmpl-...``) whose keys lie on the
        gateway's home shard."""
        assert self.client is not None
        label = generation.request_id.rpartition("-")[0] + "-"
        request_id = self.client.keys.new_request_id(self.settings.home_shard, label=label)
        return dataclasses.replace(generation, request_id=request_id)

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``, and ``GET /v1/models/{model}`` (404 when no live worker has it)."""
        assert self.directory is not None
        try:
            self._authorize(request)
            cards = _model_cards(await self.directory.live())
            wanted = request.path_params.get("model")
            if wanted is not None:
                card = next((card for card in cards if card.id == wanted), None)
                if card is None:
                    raise OpenAIError(404, f"the model {wanted!r} is not served here",
                                      param="model", code="model_not_found")  # fmt: skip
                self.metrics.count("models", 200)
                return _json(card)
        except OpenAIError as exc:
            self.metrics.count("models", exc.status)
            return exc.response()
        except REDIS_ERRORS as exc:
            self.metrics.count("models", 503)
            return errors.redis_unreachable(exc).response()
        self.metrics.count("models", 200)
        return _json(ModelList(cards))

    def _authorize(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise OpenAIError(401, "missing API key: send `Authorization: Bearer KEY`",
                              code="invalid_api_key")  # fmt: skip
        given = token.strip().encode()
        # Every key is compared, in constant time each, so timing tells nothing.
        if not any([hmac.compare_digest(given, key.encode()) for key in keys]):
            raise OpenAIError(401, "incorrect API key", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes`` (declared or sent)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    # -- operations --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 when Redis answers and a worker's heartbeat is fresh, else 503 with the reason."""
        assert self.client is not None and self.directory is not None
        try:
            await self.client.redis.ping()
            models = await self.directory.models()
        except REDIS_ERRORS as exc:
            return _json({"status": "unavailable", "reason": f"redis unreachable: {exc}"}, 503)
        if not models:
            reason = f"no fresh worker heartbeat under prefix {self.settings.prefix!r}"
            return _json({"status": "unavailable", "reason": reason}, 503)
        workers = await self.directory.live()
        return _json({"status": "ok", "workers": len(workers), "models": models})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _model_cards(workers: list[WorkerStatus]) -> list[ModelCard]:
    """One card per model, created when its first live worker started."""
    started_s: dict[str, int] = {}
    for worker in workers:
        first_s = started_s.get(worker.model, worker.started_at_ms // 1000)
        started_s[worker.model] = min(first_s, worker.started_at_ms // 1000)
    return [ModelCard(id=model, created=started_s[model]) for model in sorted(started_s)]


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body has {size}+ bytes; this gateway accepts at most "
                       f"{limit} (--max-body-bytes)", code="request_too_large")  # fmt: skip


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods get OpenAI's error object too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'error')}"
    return OpenAIError(status, message, code="not_found" if status == 404 else None).response()


def create_app(settings: GatewaySettings, redis: Any = None) -> Starlette:
    """The gateway as an ASGI application (run it with uvicorn)."""
    gateway = Gateway(settings, redis)
    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=gateway.lifespan,
                    exception_handlers={HTTPException: _http_error})  # fmt: skip
    app.state.gateway = gateway
    return app
