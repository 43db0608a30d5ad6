"""The OpenAI API bodies the gateway reads and writes, as ``msgspec.Struct``s.

Requests are decoded strictly (a wrong type is a 400 naming the field). Fields OpenAI defines
that the gateway cannot honour are declared so that setting them is refused rather than ignored
(``translate.check_supported``); other unknown fields are ignored, as OpenAI clients send
optional ones (``user``, ``metadata``, ``store``) freely. ``top_k``, ``min_p``,
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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    priority: Int64 | None = None  # lower runs first (vLLM's extension); may preempt
    tenant: str | None = None  # the protocol's tenant (page quotas); `user` is not mapped


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[Int64]
    logprobs: Int64 | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int64 | None = None


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


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


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


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
