"""``pagestream bench redis-scale`` as a command: its flags, the run and where the record
goes (``bench.redis_scale`` measures, ``bench.redis_scale_report`` makes the record)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from worker.arg_types import positive_int


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
    load.add_argument("--home-shards", action="store_true",
                      help="run the cluster a second time with each reader a client on a home "
                      "shard (reader i on shard i mod primaries: one XREAD on one primary)")  # fmt: skip
    load.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix")
    load.add_argument("--output-json", metavar="PATH",
                      help="where to write the record "
                      "(default bench/results/redis-scale-<host>.json)")  # fmt: skip
    parser.set_defaults(handler=run_command, command_prog=parser.prog)


def run_command(args: argparse.Namespace) -> int:
    """Measure both setups, print them, save the record (and its plot)."""
    from bench.records import check_writable, save
    from bench.redis_scale import ScaleSettings, run_scale
    from bench.redis_scale_report import format_ratio

    path = record_path(args.output_json)
    check_writable(path)
    settings = ScaleSettings(
        num_primaries=args.primaries, num_producers=args.producers, num_readers=args.readers,
        streams_per_producer=args.streams_per_producer, output_len=args.output_len,
        steps_per_write=args.steps_per_write, duration_s=args.duration_s, pin=args.pin,
        appendonly=args.appendonly, prefix=args.prefix, home_shards=args.home_shards,
    )  # fmt: skip
    record = run_scale(settings)
    print(format_ratio(record), flush=True)
    save(record, str(path))
    return 0


def record_path(output_json: str | None) -> Path:
    """Where the record goes."""
    from bench.records import RESULTS_DIR

    host = socket.gethostname().split(".")[0] or "local"
    return Path(output_json) if output_json else RESULTS_DIR / f"redis-scale-{host}.json"
