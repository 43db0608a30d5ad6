"""The service's promises under load with faults together (issue 14, item 3).

Two worker processes serve good requests while one worker is SIGKILLed, Redis is killed
with ``kill -9`` and restarted on its AOF (``appendfsync always``), hostile entries are
interleaved, requests are cancelled mid stream and ids are submitted twice. Afterwards every
good request finished exactly once with the greedy answer, every hostile one has its dead
letter (and its error event where its id is readable), the workers live, and every out
stream has a TTL. ``--chaos-*`` options set the sizes (see tests/chaos/plugin.py);
``--chaos-cluster`` runs it all on a 3-primary Redis Cluster with 3 shards, one primary
killed (tests/chaos/target.py).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from clients import AsyncClient, Completion, FinishReason, protocol
from clients.reader import REDIS_ERRORS
from commands import main
from engine import LLM, SamplingParams
from tests.chaos.hostile import hostile_entry, invalid_reuse
from tests.chaos.plugin import ChaosSettings
from tests.chaos.target import ChaosRedis
from tests.service_fixtures import spawn_worker
from tests.test_worker_process import START_TIMEOUT_S, prompts, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]
CANCEL_TOKENS = 120  # long enough that a cancel lands mid stream
WORKER_FLAGS = ("--max-in-flight", "48", "--max-output-tokens", "128", "--max-seqs", "48")


async def retry_redis(operation: Any) -> Any:
    """Run ``operation()`` until Redis answers (it may be restarting)."""
    for _ in range(200):
        try:
            return await operation()
        except REDIS_ERRORS:  # a cluster's CLUSTERDOWN and TRYAGAIN too
            await asyncio.sleep(0.1)
    raise AssertionError("redis did not come back")


NUM_SESSIONS = 16  # with --chaos-routing: good requests pinned to this many conversations


async def good_request(
    client: AsyncClient, rid: str, text: str, max_tokens: int, session: str | None = None
) -> Completion:
    options: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if session is not None:
        options["session"] = session
    # Submitting again after a lost reply is safe: a duplicate id is not run twice.
    await retry_redis(lambda: client.submit(text, request_id=rid, **options))
    return await client.result(rid, timeout_s=300)


async def cancelled_request(client: AsyncClient, rid: str, text: str) -> Completion:
    options = dict(max_tokens=CANCEL_TOKENS, temperature=0, ignore_eos=True)
    await retry_redis(lambda: client.submit(text, request_id=rid, **options))
    completion = Completion(rid)
    async for event in client.resume(rid, timeout_s=300):
        completion.add(event)
        if len(completion.token_ids) == 1:
            await retry_redis(lambda: client.cancel(rid))
    return completion


def healthy(target: ChaosRedis, name: str, max_age_s: float = 5.0) -> bool:
    args = ["health", *target.health_flags(), "--name", name, "--max-age-s", str(max_age_s)]
    return main(args) == 0


def num_streaming(target: ChaosRedis, consumer: str) -> int:
    """Entries pending under ``consumer`` whose request has events (hostile ones may lack ``msg``),
    in every shard and (with routing) the consumer's own stream."""
    r, keys = target.client(), target.keys
    try:
        count = 0
        for stream in (*keys.shards, keys.routed(consumer)):
            if not r.exists(stream):
                continue
            rows = r.xpending_range(stream, keys.group, "-", "+", 1000, consumername=consumer)
            for row in rows:
                entries = r.xrange(stream, row["message_id"], row["message_id"])
                payload = entries[0][1].get(b"msg", b"") if entries else b""
                request_id = protocol.peek_request_id(payload)
                count += bool(request_id and r.xlen(keys.out(request_id)))
        return count
    finally:
        r.close()


def all_served(r: redis.Redis, keys: protocol.Keys) -> bool:
    """Every shard and every routed stream: empty, nothing pending."""
    routed = (keys.routed(name.decode()) for name in r.smembers(keys.routed_workers))
    return all(
        r.xlen(s) == 0 and (not r.exists(s) or r.xpending(s, keys.group)["pending"] == 0)
        for s in (*keys.shards, *routed)
    )


def events_of(r: redis.Redis, keys: protocol.Keys, rid: str) -> list[Any]:
    return [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(keys.out(rid))]


def check_usage(completions: list[Completion]) -> None:
    """Usage counts the tokens that count: those after the last ``restart``."""
    for completion in completions:
        assert completion.usage is not None, completion.request_id
        assert completion.usage.completion_tokens == len(completion.token_ids), completion


