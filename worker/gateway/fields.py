"""Which request fields the gateway honours: one explicit table per endpoint.

A top-level field outside its endpoint's table is refused with 400 ``unsupported_parameter``
naming it, whatever OpenAI or another server means by it; a field sent as ``null`` counts as
not sent. Nothing is ignored silently. Some fields in the tables are honoured for some values
only (``echo``, ``suffix``, ``logit_bias``, ``functions``, ``guided_decoding_backend``):
``translate`` refuses the others the same way.

To honour a new field: declare it in ``openai_types``, map it in ``translate``, and add its
name here (``COMMON_FIELDS`` when both endpoints take it).
"""

from __future__ import annotations

import msgspec

from worker.gateway.errors import unsupported

COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "best_of", "stream", "stream_options",
    "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
    # extensions, named as other OpenAI-compatible servers name them
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "priority", "tenant",
    "session",
    # structured outputs (structured.py): OpenAI's, then vLLM's
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
    "guided_choice", "guided_decoding_backend",
})  # fmt: skip

HONOURED_FIELDS: dict[str, frozenset[str]] = {
    "completion": COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"},
    "chat": COMMON_FIELDS | {
        "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "chat_template_kwargs",
    },
}  # fmt: skip

_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])


def check_fields(kind: str, body: bytes) -> None:
    """Refuse the first top-level field of ``body`` that a ``kind`` request does not honour
    (``OpenAIError``, 400). A body that is not a JSON object is left to the typed decoder,
    which says what is wrong with it."""
    try:
        fields = _top_level.decode(body)
    except msgspec.DecodeError:
        return
    honoured = HONOURED_FIELDS[kind]
    for name, raw in fields.items():
        if name not in honoured and bytes(raw).strip() != b"null":
            raise unsupported(name, f"`{name}` is not supported by this server")
