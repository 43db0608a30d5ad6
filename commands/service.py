"""``pagestream worker``, ``submit``, ``cancel`` and ``health``: the service and its client verbs.

Only ``worker`` loads the engine (and torch); the client verbs need Redis and msgspec only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time
from typing import Any

from commands.parser import EXIT_ERROR, EXIT_USAGE, CommandError, Subparsers, naming_the_flag
from worker.arg_types import (
    LOG_LEVELS,
    add_client_sampling_args,
    client_sampling,
    non_negative_int,
    on_off,
    positive_int,
)
from worker.defaults import with_default_max_tokens
from worker.settings import (
    DEFAULT_GRACE_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_METRICS_HOST,
    DEFAULT_PREFIX_TTL_S,
    DEFAULT_REDIS_URL,
    DEFAULT_STEAL_AFTER_MS,
)


def register(subparsers: Subparsers) -> None:
    """Add the service's subcommands to the ``pagestream`` parser."""
    verbs = (
        ("worker", "serve requests from Redis with the engine", _configure_worker),
        ("submit", "send one prompt to the workers and print its tokens as they arrive", _configure_submit),
        ("cancel", "cancel a request by id", _configure_cancel),
        ("health", "exit 0 when a worker's heartbeat is fresh (container health check)", _configure_health),
    )  # fmt: skip
    for name, help_text, configure in verbs:
        subparsers.add_parser(name, help=help_text, description=help_text, configure=configure)


def _add_redis_args(parser: argparse.ArgumentParser, *, shards: bool = False) -> None:
    from clients.protocol import DEFAULT_PREFIX

    parser.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help=f"redis:// or rediss:// URL, password included if any (default {DEFAULT_REDIS_URL})",
    )
    parser.add_argument(
        "--redis-cluster",
        type=on_off,
        default=False,
        metavar="on/off",
        help="--redis-url names a node of a Redis Cluster (default off)",
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix of the deployment")
    if not shards:
        return
    parser.add_argument(
        "--shards",
        type=positive_int,
        default=1,
        help="request streams of the deployment; clients and workers must agree (default 1: "
        "the one stream {prefix}:requests)",
    )


# -- worker ------------------------------------------------------------------------------------


def _configure_worker(parser: argparse.ArgumentParser) -> None:
    from engine.config_flags import add_engine_args
    from worker.batch import add_batch_args

    _add_redis_args(parser, shards=True)
    g = parser.add_argument_group("service")
    g.add_argument("--name", help="consumer name in the group (default host-pid); unique")
    g.add_argument(
        "--max-deliveries",
        type=positive_int,
        default=DEFAULT_MAX_DELIVERIES,
        help=f"deliveries before an entry goes to the dead stream (default {DEFAULT_MAX_DELIVERIES})",
    )
    g.add_argument(
        "--lease-s",
        type=float,
        default=DEFAULT_LEASE_S,
        help=f"an entry idle this long is taken over by another worker (default {DEFAULT_LEASE_S:g})",
    )
    g.add_argument(
        "--max-in-flight", type=positive_int, help="requests held at once (default: --max-seqs)"
    )
    g.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"on SIGTERM, let in-flight requests finish this long (default {DEFAULT_GRACE_S:g})",
    )
    g.add_argument("--max-prompt-tokens", type=positive_int, help="refuse longer prompts")
    g.add_argument(
        "--max-output-tokens",
        type=positive_int,
        help="refuse a larger max_tokens (lower it with --clamp-max-tokens on); default: no limit "
        "but the model's context",
    )
    g.add_argument(
        "--max-entry-bytes",
        type=positive_int,
        default=4 * 1024 * 1024,
        help="refuse larger request payloads (default 4 MiB)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port (default 0: off)",
    )
    g.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help=f"interface of --metrics-port (default {DEFAULT_METRICS_HOST})",
    )
    g.add_argument(
        "--routing",
        type=on_off,
        default=False,
        metavar="on/off",
        help="prefix-aware routing: read a stream of this worker's own, publish the prefixes "
        "it serves, steal from busy workers (docs/routing.md; default off)",
    )
    g.add_argument(
        "--steal-after-ms",
        type=int,
        default=DEFAULT_STEAL_AFTER_MS,
        help="with --routing: take another worker's routed entry once it waited this long "
        f"(default {DEFAULT_STEAL_AFTER_MS})",
    )
    g.add_argument(
        "--prefix-ttl-s",
        type=positive_int,
        default=DEFAULT_PREFIX_TTL_S,
        help=f"with --routing: a published prefix expires after this long (default {DEFAULT_PREFIX_TTL_S})",
    )
    g.add_argument(
        "--yield-shards-at",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="with --routing: holding N requests, leave the shared streams' new entries to "
        "idler workers and take them only once they waited (0: never; default 1 on a CPU, "
        "max(4, max-in-flight / 16) on a GPU)",
    )
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="DEBUG, INFO, WARNING, ERROR")  # fmt: skip
    add_batch_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_worker, command_prog=parser.prog)  # fmt: skip