def test_chaos_under_load(
    chaos_redis: ChaosRedis, text_model_dir: Path, tmp_path: Path,
    chaos_settings: ChaosSettings, chaos_summary: list[tuple[str, str]],
) -> None:  # fmt: skip
    cfg, target, keys = chaos_settings, chaos_redis, chaos_redis.keys
    started_s = time.monotonic()
    texts = prompts(cfg.num_requests, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True)
    reference = LLM(str(text_model_dir), device="cpu").generate(texts, greedy, use_tqdm=False)
    flags = (*WORKER_FLAGS, *target.worker_flags, *(("--routing", "on") if cfg.routing else ()))
    workers = {n: spawn_worker(text_model_dir, target, n, tmp_path, *flags) for n in "AB"}
    rng = random.Random(5)
    hostile = [hostile_entry(i, rng) for i in range(cfg.num_hostile)]
    hostile_entry_ids: list[str] = []
    faults: list[str] = []
    try:
        wait_until(
            lambda: healthy(target, "A") and healthy(target, "B"),
            START_TIMEOUT_S,
            "workers",
        )
        raw = target.client()

        async def load() -> tuple[list[Completion], list[Completion]]:
            async with AsyncClient(
                target.url, routing=cfg.routing, **target.client_options
            ) as client:
                good = [asyncio.create_task(good_request(
                            client, f"good-{i}", t, cfg.max_tokens,
                            f"s{i % NUM_SESSIONS}" if cfg.routing else None))
                        for i, t in enumerate(texts)]  # fmt: skip
                cancels = [asyncio.create_task(cancelled_request(client, f"cancel-{i}", t))
                           for i, t in enumerate(prompts(cfg.num_cancels, seed=12))]  # fmt: skip

                async def write_hostile() -> None:  # interleaved with the good ones
                    for i, (fields, _) in enumerate(hostile):  # on every shard in turn
                        shard = keys.shards[i % len(keys.shards)]
                        entry_id = await asyncio.to_thread(raw.xadd, shard, fields)
                        hostile_entry_ids.append(entry_id.decode())

                writing = asyncio.create_task(write_hostile())
                # A is killed while it streams (watched from the start: a fast machine may
                # serve every short request while the hostile entries are still being written)
                await asyncio.to_thread(
                    wait_until, lambda: num_streaming(target, "A") > 0, 120, "A streaming"
                )
                workers["A"].send_signal(signal.SIGKILL)
                faults.append("worker A SIGKILLed")
                for i in range(cfg.num_duplicates):  # the same id again, while it may run
                    await retry_redis(
                        lambda i=i: client.submit(
                            texts[i],
                            request_id=f"good-{i}",
                            max_tokens=cfg.max_tokens,
                            temperature=0,
                            ignore_eos=True,
                        )
                    )
                for i in range(cfg.num_duplicates):  # invalid, reusing an id that may run
                    fields = invalid_reuse(f"good-{i}")
                    shard = keys.shard_for(f"good-{i}")  # where that id's own entry went
                    entry_id = await asyncio.to_thread(raw.xadd, shard, fields)
                    hostile_entry_ids.append(entry_id.decode())
                await writing
                faults.append(await asyncio.to_thread(target.kill_and_restart))
                workers["A2"] = spawn_worker(text_model_dir, target, "A2", tmp_path, *flags)
                return await asyncio.gather(*good), await asyncio.gather(*cancels)

        good, cancelled = asyncio.run(load())
        raw.close()
        raw = target.client()
        # every good request: the greedy answer, exactly one terminal event
        for completion, ref in zip(good, reference, strict=True):
            assert completion.finish_reason is FinishReason.LENGTH, completion.request_id
            assert completion.token_ids == ref.token_ids and completion.text == ref.text
        terminals = {
            c.request_id: sum(
                isinstance(e, protocol.TERMINAL_EVENTS) for e in events_of(raw, keys, c.request_id)
            )
            for c in good + cancelled
        }
        assert set(terminals.values()) == {1}, {k: v for k, v in terminals.items() if v != 1}
        check_usage(good + cancelled)
        # cancelled mid stream: `cancelled`, or `length` if the request ended before the cancel arrived
        reasons = [c.finish_reason for c in cancelled]
        assert set(reasons) <= {FinishReason.CANCELLED, FinishReason.LENGTH}
        assert all(
            len(c.token_ids) < CANCEL_TOKENS
            for c in cancelled
            if c.finish_reason is FinishReason.CANCELLED
        )
        # hostile entries may still be on their way (one held by the killed worker waits for
        # its lease to expire): wait until every entry is served
        wait_until(lambda: all_served(raw, keys), 60, "every entry served")
        # hostile: each dead-lettered, with its error event when its id is readable
        letters = [
            protocol.decode_struct(f[b"msg"], protocol.DeadLetter) for _, f in raw.xrange(keys.dead)
        ]
        assert sorted(x.entry_id for x in letters) == sorted(hostile_entry_ids)
        for _fields, rid in hostile:
            if rid is not None:
                (event,) = events_of(raw, keys, rid)
                assert isinstance(event, protocol.ErrorEvent), rid
        # nothing left behind; workers alive; every out stream expires
        assert all_served(raw, keys)
        wait_until(
            lambda: healthy(target, "B") and healthy(target, "A2"),
            START_TIMEOUT_S,
            "B and A2",
        )
        assert workers["B"].poll() is None and workers["A2"].poll() is None
        ttls = [raw.ttl(key) for key in raw.scan_iter(match=keys.out("*"), count=1000)]
        assert ttls and min(ttls) > 0
        restarts = sum(c.num_restarts for c in good + cancelled)
        num_cancelled = reasons.count(FinishReason.CANCELLED)
        num_error_events = sum(rid is not None for _, rid in hostile)
        chaos_summary.extend([
            ("good requests ok (greedy, exactly once)", f"{len(good)} of {cfg.num_requests}, {cfg.max_tokens} tokens each"),
            ("duplicate ids submitted / run twice", f"{cfg.num_duplicates} / 0"),
            ("cancelled mid stream / finished first", f"{num_cancelled} / {len(cancelled) - num_cancelled}"),
            ("hostile entries dead-lettered / with error event", f"{len(letters)} / {num_error_events}"),
            ("of them invalid, reusing a good request's id", str(cfg.num_duplicates)),
            ("faults", "; ".join(faults)),
            ("restarts seen by clients", str(restarts)),
            ("out streams, all with a TTL", str(len(ttls))),
            ("redis", f"{len(keys.shards)}-primary cluster, {len(keys.shards)} shards" if target.cluster else "one server"),
            ("redis used_memory / peak", target.memory()),
            ("wall time", f"{time.monotonic() - started_s:.0f} s"),
        ])  # fmt: skip
        raw.close()
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    for name in ("B", "A2"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text(), name
