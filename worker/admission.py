"""From a stream entry to engine inputs: decode, check against the limits, tokenize.

Every way an entry can be wrong ends in an exception that names the problem: ``MalformedEntry``
when the entry is not a decodable request (with the request id when one can be read), and the
engine's ``InvalidRequestError`` (its ``field`` names the culprit) when a decoded request asks
for something this worker refuses.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import msgspec

from clients import protocol
from clients.protocol import ErrorCode, Request
from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.inputs import (
    ChatTemplateOptions,
    check_request_fields,
    max_tokens_within_context,
)
from engine.sampling_params import DEFAULT_MAX_TOKENS
from engine.structured import StructuredOutputs
from worker.settings import RequestLimits

_FIELD_IN_ERROR = re.compile(r"`\$\.([A-Za-z_]\w*)|field `([A-Za-z_]\w*)`")


class MalformedEntry(Exception):
    """A request entry that cannot be served as sent."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.field = field


@dataclass(frozen=True)
class EngineInputs:
    """Keyword arguments of ``EngineThread.add_request`` for one admitted request."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    tenant: str
    timeout_s: float | None  # None = no deadline


def decode_entry(fields: dict[bytes, bytes], limits: RequestLimits) -> Request:
    """The ``Request`` in a stream entry's fields; raises ``MalformedEntry``."""
    payload = fields.get(protocol.PAYLOAD_FIELD.encode())
    if payload is None:
        names = ", ".join(repr(name)[1:] for name in list(fields)[:5]) or "none"
        raise MalformedEntry(
            ErrorCode.MALFORMED,
            f"entry has no {protocol.PAYLOAD_FIELD!r} field (fields: {names})",
        )
    if len(payload) > limits.max_entry_bytes:
        raise MalformedEntry(
            ErrorCode.MALFORMED,
            f"payload is {len(payload)} bytes; this worker accepts at most "
            f"{limits.max_entry_bytes}",
            protocol.peek_request_id(payload),  # the id alone: nothing else is decoded
        )
    return _decode_payload(payload)


def _decode_payload(payload: bytes) -> Request:
    try:
        request = protocol.decode_request(payload)
    except msgspec.ValidationError as exc:  # a msgpack map, but not a valid request
        field = _field_of(str(exc))
        raise MalformedEntry(
            ErrorCode.INVALID_REQUEST,
            f"{field}: {exc}" if field else str(exc),
            protocol.peek_request_id(payload),
            field,
        ) from exc
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedEntry(
            ErrorCode.MALFORMED,
            f"payload is not a msgpack request: {exc}",
            protocol.peek_request_id(payload),  # e.g. invalid UTF-8 in a field after the id
        ) from exc
    if not protocol.is_valid_request_id(request.id):
        raise MalformedEntry(
            ErrorCode.INVALID_REQUEST,
            f"id: must be 1..{protocol.MAX_REQUEST_ID_CHARS} printable characters",
            field="id",
        )
    if request.v != protocol.PROTOCOL_VERSION:
        raise MalformedEntry(
            ErrorCode.INVALID_REQUEST,
            f"v: schema version {request.v} is not supported (this worker speaks "
            f"{protocol.PROTOCOL_VERSION})",
            request.id,
            "v",
        )
    if request.session is not None and not protocol.is_valid_request_id(request.session):
        raise MalformedEntry(  # it names a Redis key, as an id does
            ErrorCode.INVALID_REQUEST,
            f"session: must be 1..{protocol.MAX_REQUEST_ID_CHARS} printable characters",
            request.id,
            "session",
        )
    return request


def _field_of(message: str) -> str | None:
    match = _FIELD_IN_ERROR.search(message)
    return None if match is None else match.group(1) or match.group(2)


def engine_inputs(
    request: Request, engine: LLMEngine, limits: RequestLimits, now_ms: int
) -> EngineInputs:
    """Check ``request`` against ``limits`` and the model; raises ``InvalidRequestError``."""
    sampling = SamplingParams(
        **{name: getattr(request, name) for name in protocol.SAMPLING_FIELDS},
        structured=structured_of(request.structured_outputs),
    )
    sampling = _within_limit(sampling, limits.max_output_tokens, engine.config.clamp_max_tokens)
    messages = None
    if request.messages is not None:
        messages = [msgspec.structs.asdict(m) for m in request.messages]
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    template = ChatTemplateOptions(request.tools, request.chat_template_kwargs)
    token_ids = engine.encode_prompt(request.prompt, request.token_ids, messages, template)
    if limits.max_prompt_tokens is not None and len(token_ids) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            "prompt",
            f"has {len(token_ids)} tokens; this worker accepts at most {limits.max_prompt_tokens}",
        )
    # What the engine checks again when the request is added, checked here too: a worker
    # validates an entry before it owns the id (see ``RequestHandler``).
    max_tokens_within_context(
        sampling, len(token_ids), engine.max_model_len, clamp=engine.config.clamp_max_tokens
    )
    timeout_s = _timeout_s(request.deadline_ms, now_ms)
    check_request_fields(request.priority, request.tenant, timeout_s)
    return EngineInputs(
        prompt_token_ids=token_ids,
        sampling=sampling,
        priority=request.priority,
        tenant=request.tenant,
        timeout_s=timeout_s,
    )


def structured_of(wire: protocol.StructuredOutputs | None) -> StructuredOutputs | None:
    """The engine's ``StructuredOutputs`` of a request's ``structured_outputs``."""
    if wire is None:
        return None
    return StructuredOutputs(**msgspec.structs.asdict(wire))


def _within_limit(sampling: SamplingParams, limit: int | None, clamp: bool) -> SamplingParams:
    """``sampling`` with a ``max_tokens`` within this worker's ``limit``: one above it is
    refused, or lowered when clamping is asked for (as the engine does at the context); none
    is the default, lowered to the limit."""
    asked = sampling.max_tokens
    if limit is None or (asked or DEFAULT_MAX_TOKENS) <= limit:
        return sampling
    if asked is None:
        return dataclasses.replace(sampling.with_max_tokens(limit), clamp_max_tokens=True)
    if clamp or sampling.clamp_max_tokens:
        return sampling.with_max_tokens(limit)
    raise InvalidRequestError("max_tokens", f"{asked} is above this worker's limit of {limit}")


def _timeout_s(deadline_ms: int | None, now_ms: int) -> float | None:
    # A deadline already past leaves a token of time: the engine then ends it as `timeout`.
    if deadline_ms is None:
        return None
    return max(deadline_ms - now_ms, 1) / 1000.0
