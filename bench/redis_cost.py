"""What one generated token costs Redis and the worker (issue 31, item 5's measurement).

Read around a timed run: Redis's ``INFO commandstats`` (calls and microseconds per command,
those run inside the workers' scripts included) and ``INFO cpu`` (the server's CPU seconds),
and, where ``bench.host_cpu`` timed local process groups, their CPU seconds. Divided by the
run's output tokens this gives the figures a fleet is sized by: commands and Redis CPU per
token (how many tokens/s one Redis primary carries), worker CPU per token, and token events
per token (below 1 when a request's ready tokens go out as one event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOP_COMMANDS = 8  # the record lists the commands that cost the most calls


@dataclass(frozen=True)
class RedisCounters:
    """Cumulative counters of one Redis server at one moment."""

    calls: dict[str, int]  # by command (lower case)
    usec: dict[str, int]  # time spent in each command, microseconds
    cpu_s: float  # the server's user + system CPU seconds


async def read_redis_counters(redis: Any) -> RedisCounters:
    """``INFO commandstats`` and ``INFO cpu`` of the server ``redis`` talks to."""
    stats = await redis.info("commandstats")
    cpu = await redis.info("cpu")
    calls, usec = {}, {}
    for key, value in stats.items():  # "cmdstat_xadd": {"calls": 3, "usec": 40, ...}
        name = key.removeprefix("cmdstat_")
        calls[name], usec[name] = int(value["calls"]), int(value["usec"])
    return RedisCounters(calls, usec, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


def per_token(
    before: RedisCounters,
    after: RedisCounters,
    *,
    num_tokens: int,
    num_token_events: int,
    group_cpu_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's costs per output token. ``group_cpu_s``: CPU seconds of local process groups
    (``workers``, ``redis``, ...) during the run. The ``INFO`` calls of the readings
    themselves are left out."""
    tokens = max(num_tokens, 1)
    calls = {name: n - before.calls.get(name, 0) for name, n in after.calls.items()}
    calls["info"] = calls.get("info", 0) - 2  # the two readings of `before` (after's not counted)
    calls = {name: n for name, n in calls.items() if n > 0}
    usec_by = {name: n - before.usec.get(name, 0) for name, n in after.usec.items()}
    usec = sum(usec_by.values())
    top = sorted(calls.items(), key=lambda item: -item[1])[:TOP_COMMANDS]
    record: dict[str, Any] = {
        "output_tokens": num_tokens,
        "token_events_per_token": num_token_events / tokens,
        "redis_calls_per_token": sum(calls.values()) / tokens,
        "redis_calls_per_token_by_command": {name: n / tokens for name, n in top},
        "redis_command_us_per_token": usec / tokens,
        # a script's time holds the time of the commands it runs, which are listed too
        "redis_command_us_per_token_by_command": {
            name: usec_by.get(name, 0) / tokens for name, _ in top
        },
        "redis_cpu_us_per_token": (after.cpu_s - before.cpu_s) * 1e6 / tokens,
    }
    if group_cpu_s:
        record["cpu_us_per_token"] = {name: s * 1e6 / tokens for name, s in group_cpu_s.items()}
    return record


def tokens_per_s_per_primary(record: dict[str, Any], redis_cpu_fraction: float = 0.8) -> float:
    """The output tokens/s one Redis primary carries with its (one) command thread busy
    ``redis_cpu_fraction`` of the time, from a ``per_token`` record's Redis CPU per token."""
    cpu_us = max(record["redis_cpu_us_per_token"], 1e-3)
    return redis_cpu_fraction * 1e6 / cpu_us
