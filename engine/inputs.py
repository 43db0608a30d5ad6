"""Turns a request's prompt (text, chat messages or token ids) into checked token ids."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from engine.errors import InvalidRequestError, wrong_type
from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

# Arguments of ``apply_chat_template`` that pagestream sets itself
_OWN_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
     "chat_template", "continue_final_message", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatTemplateOptions:
    """What a chat request gives its model's chat template besides the messages: ``tools``
    (OpenAI's function definitions, as transformers' ``apply_chat_template(tools=...)``
    takes them) and ``kwargs`` for the template itself (e.g. ``{"enable_thinking": False}``
    for Qwen3)."""

    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        tools, extra = self.tools, self.chat_template_kwargs
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise wrong_type("tools", "a list of objects", tools)
        if extra is None:
            return
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise wrong_type("chat_template_kwargs", "an object", extra)
        taken = sorted(_OWN_TEMPLATE_ARGS & extra.keys())
        if taken:
            raise InvalidRequestError(
                "chat_template_kwargs", f"{taken[0]!r} is set by pagestream, not by a request"
            )

    @property
    def is_empty(self) -> bool:
        return self.tools is None and self.chat_template_kwargs is None

    @property
    def first_field(self) -> str:
        return "tools" if self.tools is not None else "chat_template_kwargs"

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template``."""
        extra = dict(self.chat_template_kwargs or {})
        if self.tools:
            extra["tools"] = self.tools
        return extra


class PromptEncoder:
    """Tokenizes and validates prompts against the model's vocabulary and context."""

    def __init__(
        self, model_name: str, tokenizer: Any | None, vocab_size: int, max_model_len: int
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def encode(
        self,
        prompt: str | None = None,
        prompt_token_ids: Seq[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        template: ChatTemplateOptions | None = None,
    ) -> list[int]:
        """The prompt's token ids; raises ``InvalidRequestError`` naming the bad field."""
        if template is not None and messages is None and not template.is_empty:
            raise InvalidRequestError(template.first_field, "applies to messages only")
        token_ids = self._tokenize(prompt, prompt_token_ids, messages, template)
        self._check(token_ids)
        return token_ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], template: ChatTemplateOptions | None = None
    ) -> str:
        """The conversation as text, with ``template``'s tools and keyword arguments given
        to the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", f"model {self.model_name!r} has no chat template")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise InvalidRequestError("messages", "each message needs a role and a content")
            if not isinstance(message["content"], str):  # templates join content as text
                raise InvalidRequestError(
                    "messages", f"message {index}'s content must be a string (text only), "
                    f"got {type(message['content']).__name__}",
                )  # fmt: skip
        options = template or ChatTemplateOptions()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **options.kwargs()
            )
        except TemplateError as exc:  # a template that raises on what it was given
            raise InvalidRequestError(options.first_field or "messages",
                                      f"the chat template refused it: {exc}") from None  # fmt: skip
        return str(text)

    def _tokenize(
        self,
        prompt: str | None,
        prompt_token_ids: Seq[int] | None,
        messages: list[dict[str, Any]] | None,
        template: ChatTemplateOptions | None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequestError("prompt", "give exactly one of prompt, token_ids, messages")
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if self.tokenizer is None:
            raise InvalidRequestError(
                "prompt", f"model {self.model_name!r} has no tokenizer; send token_ids"
            )
        if messages is not None:
            # The template already holds the special tokens (BOS included).
            text = self.apply_chat_template(messages, template)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if not isinstance(prompt, str):
            raise wrong_type("prompt", "a string", prompt)
        return list(self.tokenizer(prompt).input_ids) if prompt else []

    def _check(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        if not _plain_ids_in(token_ids, self.vocab_size):
            # the first one that is not a token id, by name (or an int subclass: it passes)
            for index, token in enumerate(token_ids):
                if not is_int(token) or not 0 <= token < self.vocab_size:
                    raise InvalidRequestError(
                        "token_ids",
                        f"[{index}] = {token!r} is not a token id of this model "
                        f"(0..{self.vocab_size - 1})",
                    )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(token_ids)} tokens; the model context is {self.max_model_len} tokens, "
                f"so a prompt may have at most {self.max_model_len - 1}",
            )


def max_tokens_within_context(
    sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int, *, clamp: bool
) -> int:
    """The ``max_tokens`` a request runs with: what it asks for when the context has room.

    Past the context it is refused, or lowered to fit when ``clamp`` (the engine's setting)
    or the request's own ``clamp_max_tokens`` says so. No ``max_tokens``: the default, lowered
    to fit. (The prompt itself was checked: it leaves room for at least one token.)
    """
    room = max_model_len - num_prompt_tokens
    asked = sampling.max_tokens
    if asked is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if asked <= room:
        return asked
    if clamp or sampling.clamp_max_tokens:
        return room
    raise InvalidRequestError(
        "max_tokens",
        f"this model's context is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
        f"and max_tokens asks for {asked} more: lower max_tokens to at most {room}",
    )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_ids_in(token_ids: list[int], vocab_size: int) -> bool:
    """Whether every id is a plain int in ``[0, vocab_size)``, in three passes at C speed
    (types, min, max). Every prompt's ids are checked as its request is taken, which the
    throughput benches time: a Python loop over each id took 104 ms per million ids on a
    2-core CPU, these passes 42."""
    if set(map(type, token_ids)) != {int}:
        return False
    return min(token_ids) >= 0 and max(token_ids) < vocab_size


def check_request_fields(priority: object, tenant: object, timeout_s: object) -> None:
    """Scheduling fields of a request: priority, tenant, timeout."""
    if not is_int(priority):
        raise InvalidRequestError("priority", "must be an integer (lower runs first)")
    if not isinstance(tenant, str) or not tenant:
        raise InvalidRequestError("tenant", "must be a non-empty string")
    if timeout_s is None:
        return
    is_number = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    # NaN fails the comparison too.
    if not (is_number and 0 < float(timeout_s) < float("inf")):  # type: ignore[arg-type]
        raise InvalidRequestError("timeout_s", "must be a number of seconds > 0")
