"""``pagestream bench matrix``: the workload matrix against a peer, one record per card."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from commands.parser import CommandError


def configure_matrix(parser: argparse.ArgumentParser) -> None:
    from bench.matrix import DEFAULT_MODELS, PEERS
    from bench.matrix_workloads import EXTRA_WORKLOAD_NAMES, WORKLOAD_NAMES
    from commands.bench_device import finish_engine_bench

    w = parser.add_argument_group("matrix")
    w.add_argument(
        "--models",
        type=_models,
        default=DEFAULT_MODELS,
        metavar="M[,M,...]",
        help="models to run every workload on: dummy shapes by name (qwen3-0.6b), dummy:<shape> "
        f"or HF directories (default {','.join(DEFAULT_MODELS)})",
    )
    w.add_argument(
        "--workloads",
        type=_workloads,
        default=WORKLOAD_NAMES,
        metavar="all|W[,W,...]",
        help=f"which rows to run (default all): {', '.join(WORKLOAD_NAMES)}; also, only when "
        f"named: {', '.join(EXTRA_WORKLOAD_NAMES)}",
    )
    w.add_argument(
        "--compare",
        choices=PEERS,
        help="vllm: vLLM's offline API in a subprocess per model (first, on an empty GPU); "
        "self: this engine again in a subprocess (the ratio's noise floor)",
    )
    w.add_argument(
        "--resume",
        action="store_true",
        help="add to the record at --output-json (made if missing): run only the rows and sides "
        "it lacks, so the matrix can be split over several calls on one machine",
    )
    w.add_argument(
        "--scale",
        type=_scale,
        default=1.0,
        metavar="F",
        help="every prompt count and length times F (at most 1), for a quick check that the "
        "whole matrix runs; the record says so (default 1)",
    )
    w.add_argument(
        "--profile-every",
        type=_profile_every,
        default=0,
        metavar="N",
        help="profile about one step in N of every throughput row, on both sides, and record the "
        "kernel time by kind (attention, GEMM, ...): where a row's gap is. The figures are a "
        "profiled run's; the record defaults to matrix-<card>-profile.json (default 0: off)",
    )
    finish_engine_bench(parser, w, _run_bench_matrix)
    parser.set_defaults(model=None)  # --models names them; --model would be ignored


def _models(text: str) -> tuple[str, ...]:
    from bench.matrix import model_name

    names = tuple(model_name(part.strip()) for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of models")
    return names


def _scale(text: str) -> float:
    try:
        scale = float(text)
    except ValueError:
        scale = 0.0
    if not 0 < scale <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return scale


def _profile_every(text: str) -> int:
    try:
        every = int(text)
    except ValueError:
        every = -1
    if every < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps (0: off), got {text!r}")
    return every


def _workloads(text: str) -> tuple[str, ...]:
    from bench.matrix_workloads import parse_workload_names
    from engine.errors import ConfigError

    try:
        return parse_workload_names(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _run_bench_matrix(args: argparse.Namespace) -> int:
    from bench.matrix import plan_groups, run_matrix
    from bench.matrix_record import default_path, format_matrix
    from bench.matrix_workloads import select_workloads
    from bench.records import RESULTS_DIR, check_writable
    from bench.vllm_peer import PeerError, check_vllm_importable
    from engine import PagestreamError
    from engine.config_flags import engine_config_from_args

    if args.model is not None:
        raise CommandError("bench matrix runs each model of --models; leave --model out")
    # a timeout's TERM: unwind, so that the peer's process is stopped too
    previous = signal.signal(signal.SIGTERM, _interrupt)
    path = Path(args.output_json or RESULTS_DIR)
    try:
        if args.compare == "vllm":
            check_vllm_importable()  # before minutes of work, not after
        config = engine_config_from_args(args, model=args.models[0])
        workloads = select_workloads(args.workloads, seed=config.seed, scale=args.scale)
        groups = plan_groups(list(args.models), workloads, config)
        if _names_a_folder(args.output_json):  # matrix-<card>.json in that folder
            path = default_path(path, config, args.scale, args.profile_every)
        check_writable(path)  # before the first row, not after it
        record = run_matrix(
            config, groups, peer=args.compare, scale=args.scale, path=path,
            resume=args.resume, use_tqdm=not args.no_progress, profile_every=args.profile_every,
        )  # fmt: skip
    except (PagestreamError, PeerError) as exc:
        raise CommandError(str(exc)) from exc
    except KeyboardInterrupt:
        print(f"interrupted: {path} holds every finished result; --resume goes on from there",
              file=sys.stderr)  # fmt: skip
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_matrix(record))
    png = path.with_suffix(".png")
    print(f"wrote {path}" + (f" and {png}" if png.exists() else ""), file=sys.stderr)
    return 0


def _names_a_folder(output_json: str | None) -> bool:
    """Whether ``--output-json`` is a folder to write matrix-<card>.json into: unset (the
    results folder), an existing folder, or one to make, spelled with a trailing slash."""
    if output_json is None:
        return True
    return output_json.endswith(("/", os.sep)) or Path(output_json).is_dir()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
