"""Workers as real processes: two share a stream, one is SIGKILLed mid-run, one is SIGTERMed.

One test walks the whole life of a two-worker deployment, since each worker process takes a
few seconds to start.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import AsyncClient, Completion, FinishReason, protocol
from commands import main
from engine import LLM, SamplingParams
from tests.redis_server import RedisServer
from tests.service_fixtures import WORDS, spawn_worker
from worker.local_stack import free_port

KEYS = protocol.Keys()
START_TIMEOUT_S = 120.0
LONG_TOKENS = 150
# B must hold all four drain requests at once before its SIGTERM: long enough that none ends
# while the others are still being read (the tiny model's context is 256 tokens).
DRAIN_TOKENS = 200


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.05)


def healthy(server: RedisServer, name: str, max_age_s: float = 5.0) -> bool:
    args = ["health", "--redis-url", server.url, "--name", name, "--max-age-s", str(max_age_s)]
    return main(args) == 0


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS[4:]) for _ in range(rng.randint(3, 12))) for _ in range(count)
    ]


async def complete_all(server: RedisServer, texts: list[str], max_tokens: int) -> list[Completion]:
    async with AsyncClient(server.url) as client:
        return await asyncio.gather(
            *(client.complete(t, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout_s=120)
              for t in texts)
        )  # fmt: skip


def pending_of(server: RedisServer, consumer: str) -> int:
    r = server.client()
    try:
        return len(
            r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 100, consumername=consumer)
        )
    finally:
        r.close()


def num_streaming(server: RedisServer, consumer: str) -> int:
    """Entries pending under ``consumer`` whose request is mid-stream: events on its out
    stream, none of them terminal, and fewer than half of ``LONG_TOKENS``. (An entry that is
    still pending may be finished already: its worker writes ``done`` before it acknowledges,
    and a kill in that window leaves the taker nothing to restart.)"""
    r = server.client()
    try:
        rows = r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 100, consumername=consumer)
        count = 0
        for row in rows:
            entries = r.xrange(KEYS.requests, row["message_id"], row["message_id"])
            request_id = protocol.peek_request_id(entries[0][1][b"msg"]) if entries else None
            if not request_id:
                continue
            events = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(KEYS.out(request_id))]
            count += 0 < len(events) < LONG_TOKENS // 2 and not any(
                isinstance(e, protocol.TERMINAL_EVENTS) for e in events
            )
        return count
    finally:
        r.close()


def terminal_counts(server: RedisServer, request_ids: list[str]) -> list[int]:
    r = server.client()
    counts = []
    for request_id in request_ids:
        events = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(KEYS.out(request_id))]
        counts.append(sum(isinstance(e, protocol.TERMINAL_EVENTS) for e in events))
    r.close()
    return counts


def test_two_workers_share_survive_sigkill_and_drain_on_sigterm(
    redis_server: RedisServer, text_model_dir: Path, tmp_path: Path
) -> None:
    extra = ("--max-in-flight", "4")
    a = spawn_worker(text_model_dir, redis_server, "A", tmp_path, *extra)
    b = spawn_worker(text_model_dir, redis_server, "B", tmp_path, *extra)
    try:
        wait_until(
            lambda: healthy(redis_server, "A") and healthy(redis_server, "B"),
            START_TIMEOUT_S,
            "workers",
        )
        assert not healthy(redis_server, "nobody")

        # both serve
        short = asyncio.run(complete_all(redis_server, prompts(16, seed=3), 8))
        assert {c.finish_reason for c in short} == {FinishReason.LENGTH}
        assert {c.worker for c in short} == {"A", "B"}

        # SIGKILL A with requests in flight: B finishes every one, each exactly once
        params = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
        results: list[Completion] = []

        async def kill_a_mid_run() -> list[str]:
            # Kill A once it streams a request it still holds: B must then take that one over
            # behind a `restart`. (A fixed sleep raced A finishing them; killing A as soon as it
            # held entries raced its claiming them, and a request never claimed runs afresh.)
            # On a loaded host the watch can miss A's short window, A finishing its share
            # between two looks: then another batch, up to three. A is stopped (SIGSTOP)
            # before the second look, which decides: a kill after one look alone found A
            # finished in between on a loaded host, and nothing was restarted.
            for seed in (4, 5, 6):
                texts = prompts(8, seed=seed)
                task = asyncio.create_task(complete_all(redis_server, texts, LONG_TOKENS))
                while not task.done():
                    if await asyncio.to_thread(num_streaming, redis_server, "A") > 0:
                        a.send_signal(signal.SIGSTOP)
                        if await asyncio.to_thread(num_streaming, redis_server, "A") > 0:
                            a.send_signal(signal.SIGKILL)
                            results.extend(await task)
                            return texts
                        a.send_signal(signal.SIGCONT)
                    await asyncio.sleep(0.05)
                await task
            raise AssertionError("A streamed none of three batches while it held them")

        texts = asyncio.run(kill_a_mid_run())
        assert a.wait(10) == -signal.SIGKILL
        reference = LLM(str(text_model_dir), device="cpu").generate(texts, params, use_tqdm=False)
        for completion, ref in zip(results, reference, strict=True):
            assert completion.token_ids == ref.token_ids and completion.text == ref.text
        assert any(c.num_restarts for c in results), "A held none of the requests"
        assert terminal_counts(redis_server, [c.request_id for c in results]) == [1] * len(results)
        wait_until(
            lambda: not healthy(redis_server, "A", max_age_s=1.0), 10, "A's heartbeat to age"
        )

        # SIGTERM B mid-run: it finishes its in-flight work and exits 0
        async def term_b_mid_run() -> list[Completion]:
            task = asyncio.create_task(complete_all(redis_server, prompts(4, seed=5), DRAIN_TOKENS))
            # B holds all 4 for the few tenths of a second they run; a poll that misses
            # that sees them done instead (the drain then has nothing left to wait for)
            await asyncio.to_thread(
                wait_until,
                lambda: pending_of(redis_server, "B") == 4 or task.done(),
                30,
                "B busy",
            )
            b.send_signal(signal.SIGTERM)  # all 4 are B's: no worker is left to take any
            return await task

        drained = asyncio.run(term_b_mid_run())
        assert b.wait(60) == 0
        assert [len(c.token_ids) for c in drained] == [DRAIN_TOKENS] * 4
        assert not any(c.num_restarts for c in drained)
        assert not healthy(redis_server, "B")
    finally:
        for process in (a, b):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not (tmp_path / "B.log").read_text().count("Traceback")


def sigterm_once_logged(model: str, batch_jobs: str, marker: bytes, log_path: Path) -> bytes:
    """A worker on an address where no Redis listens, sent SIGTERM once ``marker`` is in its
    log: it must exit 0 within 30 s. Its log."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    command = [sys.executable, "-m", "commands", "worker", "--redis-url", url, "--device", "cpu",
               "--model", model, "--batch-jobs", batch_jobs]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: marker in log_path.read_bytes(), START_TIMEOUT_S, repr(marker))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()
    finally:
        process.kill()
        process.wait()
    return log_path.read_bytes()


@pytest.mark.parametrize("batch_jobs", ["0", "2"])
def test_a_worker_that_cannot_reach_redis_stops_at_once_on_sigterm(
    text_model_dir: Path, tmp_path: Path, batch_jobs: str
) -> None:
    logged = sigterm_once_logged(
        str(text_model_dir), batch_jobs, b"redis unavailable", tmp_path / "worker.log"
    )
    assert b"stopped before redis answered" in logged


def test_a_worker_stopped_while_its_model_loads_exits_0(tmp_path: Path) -> None:
    """SIGTERM during start-up (a model can take minutes to load) ends the worker cleanly, as
    operations.md says a stopped worker does: nothing was read yet, so nothing is handed back
    (it was killed by the signal, exit 143, without a word)."""
    # a model of 135M random parameters: seconds to build on the CPU, the window to stop in
    logged = sigterm_once_logged(
        "dummy:smollm2-135m", "0", b"loading the model", tmp_path / "worker.log"
    )
    assert b"stopped during start-up" in logged and b"engine ready" not in logged
    assert b"Traceback" not in logged
