"""OpenAI requests to protocol requests: which fields map where, and which are refused.

``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``,
``seed``, ``n``, ``best_of``, the penalties and the extensions map to the protocol's sampling
fields of the same meaning; ``logprobs`` (completions: the number of alternatives; chat:
``logprobs`` and ``top_logprobs``) to the protocol's ``logprobs``; ``response_format`` and
vLLM's ``guided_*`` / ``structured_outputs`` to ``structured_outputs`` (``structured.py``).
Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` follow ``tools`` (a forced call
is a JSON-schema constraint too, so it cannot be combined with another); ``chat_template_kwargs``
goes to the chat template. ``echo``, ``suffix``, ``logit_bias`` and ``functions`` are refused
with a 400 naming the field; fields outside ``fields.HONOURED_FIELDS`` too. ``priority``
(lower runs first, as vLLM's) and ``tenant`` go to the protocol's fields of those names.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from worker.defaults import with_default_max_tokens
from worker.gateway.chat_output import ChatFormat
from worker.gateway.config import COMPLETIONS_MAX_TOKENS
from worker.gateway.errors import OpenAIError, invalid_body, unsupported
from worker.gateway.fields import check_fields
from worker.gateway.openai_types import ChatMessage, ChatRequest, CompletionRequest
from worker.gateway.structured import structured_outputs_of
from worker.gateway.tools import ToolPlan, plan_tools, template_messages_tool_calls

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
    n: int = 1  # choices in the response
    tools: ToolPlan | None = None  # chat with tools
    thinking: bool = True  # chat: False when chat_template_kwargs turned thinking off
    chat_format: ChatFormat = field(default_factory=ChatFormat)  # set by ``with_parsers``

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"

    def request_field(self, field: str | None) -> str | None:
        """The request's name for a protocol field a worker's error names: a forced tool
        call's schema is the tools' ``parameters``."""
        forced = self.tools is not None and self.tools.schema() is not None
        if forced and field is not None and field.startswith("structured_outputs"):
            return "tools"
        return field

    def with_parsers(self, tool_parser: str | None, reasoning_parser: str | None) -> Generation:
        """This chat generation reading its output with the model's parsers (see
        ``chat_output``); raises ``OpenAIError`` when it needs a parser there is none of."""
        if not self.is_chat:
            return self
        tools = None if self.tools is None else self.tools.with_parser(tool_parser)
        if tools is not None and tools.mode == "none":
            tools = None
        reasoning = reasoning_parser if self.thinking else None
        return dataclasses.replace(self, chat_format=ChatFormat(reasoning, tools))


def decode_completion(body: bytes) -> Generation:
    """A ``/v1/completions`` body; raises ``OpenAIError`` (400) naming the bad field."""
    check_fields("completion", body)
    request = _decode(_completion_decoder, body)
    _check_common(request)
    for name, given in (("echo", request.echo), ("suffix", request.suffix is not None)):
        if given:
            raise unsupported(name, f"`{name}` is not supported")
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
    check_fields("chat", body)
    request = _decode(_chat_decoder, body)
    _check_common(request)
    if request.functions:
        raise unsupported("functions", "`functions` is not supported: send `tools`")
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
    logprobs = _chat_logprobs(request)
    sampling = _sampling(request, default_max_tokens=chat_max_tokens)
    if request.max_completion_tokens is not None:  # the newer name; the user's own
        if request.max_tokens is not None and request.max_tokens != request.max_completion_tokens:
            raise OpenAIError(400, "max_tokens and max_completion_tokens differ: send one "
                              "(max_tokens is the older name)", param="max_tokens")  # fmt: skip
        sampling.update(max_tokens=request.max_completion_tokens, clamp_max_tokens=False)
    template = _template(request, plan)
    if "structured_outputs" in sampling and "structured_outputs" in template:
        raise OpenAIError(400, f"tool_choice {request.tool_choice!r} decodes the call under its "
                          "own JSON schema: it cannot be combined with another output format",
                          param="tool_choice")  # fmt: skip
    inputs = {"messages": _messages(request.messages), **sampling, **template}
    generation = _generation("chat", "chatcmpl", request, logprobs, inputs)
    thinking = (request.chat_template_kwargs or {}).get("enable_thinking") is not False
    return dataclasses.replace(generation, tools=plan, thinking=thinking)


def _template(request: ChatRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """The protocol's chat-template fields, and the schema of a forced tool call."""
    fields: dict[str, Any] = {}
    if request.chat_template_kwargs is not None:
        fields["chat_template_kwargs"] = request.chat_template_kwargs
    if plan is None:
        return fields
    if plan.template_tools is not None:
        fields["tools"] = plan.template_tools
    schema = plan.schema()
    if schema is not None:
        fields["structured_outputs"] = {"json_schema": schema}
    return fields


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None


def _check_common(request: CompletionRequest | ChatRequest) -> None:
    n, best_of = (1 if request.n is None else request.n), request.best_of
    if n < 1:
        raise OpenAIError(400, f"n must be >= 1, got {n}", param="n")
    if best_of is not None and best_of < n:
        raise OpenAIError(400, f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    if best_of is not None and best_of > n and request.stream:
        raise OpenAIError(400, "best_of > n cannot be streamed: the best samples are known "
                          "only once all have ended", param="best_of")  # fmt: skip
    if request.logit_bias:
        raise unsupported("logit_bias", "`logit_bias` is not supported")
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true",
                          param="stream_options")  # fmt: skip


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
        converted.append(_message(message, role, index))
    return converted


def _message(message: ChatMessage, role: str, index: int) -> dict[str, Any]:
    converted: dict[str, Any] = {"role": role, "content": _text(message, index)}
    if message.tool_calls:
        if role != "assistant":
            raise OpenAIError(400, f"messages[{index}]: only assistant messages carry "
                              "tool_calls", param="messages")  # fmt: skip
        converted["tool_calls"] = template_messages_tool_calls(message.tool_calls, index)
    if message.tool_call_id is not None:
        converted["tool_call_id"] = message.tool_call_id
    if message.name is not None:  # the template's to use, as vLLM hands it on
        converted["name"] = message.name
    if message.reasoning_content is not None:
        if role != "assistant":
            raise OpenAIError(400, f"messages[{index}]: only assistant messages carry "
                              "reasoning_content", param="messages")  # fmt: skip
        converted["reasoning_content"] = message.reasoning_content
    for name in ("refusal", "annotations", "audio", "function_call"):
        if getattr(message, name):  # null or empty: what a client sends back unchanged
            raise unsupported("messages", f"messages[{index}].{name} is not supported")
    return converted


def _text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None and message.tool_calls:
        return ""  # an assistant message that only called tools
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
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "n", "best_of",
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
    structured = structured_outputs_of(request)
    if structured is not None:
        sampling["structured_outputs"] = structured
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
    if request.session is not None:  # routing's pin; `user` is not taken as one silently
        if not request.session:
            raise OpenAIError(400, "session must be a non-empty string", param="session")
        scheduling["session"] = request.session
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
        n=request.n or 1,
    )