class StoppedStartingError(BaseException):
    """SIGTERM reached a worker that was still loading its model (a BaseException, as
    KeyboardInterrupt is: a library's ``except Exception`` must not swallow it)."""


class _StartUp:
    """SIGTERM before serve() installs the loop's handlers: during the load it ends the
    start-up at once; after it, serve() stops as soon as it serves (raising inside the loop's
    setup could be swallowed by a callback's exception handler)."""

    def __init__(self) -> None:
        self.loading = True
        self.stop_requested = False

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        if self.loading:
            raise StoppedStartingError


def run_worker(args: argparse.Namespace) -> int:
    """Handler of ``pagestream worker``: serve until SIGTERM/SIGINT, then drain and exit 0."""
    from engine import LLMEngine, PagestreamError
    from engine.config_flags import engine_config_from_args
    from engine.errors import EngineDeadError
    from worker.batch import BatchSettings
    from worker.batch_runner import BatchRunner, serve_with_batches
    from worker.engine_thread import EngineThread
    from worker.logs import configure_logging, get_logger
    from worker.prometheus import MetricsPortError, check_listenable
    from worker.service import WorkerService
    from worker.settings import WorkerSettings
    from worker.telemetry import check_export_env

    configure_logging(level=args.log_level)
    log = get_logger("pagestream.worker")
    # Until serve() installs the loop's handlers, SIGTERM ends the start-up (a model can take
    # minutes to load): nothing was read from Redis yet, so there is nothing to hand back.
    start_up = _StartUp()
    signal.signal(signal.SIGTERM, start_up.on_sigterm)
    try:  # every setting is checked before the model loads
        check_export_env()
        config = engine_config_from_args(args)
        settings = WorkerSettings.from_args(args, max_seqs=config.max_seqs)
        batch_settings = BatchSettings.from_args(args, settings)
        if settings.metrics_port:
            check_listenable(settings.metrics_host, settings.metrics_port)
        log.info("loading the model", model=config.model)
        engine = LLMEngine(config)
        start_up.loading = False
    except StoppedStartingError:
        log.info("stopped during start-up")
        return 0
    except MetricsPortError as exc:
        raise CommandError(str(exc), EXIT_ERROR) from exc
    except (PagestreamError, ValueError) as exc:
        raise CommandError(
            naming_the_flag(str(exc), args),
            EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR,
        ) from exc

    async def serve() -> None:
        engine_thread = EngineThread(engine)
        service = WorkerService(settings, engine_thread)
        # arq needs one Redis: on a Redis Cluster this worker serves the streams alone
        with_batches = batch_settings.max_jobs and not settings.redis_cluster
        batches = BatchRunner(batch_settings, engine_thread) if with_batches else None

        def request_stop() -> None:
            service.request_stop()
            if batches is not None:
                batches.request_stop()  # running batch jobs go back on the queue

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, request_stop)
        if start_up.stop_requested:  # SIGTERM between the load and the handlers above
            request_stop()
        await serve_with_batches(service, batches)

    try:
        asyncio.run(serve())
    except EngineDeadError as exc:  # a tensor-parallel rank died: its requests go elsewhere
        raise CommandError(str(exc), EXIT_ERROR) from exc
    except MetricsPortError as exc:  # nothing was read yet: a one-line error, no traceback
        raise CommandError(str(exc), EXIT_ERROR) from exc
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any
    return 0


# -- client verbs ----------------------------------------------------------------------------------


