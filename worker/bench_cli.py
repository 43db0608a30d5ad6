"""``pagestream bench``: one sub-subcommand per benchmark, each writing a JSON record."""

from __future__ import annotations

import argparse
import sys

from worker.cli import CommandError, LazyParser, Subparsers
from worker.cli_types import int_range, positive_int


def register(subparsers: Subparsers) -> None:
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
    w.add_argument("--num-prompts", type=positive_int, default=256, help="default 256")
    w.add_argument(
        "--input-len",
        type=int_range,
        default=(100, 1024),
        metavar="MIN-MAX",
        help="prompt lengths in tokens, drawn uniformly from MIN..MAX (default 100-1024)",
    )
    w.add_argument(
        "--output-len",
        type=int_range,
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
