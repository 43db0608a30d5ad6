"""A worker whose tensor-parallel rank dies exits non-zero on its own, and the queue's lease
takeover hands its requests to another worker, which finishes each exactly once."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

from clients import Completion
from engine import LLM, SamplingParams
from tests.redis_server import RedisServer
from tests.service_fixtures import spawn_worker
from tests.test_worker_process import (
    START_TIMEOUT_S,
    complete_all,
    healthy,
    num_streaming,
    prompts,
    terminal_counts,
    wait_until,
)

NUM_TOKENS = 200  # mid-stream by num_streaming (under 75 events) leaves 125 or more to go


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_worker_whose_rank_dies_exits_and_its_requests_go_to_another(
    redis_server: RedisServer, text_model_dir: Path, tmp_path: Path
) -> None:
    extra = ("--max-in-flight", "4")
    a = spawn_worker(
        text_model_dir, redis_server, "A", tmp_path, *extra, "--tensor-parallel-size", "2"
    )
    b = spawn_worker(text_model_dir, redis_server, "B", tmp_path, *extra)
    try:
        wait_until(
            lambda: healthy(redis_server, "A") and healthy(redis_server, "B"),
            START_TIMEOUT_S,
            "workers",
        )
        (rank_1,) = child_pids(a.pid)
        texts = prompts(4, seed=9)
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        reference = LLM(str(text_model_dir), device="cpu").generate(texts, params, use_tqdm=False)
        results: list[Completion] = []

        async def kill_rank_1_mid_run() -> None:
            task = asyncio.create_task(complete_all(redis_server, texts, NUM_TOKENS))
            await asyncio.to_thread(
                wait_until, lambda: num_streaming(redis_server, "A") > 0, 30, "A streaming"
            )
            os.kill(rank_1, signal.SIGKILL)
            results.extend(await task)

        asyncio.run(kill_rank_1_mid_run())
        assert a.wait(30) == 1  # it ended itself, with an error
        assert re.search(
            r"error: tensor-parallel rank 1 \(pid \d+\) exited with code -9",
            (tmp_path / "A.log").read_text(),
        )
        for completion, ref in zip(results, reference, strict=True):
            assert completion.token_ids == ref.token_ids
        assert any(c.num_restarts for c in results), "A held none of the requests"
        assert terminal_counts(redis_server, [c.request_id for c in results]) == [1] * len(results)
    finally:
        for process in (a, b):
            if process.poll() is None:
                process.kill()
                process.wait()
