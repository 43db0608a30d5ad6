"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with the status
codes OpenAI uses: 400 bad request, 401 bad or missing key, 404 unknown model or route, 413 body
too large, 500 worker failure, 503 no worker or no Redis, 504 no answer in time."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

from clients.protocol import ErrorCode

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"
# the top-level field a decode error is in: its path when it has one (a nested field's error
# names the nested field first), else the field it names (a top-level one); an unknown nested
# field is named itself
_PATH_IN_ERROR = re.compile(r"`\$\.([A-Za-z_]\w*)")
_FIELD_IN_ERROR = re.compile(r"field `([A-Za-z_]\w*)`")


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class OpenAIError(Exception):
    """An error to answer with: its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)

    def payload(self) -> bytes:
        """The JSON error object (also the data of an error event in a stream)."""
        return msgspec.json.encode(ErrorEnvelope(self.body))

    def response(self) -> Response:
        return Response(self.payload(), self.status, media_type="application/json")


def invalid_body(exc: msgspec.DecodeError) -> OpenAIError:
    """A body that is not JSON, or not the request's shape: 400 naming the field."""
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        if text.startswith("Object contains unknown field"):  # in a nested body: named, as a
            unknown = _FIELD_IN_ERROR.search(text)  # top-level one is (``fields``)
            param = None if unknown is None else unknown.group(1)
            return unsupported(param or "", f"not supported by this server: {text}")
        match = _PATH_IN_ERROR.search(text) or _FIELD_IN_ERROR.search(text)
        param = None if match is None else match.group(1)
        return OpenAIError(400, f"invalid request body: {exc}", param=param)
    return OpenAIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_parameter")


def from_worker(code: ErrorCode, message: str, field: str | None) -> OpenAIError:
    """A worker's ``error`` event: the request's fault (400) or the service's (500)."""
    if code in (ErrorCode.INVALID_REQUEST, ErrorCode.MALFORMED):
        # a prompt over a limit, or a prompt + max_tokens past the model's context
        too_long = (field == "prompt" and "tokens" in message) or (
            field == "max_tokens" and "context" in message
        )
        return OpenAIError(
            400, message, param=field, code="context_length_exceeded" if too_long else code.value
        )
    return OpenAIError(500, message, type=SERVER_ERROR, code=code.value)


def no_workers(reason: str) -> OpenAIError:
    return OpenAIError(503, reason, type=UNAVAILABLE, code="no_workers")


def redis_unreachable(exc: BaseException) -> OpenAIError:
    return OpenAIError(503, f"redis unreachable: {exc}", type=UNAVAILABLE, code="redis_error")
