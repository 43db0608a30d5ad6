"""The Redis cost per token (``bench.redis_cost``) read from a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from bench.redis_cost import per_token, read_redis_counters, tokens_per_s_per_primary
from tests.redis_server import RedisServer


def test_commands_between_two_readings_are_counted_per_token(redis_server: RedisServer) -> None:
    async def scenario() -> tuple[object, object]:
        redis = aioredis.Redis.from_url(redis_server.url)
        before = await read_redis_counters(redis)
        for i in range(10):
            await redis.xadd("s", {"i": i})
        await redis.xlen("s")
        after = await read_redis_counters(redis)
        await redis.aclose()
        return before, after

    before, after = asyncio.run(scenario())
    record = per_token(before, after, num_tokens=20, num_token_events=10,  # type: ignore[arg-type]
                       group_cpu_s={"workers": 0.002})  # fmt: skip
    assert record["redis_calls_per_token_by_command"] == {"xadd": 0.5, "xlen": 0.05}
    assert record["redis_calls_per_token"] == pytest.approx(0.55)  # the readings left out
    assert record["token_events_per_token"] == 0.5
    assert record["redis_command_us_per_token"] > 0 and record["redis_cpu_us_per_token"] >= 0
    assert record["cpu_us_per_token"] == {"workers": pytest.approx(100.0)}
    assert tokens_per_s_per_primary({"redis_cpu_us_per_token": 4.0}) == pytest.approx(200_000)
