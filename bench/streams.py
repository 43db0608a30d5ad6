"""The client side of the service benchmarks: concurrent streams through Redis, what a client
measures of each request, and the run's summary of them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm


@dataclasses.dataclass
class StreamTiming:
    """One request seen by its client: seconds from submit to first and last token, the
    worker that finished it (when the stream names one), and why it did not finish with the
    tokens it asked for (None when it did)."""

    ttft_s: float
    last_s: float
    num_tokens: int
    worker: str = ""
    num_token_events: int = 0  # fewer than num_tokens when ready tokens went out together
    failure: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return (self.last_s - self.ttft_s) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def summarize(timings: list[StreamTiming], elapsed_s: float) -> dict[str, Any]:
    """Throughput and TTFT/TPOT percentiles of the requests that finished; the failed ones
    only counted, by reason (a timed-out stream's few tokens would flatter every figure)."""
    from bench.records import percentiles

    finished = [t for t in timings if t.failure is None]
    failures = Counter(t.failure for t in timings if t.failure is not None)
    num_tokens = sum(t.num_tokens for t in finished)
    tpots = [t.tpot_s for t in finished if t.tpot_s is not None]
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(finished),
        "num_failed": failures.total(),
        "failures": dict(sorted(failures.items())),
        "requests_per_s": len(finished) / elapsed_s,
        "output_tokens": num_tokens,
        "output_tok_s": num_tokens / elapsed_s,
        "ttft_s": percentiles([t.ttft_s for t in finished]),
        "tpot_s": percentiles(tpots),
    }


