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
    subcommand's flags (which may need the engine's modules) are added when it parses.
    """

    def __init__(self, *args: Any, configure: Configure | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure = configure

    def _ensure_configured(self) -> None:
        configure, self._configure = self._configure, None
        if configure is not None:
            configure(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._ensure_configured()
        return super().parse_known_args(args, namespace)

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


# -- bench ---------------------------------------------------------------------------------


def _register_bench(subparsers: Subparsers) -> None:
    subparsers.add_parser(
        "bench",
        help="benchmarks of the engine (throughput)",
        description="Benchmarks of the engine; each writes a JSON record of its results.",
        configure=_configure_bench,
    )


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(
        title="benchmarks", dest="benchmark", metavar="BENCHMARK", parser_class=LazyParser
    )
    kinds.required = True
    kinds.add_parser(
        "throughput",
        help="offline throughput on random token-id prompts (no Redis)",
        description="Run random token-id prompts through the engine at once; report "
        "tokens/s and TTFT, and write a JSON record.",
        configure=_configure_bench_throughput,
    )


def _configure_bench_throughput(parser: argparse.ArgumentParser) -> None:
    from engine.config import add_engine_args

    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=_positive_int, default=256, help="default 256")
    w.add_argument(
        "--input-len",
        type=_int_range,
        default=(100, 1024),
        metavar="MIN-MAX",
        help="prompt lengths in tokens, drawn uniformly from MIN..MAX (default 100-1024)",
    )
    w.add_argument(
        "--output-len",
        type=_int_range,
        default=(100, 1024),
        metavar="MIN-MAX",
        help="output lengths in tokens, drawn uniformly; EOS is ignored (default 100-1024)",
    )
    w.add_argument(
        "--output-json",
        metavar="PATH",
        help="where to write the JSON record "
        "(default bench/results/throughput-<model>-<device>-<UTC time>.json)",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)  # its --seed also seeds the random prompts
    parser.set_defaults(handler=_run_bench_throughput, command_prog=parser.prog)


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine import LLMEngine, PagestreamError
    from engine.benchmark import (
        ThroughputWorkload,
        default_record_path,
        format_results,
        run_throughput,
        write_record,
    )
    from engine.config import engine_config_from_args

    try:
        workload = ThroughputWorkload(args.num_prompts, args.input_len, args.output_len, args.seed)
        engine = LLMEngine(engine_config_from_args(args))
        record = run_throughput(engine, workload, use_tqdm=not args.no_progress)
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    path = Path(args.output_json) if args.output_json else default_record_path(record)
    write_record(record, path)
    print(format_results(record["results"]))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_range(text: str) -> tuple[int, int]:
    """``"100-1024"`` -> (100, 1024); a single number N is the range N-N."""
    low, _, high = text.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


REGISTRARS: tuple[Callable[[Subparsers], None], ...] = (_register_generate, _register_bench)
