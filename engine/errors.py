"""Errors a user can cause, each naming what was wrong and what to do."""

from __future__ import annotations

import json

SHOWN_VALUE_CHARS = 40  # a value quoted in an error is cut to this length


class PagestreamError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(PagestreamError, ValueError):
    """A request (or one of its sampling settings) is invalid; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def wrong_type(field: str, expected: str, value: object) -> InvalidRequestError:
    """``field: expected <expected>, got <what value is>``, e.g. ``got str "hot"``."""
    return InvalidRequestError(field, f"expected {expected}, got {describe(value)}")


def describe(value: object) -> str:
    """A value as a user sent it: its type and a short JSON rendering (``str "hot"``)."""
    if value is None:
        return "null"
    try:
        shown = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(value)
    if len(shown) > SHOWN_VALUE_CHARS:
        shown = shown[: SHOWN_VALUE_CHARS - 3] + "..."
    return f"{type(value).__name__} {shown}"


class ConfigError(PagestreamError, ValueError):
    """An engine setting, or a combination of settings, is invalid."""


class ModelLoadError(PagestreamError):
    """A model could not be found, read or built."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one the native model implements."""


class EngineDeadError(PagestreamError, RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): close it and start a new one."""