def _configure_submit(parser: argparse.ArgumentParser) -> None:
    _add_redis_args(parser, shards=True)
    parser.add_argument("prompt", help="the prompt; its text streams to stdout")
    parser.add_argument("--chat", action="store_true", help="send it as one user message")
    parser.add_argument("--id", help="request id (default: a random one)")
    parser.add_argument("--timeout-s", type=float, help="give up (and cancel) after this long")
    parser.add_argument("--priority", type=int, default=0, help="lower runs first (default 0)")
    parser.add_argument("--tenant", default="default", help="tenant for quotas")
    add_client_sampling_args(parser, temperature=0.0)
    parser.set_defaults(handler=run_submit, command_prog=parser.prog)


def run_submit(args: argparse.Namespace) -> int:
    """Handler of ``pagestream submit``: print text as it arrives, a summary to stderr."""
    from clients import Client, ClientError, DoneEvent, RestartEvent, TokenEvent

    sampling = with_default_max_tokens(client_sampling(args))
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    start_s = time.perf_counter()
    with Client(
        args.redis_url, prefix=args.prefix, shards=args.shards, cluster=args.redis_cluster
    ) as client:
        try:
            for event in client.stream(
                **prompt, request_id=args.id, timeout_s=args.timeout_s, priority=args.priority,
                tenant=args.tenant, **sampling,
            ):  # fmt: skip
                if isinstance(event, TokenEvent):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, RestartEvent):
                    sys.stdout.write(f"\n[worker died; restarting on {event.worker}]\n")
                elif isinstance(event, DoneEvent):
                    sys.stdout.write("\n")
                    print(
                        f"[{event.usage.completion_tokens} tokens in {time.perf_counter() - start_s:.2f} s, "
                        f"finish_reason={event.finish_reason.value}, worker={event.worker}]",
                        file=sys.stderr,
                    )
        except ClientError as exc:
            raise CommandError(str(exc)) from exc
    return 0


def _configure_cancel(parser: argparse.ArgumentParser) -> None:
    _add_redis_args(parser)
    parser.add_argument("request_id", help="the id of the request to cancel")
    parser.set_defaults(handler=run_cancel, command_prog=parser.prog)


def run_cancel(args: argparse.Namespace) -> int:
    """Handler of ``pagestream cancel``."""
    from clients import Client
    from clients.protocol import check_request_id

    try:  # no request can have it: nothing to cancel, checked before connecting
        check_request_id(args.request_id)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    with Client(args.redis_url, prefix=args.prefix, cluster=args.redis_cluster) as client:
        client.cancel(args.request_id)
    print(f"cancel sent for {args.request_id}", file=sys.stderr)
    return 0


# -- health --------------------------------------------------------------------------------------


def _configure_health(parser: argparse.ArgumentParser) -> None:
    from clients.protocol import HEARTBEAT_TTL_S

    _add_redis_args(parser)
    parser.add_argument("--name", help="the worker to check (default: any worker on this host)")
    parser.add_argument("--max-age-s", type=float, default=HEARTBEAT_TTL_S,
                        help=f"a heartbeat older than this is stale (default {HEARTBEAT_TTL_S})")  # fmt: skip
    parser.set_defaults(handler=run_health, command_prog=parser.prog)


def run_health(args: argparse.Namespace) -> int:
    """Handler of ``pagestream health``: 0 if the worker's heartbeat is fresh, else 1."""
    import redis

    from clients.protocol import Keys, WorkerStatus, decode_struct

    keys = Keys(args.prefix)
    client: Any = (
        redis.RedisCluster.from_url(args.redis_url, socket_timeout=5)  # SCAN covers every node
        if args.redis_cluster
        else redis.Redis.from_url(args.redis_url, socket_timeout=5)
    )
    try:
        names = (
            [keys.worker(args.name)] if args.name else list(client.scan_iter(keys.worker_pattern()))
        )
        values: list[Any] = [client.get(name) for name in names]
    finally:  # an unreachable Redis is one line from commands.main
        client.close()
    now_ms = time.time() * 1000
    for value in values:
        try:
            status: WorkerStatus = decode_struct(value or b"", WorkerStatus)
        except ValueError:
            continue
        mine = args.name is not None or status.host == socket.gethostname()
        if mine and now_ms - status.updated_at_ms <= args.max_age_s * 1000:
            print(f"ok: {status.name} ({status.num_in_flight} in flight)")
            return 0
    who = f"worker {args.name!r}" if args.name else f"a worker on {socket.gethostname()}"
    raise CommandError(f"no fresh heartbeat from {who}")
