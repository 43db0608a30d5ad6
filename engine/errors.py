"""Errors a user can cause, each naming what was wrong and what to do."""

from __future__ import annotations


class PagestreamError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(PagestreamError, ValueError):
    """A request (or one of its sampling settings) is invalid; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(PagestreamError, ValueError):
    """An engine setting, or a combination of settings, is invalid."""


class ModelLoadError(PagestreamError):
    """A model could not be found, read or built."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one the native model implements."""


class EngineDeadError(PagestreamError, RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): close it and start a new one."""
