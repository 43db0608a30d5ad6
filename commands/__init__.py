"""``pagestream``: the console script, one subcommand per task (one module each in this
package; ``parser`` holds the machinery they share).

Each subcommand is registered by one ``_register_*`` function with its name and a one-line
help. Its flags are added only when that subcommand is chosen (``LazyParser``) and its handler
imports the engine only when it runs, so ``pagestream --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from commands.parser import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    CommandError,
    Handler,
    LazyParser,
    Subparsers,
    redis_failure,
)


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


def build_parser() -> LazyParser:
    parser = LazyParser(prog=PROG, description="LLM inference engine and worker service.")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=LazyParser
    )
    subparsers.required = True
    for register in _registrars():
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
    from commands import generate

    generate.add_arguments(parser)
    parser.set_defaults(handler=generate.run, command_prog=parser.prog)


def _registrars() -> tuple[Callable[[Subparsers], None], ...]:
    # Each module registers its own subcommands; none of them imports torch at this point.
    from commands import batch, bench, gateway, service, up

    return (
        up.register,
        _register_generate,
        service.register,
        gateway.register,
        batch.register,
        bench.register,
    )
