"""The parser machinery every command module uses: lazy subcommand parsers whose flags also read
``PAGESTREAM_*`` variables, and one-line messages for Redis failures."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from worker.env_flags import apply_env_defaults, resolve_exclusive
from worker.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, CommandError

PROG = "pagestream"
NOT_A_CLUSTER = "Cluster mode is not enabled on this node"  # redis-py's words

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
        # No abbreviations: `--max-token 5` must be an error, not `--max-tokens 5`
        kwargs.setdefault("allow_abbrev", False)
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
        if extras and not self._has_subcommands():
            # Said here, the error shows this command's usage; left to the top-level parser,
            # `pagestream submit hi --bogus` would print the usage of `pagestream` itself.
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        resolve_exclusive(self, namespace, self._env_replaced)
        return namespace, extras

    def _has_subcommands(self) -> bool:
        return any(isinstance(a, argparse._SubParsersAction) for a in self._actions)

    def format_help(self) -> str:
        self._ensure_configured()
        return super().format_help()


def invocation(cwd: Path | None = None) -> tuple[str, str]:
    """How a user in ``cwd`` runs this ``pagestream`` and its Python, for messages that print
    commands to paste: the bare names where the PATH finds these very programs, else their
    paths (``.venv/bin/pagestream`` from a checkout whose virtualenv is not activated)."""
    cwd = Path.cwd() if cwd is None else cwd
    python = Path(sys.executable)
    script = python.parent / PROG
    pagestream = (
        _as_typed(script, cwd) if script.exists() else f"{_as_typed(python, cwd)} -m commands"
    )
    return pagestream, _as_typed(python, cwd)


def _as_typed(program: Path, cwd: Path) -> str:
    found = shutil.which(program.name)
    # absolute(), not resolve(): a virtualenv's python is a link to the base interpreter
    if found is not None and Path(found).absolute() == program.absolute():
        return program.name
    if program.is_relative_to(cwd):
        return str(program.relative_to(cwd))
    return str(program)


def redis_failure(exc: BaseException, redis_url: str | None) -> str | None:
    """One line for a Redis failure the user can fix: unreachable, wrong credentials, a
    command the ACL user may not run, or a Redis Cluster named without ``--redis-cluster on``
    (or a standalone Redis with it). ``None`` for anything else (a bug keeps its traceback)."""
    try:
        from redis.exceptions import (
            ConnectionError,
            NoPermissionError,
            RedisClusterException,
            TimeoutError,
        )

        from clients.connect import CLUSTER_ENV
    except ImportError:
        return None
    where = f" at {redact_url(redis_url)}" if redis_url else ""
    if isinstance(exc, (ConnectionError, TimeoutError)):  # wrong passwords are ConnectionErrors
        return f"redis unreachable{where}: {exc}"
    if isinstance(exc, NoPermissionError):
        return f"redis refused a command{where} (ACL): {exc}"
    if answered_moved(exc):
        return (
            f"the Redis{where} is a node of a Redis Cluster: pass --redis-cluster on "
            f"(or {CLUSTER_ENV}=1)"
        )
    if isinstance(exc, RedisClusterException) and NOT_A_CLUSTER in str(exc):
        return f"the Redis{where} is not a Redis Cluster: leave --redis-cluster off"
    return None


def naming_the_flag(message: str, args: argparse.Namespace) -> str:
    """A settings check's message with its field named as the user set it: ``max_seqs must be
    >= 1`` -> ``--max-seqs (PAGESTREAM_MAX_SEQS) must be >= 1``, when a flag of the command
    sets ``max_seqs``; any other message unchanged."""
    match = re.match(r"(\w+) (must|cannot|needs) ", message)
    if match is None or not hasattr(args, match[1]):
        return message
    field = match[1]
    flag = f"--{field.replace('_', '-')} (PAGESTREAM_{field.upper()})"
    return flag + message[len(field) :]


def answered_moved(exc: BaseException) -> bool:
    """Whether a Redis Cluster's node answered a plain client's command on another node's slot
    (``MOVED``), alone or inside a pipeline's error (``Command # 1 (...) of pipeline caused
    error: ('MOVED ...',)``)."""
    from redis.exceptions import ResponseError

    return (
        isinstance(exc, ResponseError)
        and re.search(r"(^|\('|\(\")MOVED \d+ ", str(exc)) is not None
    )


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
    "invocation",
    "redact_url",
    "redis_failure",
]
