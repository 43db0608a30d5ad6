"""``pagestream``: the console script, one subcommand per task.

Each subcommand is registered by one ``_register_*`` function with its name and a one-line
help. Its flags are added only when that subcommand is chosen (``LazyParser``) and its handler
imports the engine only when it runs, so ``pagestream --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from worker.env_flags import apply_env_defaults, resolve_exclusive

PROG = "pagestream"
EXIT_ERROR = 1  # the command failed: model not loadable, bad engine setting, ...
EXIT_USAGE = 2  # bad arguments (argparse's own code for usage errors)
EXIT_INTERRUPTED = 130

Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
Subparsers = Any  # argparse._SubParsersAction[LazyParser]; private, so not spelled out


class CommandError(Exception):
    """An error the user caused: ``main`` prints it as one line and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


def main(argv: list[str] | None = None) -> int:
    """Run the ``pagestream`` command line; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    # The chosen (sub)subcommand's configure function set its handler and its full name.
    handler: Handler = args.handler
    try:
        return handler(args)
    except CommandError as exc:
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{args.command_prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        message = redis_failure(exc, getattr(args, "redis_url", None))
        if message is None:
            raise
        print(f"{args.command_prog}: error: {message}", file=sys.stderr)
        return EXIT_ERROR


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


def build_parser() -> LazyParser:
    parser = LazyParser(prog=PROG, description="LLM inference engine and worker service.")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=LazyParser
    )
    subparsers.required = True
    for register in REGISTRARS:
        register(subparsers)
    return parser


# -- generate ------------------------------------------------------------------------------


def _register_generate(subparsers: Subparsers) -> None:
    subparsers.add_parser(
        "generate",
        help="generate text for one prompt (streamed) or a JSONL file of prompts",
        description="Generate with the offline engine: stream one prompt's text to stdout, "
        "or run every line of --input and write one JSON result per line.",
        configure=_configure_generate,
    )


def _configure_generate(parser: argparse.ArgumentParser) -> None:
    from worker import generate_cmd

    generate_cmd.add_arguments(parser)
    parser.set_defaults(handler=generate_cmd.run, command_prog=parser.prog)


def _registrars() -> tuple[Callable[[Subparsers], None], ...]:
    # Each module registers its own subcommands; none of them imports torch at this point.
    from worker import batch_cli, bench_cli, gateway_cmd, service_cli, up_cmd

    return (
        up_cmd.register,
        _register_generate,
        service_cli.register,
        gateway_cmd.register,
        batch_cli.register,
        bench_cli.register,
    )


REGISTRARS = _registrars()
