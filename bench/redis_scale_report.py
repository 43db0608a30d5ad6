"""``pagestream bench redis-scale`` as a command: its flags, the run, the record (its file,
its lines of text, its plot); ``bench.redis_scale`` measures."""

from __future__ import annotations

import argparse
import socket
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.arg_types import positive_int

if TYPE_CHECKING:
    from bench.redis_scale import Placement, ScaleSettings

TARGET_RATIO = 2.5  # cluster tokens/s over single, at 3 primaries (issue 31)


def configure(parser: argparse.ArgumentParser) -> None:
    """The verb's flags."""
    from clients.protocol import DEFAULT_PREFIX

    load = parser.add_argument_group("load (process counts default from the cores)")
    load.add_argument("--primaries", type=positive_int, default=3,
                      help="primaries of the cluster (default 3)")  # fmt: skip
    load.add_argument("--producers", type=positive_int,
                      help="producer processes (workers without an engine); default half "
                      "the cores the primaries leave")  # fmt: skip
    load.add_argument("--readers", type=positive_int,
                      help="reader processes (clients); default the other half")  # fmt: skip
    load.add_argument("--streams-per-producer", type=positive_int, default=128,
                      help="requests in flight per producer (default 128); the readers keep "
                      "1.25x the producers' total in flight")  # fmt: skip
    load.add_argument("--output-len", type=positive_int, default=64,
                      help="tokens per request (default 64)")  # fmt: skip
    load.add_argument("--steps-per-write", type=positive_int, default=1,
                      help="engine steps per write, coalesced into one event per request "
                      "(default 1: one event per token, the fast-Redis case)")  # fmt: skip
    load.add_argument("--duration-s", type=float, default=20.0,
                      help="seconds each setup submits new requests (default 20)")  # fmt: skip
    load.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                      help="pin each primary to a core of its own and the load to the rest "
                      "(auto: when there are primaries + 2 cores)")  # fmt: skip
    load.add_argument("--appendonly", action="store_true",
                      help="AOF persistence on every primary (default off)")  # fmt: skip
    load.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix")
    load.add_argument("--output-json", metavar="PATH",
                      help="where to write the record "
                      "(default bench/results/redis-scale-<host>.json)")  # fmt: skip
    parser.set_defaults(handler=run_command, command_prog=parser.prog)


def run_command(args: argparse.Namespace) -> int:
    """Measure both setups, print them, save the record (and its plot)."""
    from bench.records import save
    from bench.redis_scale import ScaleSettings, run_scale

    settings = ScaleSettings(
        num_primaries=args.primaries, num_producers=args.producers, num_readers=args.readers,
        streams_per_producer=args.streams_per_producer, output_len=args.output_len,
        steps_per_write=args.steps_per_write, duration_s=args.duration_s, pin=args.pin,
        appendonly=args.appendonly, prefix=args.prefix,
    )  # fmt: skip
    record = run_scale(settings)
    print(format_ratio(record), flush=True)
    save(record, str(record_path(args.output_json)))
    return 0


def format_ratio(record: dict[str, Any]) -> str:
    """The ratio against the target."""
    targets = record["targets"]
    met = {True: "met", False: "not met", None: "n/a"}[targets["met"]]
    ratio = record["ratio"]
    return (f"cluster / single: {ratio:.2f}x (target >= {targets['ratio_at_least']}x at "
            f"{targets['at_primaries']} primaries: {met})")  # fmt: skip


def make_record(
    settings: ScaleSettings, placement: Placement, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The JSON record: machine, settings (the derived counts and cores too), rows, ratio."""
    from bench.records import machine_info, utc_now
    from bench.redis_scale import available_cores

    single, cluster = rows
    ratio = cluster["tokens_per_s"] / single["tokens_per_s"] if single["tokens_per_s"] else None
    return {
        "kind": "redis-scale",
        "created_utc": utc_now(),
        "machine": {
            **machine_info("cpu"),
            "cores_available": len(available_cores()),
            "redis_server": redis_server_version(),
        },
        "settings": {
            **asdict(settings),
            **asdict(placement),
            "load": "producers: workers without an engine, one token per request in "
            "flight per step; readers: clients submitting and reading to done",
        },
        "results": rows,
        "ratio": ratio,
        "targets": {
            "ratio_at_least": TARGET_RATIO,
            "at_primaries": 3,
            "met": None if ratio is None or settings.num_primaries != 3 else ratio >= TARGET_RATIO,
        },
    }


def format_row(row: dict[str, Any]) -> str:
    """One line of a setup's figures."""
    busy = ", ".join(f"{value:.2f}" for value in row["redis_cpu_busy_by_primary"])
    return (f"{row['redis']} ({row['primaries']} primaries): {row['tokens_per_s']:,.0f} tokens/s "
            f"({row['tokens_read']:,} read of {row['tokens_written']:,} written, "
            f"{row['requests']:,} requests), {row['redis_commands_per_s']:,.0f} Redis commands/s, "
            f"{row['redis_cpu_us_per_token']:.1f} us Redis CPU per token; primaries busy {busy}")  # fmt: skip


def redis_server_version() -> str | None:
    """``redis-server --version`` of the binary the bench starts."""
    from worker.local_stack import redis_server_binary

    try:
        done = subprocess.run([redis_server_binary(), "--version"], capture_output=True,
                              text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def plot(plt: Any, record: dict[str, Any]) -> Any:
    """Tokens/s of each setup (the ratio and the ideal N x single marked) and each
    primary's busy fraction."""
    rows = record["results"]
    names = [f"{row['redis']}\n({row['primaries']} primaries)" for row in rows]
    fig, (rate, busy) = plt.subplots(1, 2, figsize=(10, 3.5))
    rates = [row["tokens_per_s"] for row in rows]
    rate.bar(names, rates, color=["tab:gray", "tab:blue"])
    ideal = rates[0] * rows[1]["primaries"]
    rate.axhline(ideal, color="k", linestyle="--", linewidth=0.8, label="primaries x single")
    rate.axhline(rates[0] * record["targets"]["ratio_at_least"], color="tab:red",
                 linewidth=0.8, label="target")  # fmt: skip
    rate.set_ylabel("tokens / s (read end to end)")
    rate.set_title(f"cluster / single: {record['ratio']:.2f}x", fontsize=9)
    rate.legend(fontsize=8)
    for index, row in enumerate(rows):
        fractions = row["redis_cpu_busy_by_primary"]
        busy.bar([f"{row['redis']} {i}" for i in range(len(fractions))], fractions,
                 color="tab:gray" if index == 0 else "tab:blue")  # fmt: skip
    busy.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    busy.set_ylabel("primary's CPU busy (1 = a core)")
    return fig


def record_path(output_json: str | None) -> Path:
    """Where the record goes."""
    from bench.records import RESULTS_DIR

    host = socket.gethostname().split(".")[0] or "local"
    return Path(output_json) if output_json else RESULTS_DIR / f"redis-scale-{host}.json"
