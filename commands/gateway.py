"""``pagestream gateway``: the OpenAI-compatible HTTP gateway (``worker.gateway``) under uvicorn.

The gateway is stateless: run any number of them in front of one Redis. It never imports
torch, so it starts in about a second.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from clients.aio import DEFAULT_REDIS_URL
from clients.protocol import DEFAULT_PREFIX
from commands.parser import CommandError, Subparsers
from worker.arg_types import LOG_LEVELS, on_off, positive_int
from worker.gateway import config


def register(subparsers: Subparsers) -> None:
    """Add ``pagestream gateway`` to the ``pagestream`` parser."""
    help_text = "serve the OpenAI API (completions, chat, models) over HTTP in front of Redis"
    subparsers.add_parser("gateway", help=help_text, description=help_text, configure=configure)


def configure(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagestream gateway``."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--redis-url", default=DEFAULT_REDIS_URL,
                   help=f"the workers' Redis (default {DEFAULT_REDIS_URL})")  # fmt: skip
    g.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix of the deployment")
    g.add_argument("--redis-cluster", type=on_off, default=False, metavar="on/off",
                   help="--redis-url names a node of a Redis Cluster (default off)")  # fmt: skip
    g.add_argument("--shards", type=positive_int, default=1,
                   help="request streams of the deployment, as the workers' --shards (default 1)")  # fmt: skip
    g.add_argument("--home-shard", type=int, metavar="I",
                   help="give the requests ids whose keys lie on shard I (0..shards-1), so that "
                   "on a Redis Cluster this gateway reads their events from one primary; give "
                   "each gateway of a fleet its own (default: spread over every shard)")  # fmt: skip
    g.add_argument("--host", default=config.DEFAULT_HOST,
                   help=f"address to listen on (default {config.DEFAULT_HOST}; 0.0.0.0 = all)")  # fmt: skip
    g.add_argument("--port", type=int, default=config.DEFAULT_PORT,
                   help=f"HTTP port (default {config.DEFAULT_PORT})")  # fmt: skip
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (repeatable; default: no auth)")  # fmt: skip
    g.add_argument("--max-body-bytes", type=positive_int, default=config.DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default {config.DEFAULT_MAX_BODY_BYTES})")  # fmt: skip
    g.add_argument("--timeout-s", type=float, default=config.DEFAULT_TIMEOUT_S,
                   help=f"a request's deadline (default {config.DEFAULT_TIMEOUT_S:g})")  # fmt: skip
    g.add_argument("--chat-max-tokens", type=positive_int, default=config.DEFAULT_CHAT_MAX_TOKENS,
                   help="max_tokens of a chat request that sets none, lowered to what the "
                   f"model's context leaves (default {config.DEFAULT_CHAT_MAX_TOKENS})")  # fmt: skip
    g.add_argument("--tool-call-parser", default="auto", choices=config.TOOL_CALL_PARSERS,
                   help="how chat output is read for tool calls under tool_choice auto: auto "
                   "(what the workers find in their chat template), hermes, none")  # fmt: skip
    g.add_argument("--reasoning-parser", default="auto", choices=config.REASONING_PARSERS,
                   help="how a thinking model's reasoning is split into reasoning_content: "
                   "auto (what the workers find in their chat template), qwen3, none")  # fmt: skip
    g.add_argument("--routing", type=on_off, default=False, metavar="on/off",
                   help="prefix-aware routing: send each request to the worker that holds "
                   "its longest prefix (docs/routing.md; default off)")  # fmt: skip
    g.add_argument("--workers", type=positive_int, default=1,
                   help="server processes sharing the port (default 1); each streams about "
                   "15,000 tokens/s on one core")  # fmt: skip
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="DEBUG, INFO, WARNING, ERROR")  # fmt: skip
    parser.set_defaults(handler=run, command_prog=parser.prog)


def settings_from_args(args: argparse.Namespace) -> config.GatewaySettings:
    """The settings the flags describe; raises ``CommandError`` for a bad value."""
    keys = tuple(key.strip() for key in args.api_key or [] if key.strip())
    try:
        return config.GatewaySettings(
            redis_url=args.redis_url, redis_cluster=args.redis_cluster, prefix=args.prefix,
            num_shards=args.shards, home_shard=args.home_shard,
            host=args.host, port=args.port,
            api_keys=keys, max_body_bytes=args.max_body_bytes, timeout_s=args.timeout_s,
            chat_max_tokens=args.chat_max_tokens, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, routing=args.routing,
        )  # fmt: skip
    except config.GatewayConfigError as exc:
        raise CommandError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """Handler of ``pagestream gateway``: serve until SIGINT/SIGTERM."""
    import uvicorn

    from commands.parser import redact_url
    from worker.gateway.app import create_app

    settings = settings_from_args(args)
    # Keep idle client connections for a minute (uvicorn's default is 5 s): clients and proxies
    # in front of the gateway hold pools of keep-alive connections between requests.
    options = dict(host=settings.host, port=settings.port, log_level=args.log_level.lower(),
                   access_log=args.log_level == "DEBUG", timeout_graceful_shutdown=5,
                   timeout_keep_alive=KEEP_ALIVE_S)  # fmt: skip
    auth = f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no auth"
    print(f"pagestream gateway: http://{settings.host}:{settings.port}/v1 -> "
          f"{redact_url(settings.redis_url)} (prefix {settings.prefix!r}, {auth}, "
          f"{args.workers} process(es))", file=sys.stderr, flush=True)  # fmt: skip
    if args.workers > 1:
        # Each process builds its own app (a Redis client of its own) in a spawned child.
        from uvicorn.supervisors import Multiprocess

        factory = functools.partial(create_app, settings)
        config = uvicorn.Config(factory, factory=True, workers=args.workers, **options)
        Multiprocess(config, sockets=[config.bind_socket()]).run()
        return 0
    server = _server_class()(uvicorn.Config(create_app(settings), **options))
    server.run()
    return 0 if server.started else 1


KEEP_ALIVE_S = 60


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a stop signal ends the command with exit code 0
        (uvicorn raises the signal again after shutting down, so the process would die of it)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            stops = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
