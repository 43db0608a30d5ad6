"""One line of a JSONL request file, and the record that answers it.

``pagestream generate --input`` and batch jobs (``worker/batch.py``) read the same format: a
JSON object with ``prompt`` or ``messages``, an optional ``id``, and any ``SamplingParams``
field overriding the defaults (``structured_outputs``, an object, for ``structured``; ``n``
and ``best_of`` for several samples, answered with ``choices``). ``messages`` may come with
``tools`` and ``chat_template_kwargs`` for the chat template. A line that cannot be run becomes an error record that names
the field; the others still run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams
from engine.errors import wrong_type
from engine.inputs import ChatTemplateOptions
from engine.structured import StructuredOutputs
from worker.defaults import with_default_max_tokens

# The sampling fields of a JSON line: SamplingParams' own, but its ``structured`` is given as
# ``structured_outputs`` (the name of the Redis request field, and vLLM's)
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"structured"} | {
    "structured_outputs"
}
REQUEST_FIELDS = frozenset({"id", "prompt", "messages"})
TEMPLATE_FIELDS = frozenset({"tools", "chat_template_kwargs"})  # with messages only

Request = dict[str, Any]  # keyword arguments of LLMEngine.encode_prompt


@dataclass
class BatchItem:
    """One input line: a request ready to run, or the error that rejected it."""

    line_no: int
    id: Any
    request: Request | None = None
    sampling: SamplingParams | None = None
    error: InvalidRequestError | None = None


def chat_request(prompt: str) -> Request:
    """A plain prompt as one user message (the model's chat template applies)."""
    return {"messages": [{"role": "user", "content": prompt}]}


def parse_line(line_no: int, line: str, defaults: dict[str, Any], *, chat: bool) -> BatchItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchItem(line_no, line_no, error=InvalidRequestError("line", f"not JSON: {exc}"))
    if not isinstance(obj, dict):
        return BatchItem(line_no, line_no, error=InvalidRequestError("line", "not an object"))
    item = BatchItem(line_no, obj.get("id", line_no))
    try:
        item.request = _request_of(obj, chat)
        item.sampling = _sampling_of(obj, defaults)
    except InvalidRequestError as exc:
        item.error = exc
    return item


def _request_of(obj: dict[str, Any], chat: bool) -> Request:
    unknown = sorted(obj.keys() - REQUEST_FIELDS - SAMPLING_FIELDS - TEMPLATE_FIELDS)
    if unknown:
        raise InvalidRequestError(
            unknown[0], "unknown field; expected id, prompt or messages, or a sampling setting"
        )
    if ("prompt" in obj) == ("messages" in obj):
        raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
    if "messages" in obj:
        template = ChatTemplateOptions(obj.get("tools"), obj.get("chat_template_kwargs"))
        return {"messages": obj["messages"], "template": template}
    given = sorted(TEMPLATE_FIELDS & obj.keys())
    if given:
        raise InvalidRequestError(given[0], "applies to messages only")
    if not isinstance(obj["prompt"], str):
        raise wrong_type("prompt", "a string", obj["prompt"])
    return chat_request(obj["prompt"]) if chat else {"prompt": obj["prompt"]}


def _sampling_of(obj: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    overrides = {name: value for name, value in obj.items() if name in SAMPLING_FIELDS}
    return SamplingParams(**sampling_kwargs(with_default_max_tokens({**defaults, **overrides})))


def sampling_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """JSON sampling settings as keyword arguments of ``SamplingParams``: the object under
    ``structured_outputs`` becomes a ``StructuredOutputs``."""
    if "structured_outputs" not in values:
        return values
    kwargs = {name: value for name, value in values.items() if name != "structured_outputs"}
    given = values["structured_outputs"]
    kwargs["structured"] = None if given is None else StructuredOutputs.from_dict(given)
    return kwargs


def result_record(item: BatchItem, result: RequestOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": item.id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason.value if result.finish_reason else None,
        "usage": dataclasses.asdict(result.usage) if result.usage else None,
    }
    with_logprobs = item.sampling is not None and item.sampling.logprobs is not None
    if with_logprobs:
        record["logprobs"] = _logprobs(result.logprobs)
    if item.sampling is not None and item.sampling.n > 1:
        record["choices"] = [_choice(sample, with_logprobs) for sample in result.outputs]
    return record


def _choice(sample: CompletionOutput, with_logprobs: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": sample.index,
        "text": sample.text,
        "token_ids": sample.token_ids,
        "finish_reason": sample.finish_reason.value if sample.finish_reason else None,
    }
    if with_logprobs:
        choice["logprobs"] = _logprobs(sample.logprobs)
    return choice


def _logprobs(entries: list[Any]) -> list[dict[str, Any] | None]:
    return [dataclasses.asdict(entry) if entry else None for entry in entries]


def error_record(item: BatchItem) -> dict[str, Any]:
    assert item.error is not None
    return {"id": item.id, "error": {"field": item.error.field, "message": item.error.message}}
