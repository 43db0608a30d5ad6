"""``pagestream bench serve --through gateway``: the same load through the OpenAI gateway.

The workload first runs through Redis with the bundled client (the client path), then the
same prompts run as streamed ``/v1/completions`` requests through a gateway (a subprocess on a
free port, or ``--gateway-url``), from as many concurrent HTTP streams. The record has both
runs and what the gateway costs: its throughput as a fraction of the client path's (target
``TARGET_RATIO_TO_CLIENT``) and the p50 time per output token it adds.

Time per output token is measured as on the client path: first to last token chunk, over the
tokens after the first (the count from the stream's ``usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from worker.bench_serve import StreamTiming, summarize
from worker.cli import CommandError

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
                             flags=("--log-level", "WARNING", "--timeout-s", str(args.timeout_s)))  # fmt: skip
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


async def _serve_http(
    base_url: str, args: argparse.Namespace, prompts: list[Any]
) -> dict[str, Any]:
    try:
        import httpx
    except ImportError:
        raise CommandError(
            "--through gateway needs httpx: pip install 'pagestream[bench]'"
        ) from None
    from engine.benchmark import warmup_prompts

    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    headers = {"Authorization": f"Bearer {args.gateway_api_key}"} if args.gateway_api_key else {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, headers=headers,
                                 timeout=args.timeout_s) as http:  # fmt: skip
        await asyncio.gather(*(_one(http, prompt) for prompt in warmup_prompts(prompts)))
        for _ in range(args.warmup_runs):
            await _stream_all(http, prompts, args.concurrency)
        start_s = time.perf_counter()
        timings = await _stream_all(http, prompts, args.concurrency)
        elapsed_s = time.perf_counter() - start_s
    return summarize(timings, elapsed_s)


async def _stream_all(http: Any, prompts: list[Any], concurrency: int) -> list[StreamTiming]:
    """``concurrency`` HTTP streams, each taking the next prompt when its last one ends."""
    pending = iter(prompts)
    timings: list[StreamTiming] = []

    async def stream_forever() -> None:
        for prompt in pending:
            timings.append(await _one(http, prompt))

    await asyncio.gather(*(stream_forever() for _ in range(concurrency)))
    return timings


async def _one(http: Any, prompt: Any) -> StreamTiming:
    body = {"prompt": prompt.token_ids, "max_tokens": prompt.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start_s = time.perf_counter()
    first_s = last_s = 0.0
    num_tokens = 0
    async with http.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise CommandError(f"the gateway answered {response.status_code}: {text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue  # blank separators and the closing [DONE]
            chunk = _chunk_decoder.decode(line[6:])
            if chunk.error is not None:
                raise CommandError(f"the gateway's stream failed: {chunk.error}")
            if chunk.choices and chunk.choices[0].finish_reason is None:  # a token chunk
                last_s = time.perf_counter() - start_s
                first_s = first_s or last_s
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
    return StreamTiming(first_s, last_s, num_tokens)
