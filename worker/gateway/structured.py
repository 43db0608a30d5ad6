"""Structured outputs asked the ways OpenAI clients ask: OpenAI's ``response_format`` and
vLLM's extra fields (``guided_json``, ``guided_regex``, ``guided_grammar``, ``guided_choice``,
or the newer ``structured_outputs`` object), on chat and completions alike.

Each becomes the protocol's ``structured_outputs`` (one of ``json_schema`` / ``json_object``
/ ``regex`` / ``grammar`` / ``choice``); asking more than one way, or for a form the engine
does not implement, is a 400 naming the field. A schema the engine cannot compile comes back
from the worker as an ``error`` event, which the gateway answers with a 400.
"""

from __future__ import annotations

import json
from typing import Any

from worker.gateway.errors import OpenAIError, unsupported
from worker.gateway.openai_types import (
    ChatRequest,
    CompletionRequest,
    ResponseFormat,
    VllmStructuredOutputs,
)

HONOURED_BACKENDS = frozenset({"auto", "guidance", "llguidance"})  # what the engine runs
GUIDED_FIELDS = {  # vLLM's name -> the protocol's
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}


def structured_outputs_of(request: CompletionRequest | ChatRequest) -> dict[str, Any] | None:
    """The protocol's ``structured_outputs`` fields that ``request`` asks for, if any."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in HONOURED_BACKENDS:
        raise unsupported(
            "guided_decoding_backend",
            f"guided_decoding_backend {backend!r} is not available: this server uses "
            "llguidance (ask for auto, guidance or llguidance, or leave it out)",
        )
    asked = {
        name: value
        for name, value in (
            ("response_format", _of_response_format(request.response_format)),
            ("structured_outputs", _of_vllm(request.structured_outputs)),
            *((name, _of_guided(name, getattr(request, name))) for name in GUIDED_FIELDS),
        )
        if value is not None
    }
    if len(asked) > 1:
        names = ", ".join(asked)
        raise OpenAIError(
            400, f"ask for one output format, not several ({names})", param=next(iter(asked))
        )
    return next(iter(asked.values()), None)


def _of_response_format(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    if response_format.type == "text":
        if response_format.json_schema is not None:
            raise OpenAIError(400, "response_format type 'text' takes no json_schema (use type "
                              "'json_schema')", param="response_format")  # fmt: skip
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type != "json_schema":
        raise unsupported(
            "response_format",
            f"response_format type {response_format.type!r} is not supported (use text, "
            "json_object or json_schema)",
        )
    spec = response_format.json_schema
    if spec is None or spec.schema is None:
        raise OpenAIError(
            400,
            "response_format json_schema needs json_schema.schema, the JSON Schema",
            param="response_format",
        )
    # strict or not, the output always follows the schema (strict is the stronger promise)
    return {"json_schema": json.dumps(spec.schema)}


def _of_vllm(value: VllmStructuredOutputs | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if value.structural_tag is not None:
        raise unsupported(
            "structured_outputs", "structured_outputs.structural_tag is not supported"
        )
    fields: dict[str, Any] = {}
    if value.json is not None:
        fields["json_schema"] = _schema_text(value.json, "structured_outputs")
    if value.json_object:
        fields["json_object"] = True
    for name in ("regex", "grammar", "choice"):
        if getattr(value, name) is not None:
            fields[name] = getattr(value, name)
    if len(fields) != 1:
        raise OpenAIError(
            400,
            "structured_outputs must set exactly one of json, json_object, regex, grammar, "
            f"choice (given: {', '.join(fields) or 'none'})",
            param="structured_outputs",
        )
    return fields


def _of_guided(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if name == "guided_json":
        value = _schema_text(value, name)
    return {GUIDED_FIELDS[name]: value}


def _schema_text(schema: Any, param: str) -> str:
    """A schema given as JSON or as its text, as text (checked to be JSON)."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as exc:
            raise OpenAIError(
                400, f"{param}: the schema is not valid JSON: {exc}", param=param
            ) from None
        return schema
    return json.dumps(schema)