async def run_load(
    redis_url: str,
    prefix: str,
    prompts: list[Any],
    *,
    warmup: list[Any],
    concurrency: int,
    warmup_runs: int = 0,
    timeout_s: float = 3600.0,
    cpu_groups: dict[str, list[int]] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """``prompts`` streamed by ``concurrency`` client tasks, after the ``warmup`` prompts (all
    at once) and ``warmup_runs`` untimed runs of the whole list: the summary, the requests
    each worker finished, and the workers' engine steps from their heartbeats; with
    ``cpu_groups`` (name: pids of local processes), the cores each group, this client and
    the rest of the host used during the timed run. ``progress``: a bar over the timed
    run's requests."""
    from bench.host_cpu import busy_cores, read_cpu_times
    from bench.redis_cost import per_token, read_redis_counters
    from clients import AsyncClient

    async with AsyncClient(redis_url, prefix=prefix, timeout_s=timeout_s) as client:
        await asyncio.gather(*(_one(client, prompt) for prompt in warmup))
        for _ in range(warmup_runs):
            await _stream_all(client, prompts, concurrency)
        before = await _engine_counters(client, time.time())
        cpu_before = read_cpu_times(cpu_groups or {})
        redis_before = await read_redis_counters(client.redis)
        start_s = time.perf_counter()
        with tqdm(total=len(prompts), desc="streams", unit="req", disable=not progress) as bar:
            timings = await _stream_all(client, prompts, concurrency, bar.update)
        elapsed_s = time.perf_counter() - start_s
        redis_after = await read_redis_counters(client.redis)
        cpu_after = read_cpu_times(cpu_groups or {})
        after = await _engine_counters(client, time.time())
    results = summarize(timings, elapsed_s)
    finished = [t for t in timings if t.failure is None]
    results["requests_by_worker"] = dict(sorted(Counter(t.worker for t in finished).items()))
    group_cpu_s = None
    if cpu_groups is not None:
        results["busy_cores"] = busy_cores(cpu_before, cpu_after)
        if cpu_before is not None and cpu_after is not None:
            group_cpu_s = {name: cpu_after.groups_s[name] - cpu_before.groups_s[name]
                           for name in cpu_groups}  # fmt: skip
    results["cost"] = per_token(  # of every token streamed: failed requests' cost Redis too
        redis_before, redis_after, num_tokens=sum(t.num_tokens for t in timings),
        num_token_events=sum(t.num_token_events for t in timings), group_cpu_s=group_cpu_s,
    )  # fmt: skip
    if before is not None and after is not None:
        num_steps, step_time_s = after[0] - before[0], after[1] - before[1]
        results["workers"] = {
            "num_steps": num_steps,
            "step_s": step_time_s / max(num_steps, 1),
            "busy_fraction": step_time_s / elapsed_s,  # summed over workers: may exceed 1
        }
    return results


async def _engine_counters(client: Any, since_s: float) -> tuple[int, float] | None:
    """Engine steps and time in them, summed over the workers, from heartbeats written after
    ``since_s`` (the workers are idle between runs, so the sums are exact); None if no worker
    beats in time."""
    from clients.protocol import HEARTBEAT_TTL_S, WorkerStatus, decode_struct

    deadline_s = time.monotonic() + HEARTBEAT_TTL_S
    while time.monotonic() < deadline_s:
        values = [await client.redis.get(key)
                  async for key in client.redis.scan_iter(client.keys.worker_pattern())]  # fmt: skip
        statuses = [decode_struct(v, WorkerStatus) for v in values if v]
        if statuses and all(s.updated_at_ms >= since_s * 1000 for s in statuses):
            return sum(s.num_steps for s in statuses), sum(s.step_time_s for s in statuses)
        await asyncio.sleep(0.2)
    return None


async def _stream_all(
    client: Any,
    prompts: list[Any],
    concurrency: int,
    finished: Callable[[int], object] = lambda n: None,
) -> list[StreamTiming]:
    """``concurrency`` client tasks, each streaming one prompt after another; ``finished(1)``
    after each request."""
    pending = iter(prompts)
    timings: list[StreamTiming] = []

    async def stream_forever() -> None:
        for prompt in pending:  # shared: each prompt is taken by one client task
            timings.append(await _one(client, prompt))
            finished(1)

    await asyncio.gather(*(stream_forever() for _ in range(concurrency)))
    return timings


async def _one(client: Any, prompt: Any) -> StreamTiming:
    from clients import DoneEvent, RequestFailedError, RequestTimeoutError, TokenEvent

    start_s = time.perf_counter()
    first_s = last_s = 0.0
    num_tokens = num_events = 0
    done = None
    failure = None
    try:
        async for event in client.stream(token_ids=prompt.token_ids, max_tokens=prompt.output_len,
                                         temperature=0, ignore_eos=True):  # fmt: skip
            if isinstance(event, TokenEvent) and event.token_ids:
                last_s = time.perf_counter() - start_s
                first_s = first_s or last_s
                num_tokens += len(event.token_ids)
                num_events += 1
            elif isinstance(event, DoneEvent):
                done = event
    except RequestFailedError as exc:
        failure = f"error: {exc.code.value}"
    except RequestTimeoutError:
        failure = "no result in time"
    if failure is None:
        failure = _failure(done, prompt.output_len)
    worker = done.worker if done is not None else ""
    return StreamTiming(first_s, last_s, num_tokens, worker, num_events, failure)


def _failure(done: Any, output_len: int) -> str | None:
    """Why a stream that ended did not finish its request: it must end in a ``done`` event
    that ``finish_failure`` passes (None when it did)."""
    if done is None:
        return "no done event"
    return finish_failure(done.finish_reason.value, done.usage.completion_tokens, output_len)


def finish_failure(finish_reason: str, num_tokens: int, output_len: int) -> str | None:
    """Why a benchmark request that ended did not finish as asked: greedy with EOS ignored, it
    must end by its length with every token (None when it did). The client path's and the
    gateway's streams are judged alike."""
    if finish_reason != "length":  # the worker's deadline, or a cancel
        return f"finish reason {finish_reason}"
    if num_tokens < output_len:
        return "fewer tokens than asked"
    return None
