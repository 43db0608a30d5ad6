"""``pagestream bench serve --through gateway``: the same load through the OpenAI gateway.

The workload first runs through Redis with the bundled client (the client path), then the
same prompts run as streamed ``/v1/completions`` requests through a gateway (a subprocess on a
free port, or ``--gateway-url``), from as many concurrent HTTP streams. The record has both
runs and what the gateway costs: its throughput as a fraction of the client path's (target
``TARGET_RATIO_TO_CLIENT``) and the p50 time per output token it adds.

Time per output token is measured as on the client path: first to last token chunk, over the
tokens after the first (the count from the stream's ``usage``). The HTTP streams come from one
process through ``bench.sse_client``, whose cost per event is the Redis client's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from bench.streams import StreamTiming, finish_failure, summarize
from worker.arg_types import positive_int
from worker.errors import CommandError

TARGET_RATIO_TO_CLIENT = 0.9  # gateway throughput over the Redis client path's


class _Usage(msgspec.Struct):
    completion_tokens: int


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """What the benchmark reads of a streamed chunk (the rest is skipped)."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``--through`` and the gateway flags, in ``bench serve``'s workload group."""
    group.add_argument("--through", choices=("redis", "gateway"), default="redis",
                       help="redis: the bundled client; gateway: also the same load through "
                       "the OpenAI gateway over HTTP, compared with the client path")  # fmt: skip
    group.add_argument("--gateway-url", metavar="URL",
                       help="with --through gateway: this gateway's base URL (…/v1) instead "
                       "of a spawned one")  # fmt: skip
    group.add_argument("--gateway-api-key", metavar="KEY", help="bearer key of --gateway-url")
    group.add_argument("--gateway-workers", type=positive_int, default=1,
                       help="server processes of the spawned gateway (default 1)")  # fmt: skip


def run_through_gateway(
    args: argparse.Namespace, redis_url: str, prompts: list[Any], client_path: dict[str, Any]
) -> dict[str, Any]:
    """The gateway run's results, with the client path's and the comparison of the two."""
    with _gateway(args, redis_url) as base_url:
        results = asyncio.run(_serve_http(base_url, args, prompts))
    results["client_path"] = client_path
    ratio = results["output_tok_s"] / client_path["output_tok_s"]
    tpot_s, client_tpot_s = results["tpot_s"]["p50"], client_path["tpot_s"]["p50"]
    added_ms = None
    if tpot_s is not None and client_tpot_s is not None:
        added_ms = (tpot_s - client_tpot_s) * 1e3
    results["gateway"] = {
        "url": "given" if args.gateway_url else "spawned",
        "workers": None if args.gateway_url else args.gateway_workers,
        "ratio_to_client_path": ratio,
        "added_tpot_p50_ms": added_ms,
        "target_ratio_at_least": TARGET_RATIO_TO_CLIENT,
        "ratio_met": ratio >= TARGET_RATIO_TO_CLIENT,
    }
    return results


def format_gateway(results: dict[str, Any]) -> str:
    """One line: the client path's throughput and what the gateway costs."""
    g, client = results["gateway"], results["client_path"]
    added = g["added_tpot_p50_ms"]
    return (
        f"(above: through the gateway) client path (Redis): {client['output_tok_s']:.1f} tok/s; ratio "
        f"{g['ratio_to_client_path']:.2f} (target >= {g['target_ratio_at_least']}), added TPOT "
        f"p50 {'n/a' if added is None else f'{added:.2f} ms'}"
    )


@contextlib.contextmanager
def _gateway(args: argparse.Namespace, redis_url: str) -> Iterator[str]:
    if args.gateway_url:
        yield args.gateway_url.rstrip("/")
        return
    from worker.local_stack import GatewayProcess, free_port

    gateway = GatewayProcess(redis_url, args.prefix, port=free_port(),
                             flags=("--log-level", "WARNING", "--timeout-s", str(args.timeout_s),
                                    "--workers", str(args.gateway_workers)))  # fmt: skip
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


async def _serve_http(
    base_url: str, args: argparse.Namespace, prompts: list[Any]
) -> dict[str, Any]:
    from bench.sse_client import SseConnection
    from bench.workloads import warmup_prompts

    headers = {"Authorization": f"Bearer {args.gateway_api_key}"} if args.gateway_api_key else {}
    connections = [SseConnection(base_url, headers) for _ in range(args.concurrency)]
    try:
        warmup = warmup_prompts(prompts)
        await asyncio.gather(*(_one(c, p) for c, p in zip(connections, warmup, strict=False)))
        for _ in range(args.warmup_runs):
            await _stream_all(connections, prompts)
        start_s = time.perf_counter()
        timings = await _stream_all(connections, prompts)
        elapsed_s = time.perf_counter() - start_s
    finally:
        await asyncio.gather(*(connection.close() for connection in connections))
    return summarize(timings, elapsed_s)


async def _stream_all(connections: list[Any], prompts: list[Any]) -> list[StreamTiming]:
    """One HTTP stream per connection, each taking the next prompt when its last one ends."""
    pending = iter(prompts)
    timings: list[StreamTiming] = []

    async def stream_forever(connection: Any) -> None:
        for prompt in pending:
            timings.append(await _one(connection, prompt))

    await asyncio.gather(*(stream_forever(connection) for connection in connections))
    return timings


async def _one(connection: Any, prompt: Any) -> StreamTiming:
    from bench.sse_client import HttpError

    body = msgspec.json.encode({
        "prompt": prompt.token_ids, "max_tokens": prompt.output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    })  # fmt: skip
    start_s = time.perf_counter()
    first_s = last_s = 0.0
    num_tokens = 0
    finish_reason = None
    try:
        async for data in connection.post_events("/completions", body):
            if data == b"[DONE]":
                continue
            chunk = _chunk_decoder.decode(data)
            if chunk.error is not None:
                raise CommandError(f"the gateway's stream failed: {chunk.error}")
            if chunk.choices and chunk.choices[0].finish_reason is None:  # a token chunk
                last_s = time.perf_counter() - start_s
                first_s = first_s or last_s
            elif chunk.choices:
                finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
    except HttpError as exc:
        raise CommandError(f"the gateway answered: {exc}") from None
    return StreamTiming(
        first_s, last_s, num_tokens, failure=stream_failure(finish_reason, num_tokens, prompt)
    )


def stream_failure(finish_reason: str | None, num_tokens: int, prompt: Any) -> str | None:
    """Why a gateway stream did not finish as asked (``finish_failure``); None when it did."""
    if finish_reason is None:
        return "no finish reason"
    return finish_failure(finish_reason, num_tokens, prompt.output_len)
