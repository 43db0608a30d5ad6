"""OpenAI requests to protocol requests: which fields map where, and which are refused.

``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``,
``seed``, the penalties and the extensions map to the protocol's sampling fields of the same
meaning; ``logprobs`` (completions: the number of alternatives; chat: ``logprobs`` and
``top_logprobs``) to the protocol's ``logprobs``. ``n`` other than 1, ``best_of``, ``echo``,
``suffix``, ``logit_bias``, tools and structured output are refused with a 400 naming the
field. ``priority`` (lower runs first, as vLLM's) and ``tenant`` go to the protocol's fields of
those names; ``user`` is accepted and not used (see ``_scheduling``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from worker.defaults import with_default_max_tokens
from worker.gateway.config import COMPLETIONS_MAX_TOKENS
from worker.gateway.errors import OpenAIError, invalid_body, unsupported
from worker.gateway.openai_types import ChatMessage, ChatRequest, CompletionRequest

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)


@dataclass(frozen=True)
class Generation:
    """One OpenAI request as the gateway runs it."""

    kind: str  # "completion" or "chat"
    request_id: str
    model: str | None  # as asked; None = whichever model the workers serve
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token; None = no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    # ``AsyncClient.submit`` keyword arguments: the prompt and the sampling fields
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"


def decode_completion(body: bytes) -> Generation:
    """A ``/v1/completions`` body; raises ``OpenAIError`` (400) naming the bad field."""
    request = _decode(_completion_decoder, body)
    _check_common(request)
    for name, given in (("echo", request.echo), ("suffix", request.suffix is not None)):
        if given:
            raise unsupported(name, f"`{name}` is not supported")
    if request.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise OpenAIError(400, f"logprobs must be 0..{MAX_COMPLETION_LOGPROBS}", param="logprobs")
    prompt: dict[str, Any]
    if isinstance(request.prompt, str):
        prompt = {"prompt": request.prompt}
    else:
        prompt = {"token_ids": request.prompt}
    inputs = {**prompt, **_sampling(request, default_max_tokens=COMPLETIONS_MAX_TOKENS)}
    return _generation("completion", "cmpl", request, logprobs, inputs)


def decode_chat(body: bytes, chat_max_tokens: int) -> Generation:
    """A ``/v1/chat/completions`` body; raises ``OpenAIError`` (400) naming the bad field.
    ``chat_max_tokens``: ``max_tokens`` when the request sets none."""
    request = _decode(_chat_decoder, body)
    _check_common(request)
    for name, value in (("tools", request.tools), ("functions", request.functions)):
        if value:
            raise unsupported(name, f"`{name}` (tool calling) is not supported")
    response_format = (request.response_format or {}).get("type", "text")
    if response_format != "text":
        raise unsupported(
            "response_format", f"response_format {response_format!r} is not supported"
        )
    logprobs = _chat_logprobs(request)
    sampling = _sampling(request, default_max_tokens=chat_max_tokens)
    if request.max_completion_tokens is not None:  # the newer name wins; the user's own
        sampling.update(max_tokens=request.max_completion_tokens, clamp_max_tokens=False)
    inputs = {"messages": _messages(request.messages), **sampling}
    return _generation("chat", "chatcmpl", request, logprobs, inputs)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None


def _check_common(request: CompletionRequest | ChatRequest) -> None:
    if request.n not in (None, 1):
        raise unsupported("n", f"only n=1 is supported (got n={request.n}): send n requests")
    if request.logit_bias:
        raise unsupported("logit_bias", "`logit_bias` is not supported")


def _chat_logprobs(request: ChatRequest) -> int | None:
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise OpenAIError(
            400, f"top_logprobs must be 0..{MAX_CHAT_TOP_LOGPROBS}", param="top_logprobs"
        )
    if not request.logprobs:
        if top:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return None
    return top or 0


def _messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Protocol messages: roles OpenAI knows (``developer`` as ``system``), text content."""
    if not messages:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    converted = []
    for index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if role not in CHAT_ROLES:
            raise OpenAIError(
                400, f"messages[{index}].role {message.role!r} is not a chat role", param="messages"
            )
        converted.append({"role": role, "content": _text(message, index)})
    return converted


def _text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        raise OpenAIError(400, f"messages[{index}].content is missing", param="messages")
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise unsupported(
                "messages",
                f"messages[{index}]: content parts of type {part.type!r} are not supported",
            )
        texts.append(part.text)
    return "".join(texts)


_SAMPLING_NAMES = (
    "max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
)  # fmt: skip


def _sampling(request: CompletionRequest | ChatRequest, default_max_tokens: int) -> dict[str, Any]:
    """The protocol's sampling fields that the request sets (the rest keep their defaults).

    No ``max_tokens``: ``default_max_tokens``, which the worker lowers to what the model's
    context leaves after the prompt (one that the request sets is refused past the context).
    """
    sampling = {name: getattr(request, name) for name in _SAMPLING_NAMES}
    sampling = {name: value for name, value in sampling.items() if value is not None}
    sampling = with_default_max_tokens(sampling, default_max_tokens)
    stop = request.stop
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return sampling


def _scheduling(request: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """``priority`` and ``tenant`` when the request sets them (``AsyncClient.submit``'s own
    defaults otherwise). ``user`` is not a tenant: it names an end user, while a tenant is a
    page-quota group (``--tenant-page-quotas``), and one tenant per end user would escape it."""
    scheduling: dict[str, Any] = {}
    if request.priority is not None:
        scheduling["priority"] = request.priority
    if request.tenant is not None:
        if not request.tenant:
            raise OpenAIError(400, "tenant must be a non-empty string", param="tenant")
        scheduling["tenant"] = request.tenant
    return scheduling


def _generation(
    kind: str,
    id_prefix: str,
    request: CompletionRequest | ChatRequest,
    logprobs: int | None,
    inputs: dict[str, Any],
) -> Generation:
    if logprobs is not None:
        inputs["logprobs"] = logprobs
    inputs.update(_scheduling(request))
    options = request.stream_options
    return Generation(
        kind=kind,
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        model=request.model or None,
        stream=bool(request.stream),
        include_usage=bool(request.stream and options is not None and options.include_usage),
        logprobs=logprobs,
        inputs=inputs,
    )
