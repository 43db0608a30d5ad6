"""The OpenAI API bodies the gateway reads and writes, as ``msgspec.Struct``s.

Requests are decoded strictly (a wrong type is a 400 naming the field). A field the gateway
does not honour is refused with 400 ``unsupported_parameter`` before decoding (the table in
``fields``), so none is ignored silently. ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos`` and ``priority`` are extensions with the
names other OpenAI-compatible servers use (the ``openai`` client sends them through
``extra_body``); ``tenant`` is pagestream's own.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# -- requests ------------------------------------------------------------------------------------

# The protocol's integers are msgpack's, 64 bits: JSON holds any integer, and one past them is
# a 400 naming its field here rather than an encoder error (a 500) when the request is written.
# (int64, not msgpack's whole range: msgspec's bounds must fit an int64.)
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


# The nested bodies refuse a field they do not declare (400 ``unsupported_parameter`` naming the
# top-level field it is in, ``errors.invalid_body``), as ``fields`` refuses a top-level one.


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """A part of a message's content. Only ``text`` parts are honoured; the other types'
    payloads are declared so that ``translate`` refuses the part by its type."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A request's message. ``name`` (any role) and an assistant message's
    ``reasoning_content`` go to the chat template, as ``tool_calls`` and ``tool_call_id`` do;
    ``refusal``, ``annotations``, ``audio`` and ``function_call`` are declared because clients
    send back the assistant messages they were given, and are refused unless empty."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    reasoning_content: str | None = None  # a thinking model's reasoning (vLLM's name)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    """``response_format.json_schema``: the schema and its name (``strict`` is always kept)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class VllmStructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` extra field (one of its forms set)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 | None = None
    best_of: Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    priority: Int64 | None = None  # lower runs first (vLLM's extension); may preempt
    tenant: str | None = None  # the protocol's tenant (page quotas); `user` is not mapped
    session: str | None = None  # pins a conversation to one worker (docs/routing.md)
    # structured outputs (worker/gateway/structured.py): OpenAI's, then vLLM's extensions
    response_format: ResponseFormat | None = None
    structured_outputs: VllmStructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[Int64]
    logprobs: Int64 | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: given to the chat template


# -- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageBody(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions shape: parallel lists, one entry per output token."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(msgspec.Struct):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionBody(msgspec.Struct, kw_only=True):
    """A completion, whole (``object="text_completion"``) or one streamed chunk of it."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody | None = None


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallBody(msgspec.Struct, omit_defaults=True):
    """A whole call (``message.tool_calls``), or a streamed piece of one (``index`` then)."""

    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None
    index: int | None = None


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = None  # a thinking model's reasoning (vLLM's name)
    tool_calls: list[ToolCallBody] | None = None


class ChatChoice(msgspec.Struct):
    message: AssistantMessage
    index: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatBody(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallBody] | None = None


class ChatChunkChoice(msgspec.Struct):
    delta: ChatDelta
    index: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageBody | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "pagestream"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
