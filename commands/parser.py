"""The parser machinery every command module uses: lazy subcommand parsers whose flags also read
``PAGESTREAM_*`` variables, and one-line messages for Redis failures."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from worker.env_flags import apply_env_defaults, resolve_exclusive
from worker.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, CommandError

PROG = "pagestream"

Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
Subparsers = Any  # argparse._SubParsersAction[LazyParser]; private, so not spelled out


class LazyParser(argparse.ArgumentParser):
    """An argument parser that adds its flags (``configure``) the first time it is used.

    The top-level help lists subcommands by name and help only, so it stays cheap; a
    subcommand's flags (which may need the engine's modules) are added when it parses. Each
    flag then also reads its ``PAGESTREAM_*`` environment variable (``worker.env_flags``).
    """

    def __init__(self, *args: Any, configure: Configure | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure = configure
        self._env_replaced: dict[str, Any] = {}

    def _ensure_configured(self) -> None:
        configure, self._configure = self._configure, None
        if configure is not None:
            configure(self)
            self._env_replaced = apply_env_defaults(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._ensure_configured()
        namespace, extras = super().parse_known_args(args, namespace)
        resolve_exclusive(self, namespace, self._env_replaced)
        return namespace, extras

    def format_help(self) -> str:
        self._ensure_configured()
        return super().format_help()


def redis_failure(exc: BaseException, redis_url: str | None) -> str | None:
    """One line for a Redis failure the user can fix: unreachable, wrong credentials, or a
    command the ACL user may not run. ``None`` for anything else (a bug keeps its traceback)."""
    try:
        from redis.exceptions import ConnectionError, NoPermissionError, TimeoutError
    except ImportError:
        return None
    where = f" at {redact_url(redis_url)}" if redis_url else ""
    if isinstance(exc, (ConnectionError, TimeoutError)):  # wrong passwords are ConnectionErrors
        return f"redis unreachable{where}: {exc}"
    if isinstance(exc, NoPermissionError):
        return f"redis refused a command{where} (ACL): {exc}"
    return None


def redact_url(url: str) -> str:
    """``url`` without its password, for messages: ``redis://user:***@host:6379/0``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc}"))


__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "PROG",
    "CommandError",
    "Configure",
    "Handler",
    "LazyParser",
    "Subparsers",
    "redact_url",
    "redis_failure",
]
