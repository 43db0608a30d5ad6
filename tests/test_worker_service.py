"""The worker service against a real Redis: streaming, cancellation, duplicates, Redis restarts.

Workers run in-process (a thread with its own loop) on the tiny llama with a word tokenizer;
the clients are the bundled ``AsyncClient``/``Client``.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from clients import (
    AsyncClient,
    Client,
    DoneEvent,
    ErrorCode,
    FinishReason,
    RequestFailedError,
    RestartEvent,
    TokenEvent,
    protocol,
)
from engine import LLM, SamplingParams
from tests.redis_server import RedisServer
from tests.service_fixtures import WORDS, slow_steps

NUM_CONCURRENT = 50


def random_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS[4:]) for _ in range(rng.randint(3, 20))) for _ in range(count)
    ]


def out_events(server: RedisServer, request_id: str) -> list[protocol.Event]:
    client = server.client()
    rows = client.xrange(protocol.Keys().out(request_id))
    client.close()
    return [protocol.decode_event(fields[b"msg"]) for _, fields in rows]


def test_50_concurrent_streams_match_offline_generate(
    start_worker: Any, redis_server: RedisServer, text_model_dir: Path
) -> None:
    start_worker("w1")
    prompts = random_prompts(NUM_CONCURRENT, seed=1)
    max_tokens = [4 + i % 21 for i in range(NUM_CONCURRENT)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    reference = LLM(str(text_model_dir), device="cpu").generate(prompts, params, use_tqdm=False)

    async def one(client: AsyncClient, prompt: str, n: int) -> tuple[str, list[int], DoneEvent]:
        text, token_ids, seqs, done = "", [], [], None
        async for event in client.stream(prompt, max_tokens=n, temperature=0, timeout_s=120):
            if isinstance(event, TokenEvent):
                text, token_ids = text + event.text, token_ids + event.token_ids
                seqs.append(event.seq)
            assert not isinstance(event, RestartEvent)
            done = event if isinstance(event, DoneEvent) else done
        assert seqs == list(range(len(seqs))), "token events out of order"
        assert done is not None
        return text, token_ids, done

    async def run_all() -> list[tuple[str, list[int], DoneEvent]]:
        async with AsyncClient(redis_server.url) as client:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, max_tokens, strict=True))
            )

    results = asyncio.run(run_all())
    for (text, token_ids, done), ref in zip(results, reference, strict=True):
        assert token_ids == ref.token_ids
        assert text == ref.text
        assert done.finish_reason.value == ref.finish_reason.value
        assert done.usage.completion_tokens == len(ref.token_ids)
        assert done.worker == "w1" and done.timings.queue_ms is not None


def test_cancel_mid_stream_ends_promptly_and_frees_pages(
    start_worker: Any, redis_server: RedisServer
) -> None:
    worker = start_worker("w1")
    slow_steps(worker.engine)  # the cancel lands mid-stream
    pages_free_before = worker.engine.stats().num_pages_free
    with Client(redis_server.url) as client:
        request_id = client.submit("w5 w6 w7", max_tokens=200, ignore_eos=True, temperature=0)
        events = client.resume(request_id, timeout_s=60)
        first = next(events)
        assert isinstance(first, TokenEvent)
        cancelled_at_s = time.monotonic()
        client.cancel(request_id)
        rest = list(events)
    assert time.monotonic() - cancelled_at_s < 5.0
    done = rest[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason is FinishReason.CANCELLED
    assert done.usage.completion_tokens < 200
    assert worker.engine.stats().num_pages_free == pages_free_before
    assert worker.engine.stats().num_running == 0


def test_cancel_before_admission_never_runs(redis_server: RedisServer, start_worker: Any) -> None:
    with Client(redis_server.url) as client:
        request_id = client.submit("w5 w6", max_tokens=50, request_id="early")
        client.cancel(request_id)
        start_worker("w1")
        completion = client.result(request_id, timeout_s=30)
    assert completion.finish_reason is FinishReason.CANCELLED and completion.token_ids == []


def test_duplicate_request_id_runs_once(start_worker: Any, redis_server: RedisServer) -> None:
    with Client(redis_server.url) as client:
        for _ in range(3):
            client.submit(
                "w9 w10 w11", request_id="same", max_tokens=6, temperature=0, ignore_eos=True
            )
        start_worker("w1")
        completion = client.result("same", timeout_s=30)
        assert len(completion.token_ids) == 6
        # The duplicates are acknowledged and dropped: the stream drains, nothing else is written.
        r = redis_server.client()
        deadline_s = time.monotonic() + 10
        while r.xlen(protocol.Keys().requests) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert r.xlen(protocol.Keys().requests) == 0
    events = out_events(redis_server, "same")
    assert sum(isinstance(e, protocol.TERMINAL_EVENTS) for e in events) == 1
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) == 6


def test_deadline_ends_a_request_as_timeout(start_worker: Any, redis_server: RedisServer) -> None:
    start_worker("w1")
    with Client(redis_server.url) as client:
        # The deadline has passed when the worker admits it: the engine ends it at once.
        completion = client.complete("w5", max_tokens=250, ignore_eos=True, timeout_s=0.001)
    assert completion.finish_reason is FinishReason.TIMEOUT


def test_max_tokens_past_the_context_is_an_error_event_and_the_worker_serves_on(
    start_worker: Any, redis_server: RedisServer
) -> None:
    start_worker("w1", engine=dict(max_model_len=32))
    near_full = [5] * 28  # leaves room for 4 tokens
    with Client(redis_server.url) as client:
        running = client.submit("w5 w6", max_tokens=20, temperature=0, ignore_eos=True)
        with pytest.raises(RequestFailedError) as error:
            client.complete(token_ids=near_full, max_tokens=10, timeout_s=30)
        assert (error.value.code, error.value.field) == (ErrorCode.INVALID_REQUEST, "max_tokens")
        assert "context is 32 tokens; the prompt has 28" in error.value.message
        assert "at most 4" in error.value.message
        assert len(client.result(running, timeout_s=30).token_ids) == 20  # unaffected
        # asked to clamp, or no max_tokens at all: as many as fit
        for options in (dict(max_tokens=10, clamp_max_tokens=True), {}):
            done = client.complete(token_ids=near_full, ignore_eos=True, timeout_s=30, **options)
            assert (len(done.token_ids), done.finish_reason) == (4, FinishReason.LENGTH)
        after = client.complete("w7 w8", max_tokens=3, ignore_eos=True, timeout_s=30)
    assert len(after.token_ids) == 3


def test_redis_restart_mid_run_every_request_completes(
    start_worker: Any, redis_server: RedisServer
) -> None:
    slow_steps(start_worker("w1").engine, 0.01)  # 120 steps outlast the restart at 0.3 s
    prompts = random_prompts(8, seed=2)

    async def run_all() -> list[Any]:
        async with AsyncClient(redis_server.url) as client:
            ids = [
                await client.submit(p, max_tokens=120, ignore_eos=True, temperature=0)
                for p in prompts
            ]
            results = [asyncio.create_task(client.result(i, timeout_s=120)) for i in ids]
            await asyncio.sleep(0.3)
            await asyncio.to_thread(redis_server.restart, 0.5)
            return await asyncio.gather(*results)

    completions = asyncio.run(run_all())
    for completion in completions:
        assert completion.finish_reason is FinishReason.LENGTH
        assert len(completion.token_ids) == 120


def test_out_streams_expire_after_the_request(start_worker: Any, redis_server: RedisServer) -> None:
    start_worker("w1")
    with Client(redis_server.url) as client:
        client.complete("w9 w10", request_id="ttl", max_tokens=8, ignore_eos=True, timeout_s=30)
    ttl_s = redis_server.client().ttl(protocol.Keys().out("ttl"))
    # set on the first event and refreshed by the terminal one: a full TTL from the end
    assert protocol.OUT_STREAM_TTL_S - 60 < ttl_s <= protocol.OUT_STREAM_TTL_S


def test_a_live_stream_refreshes_its_ttl_once_per_half_ttl() -> None:
    from worker.events import TTL_REFRESH_S, InFlight

    flight = InFlight.__new__(InFlight)
    flight.ttl_refreshed_s = None
    assert flight.ttl_due(100.0)  # the first event sets it
    assert not flight.ttl_due(100.0 + TTL_REFRESH_S - 1)
    assert flight.ttl_due(100.0 + TTL_REFRESH_S)
    assert not flight.ttl_due(100.0 + TTL_REFRESH_S + 1)


def test_a_refused_event_write_spares_the_other_requests(
    start_worker: Any, redis_server: RedisServer
) -> None:
    keys = protocol.Keys()
    r = redis_server.client()
    r.set(keys.out("squatted"), "not a stream")  # every event write for this id is refused

    async def run_both() -> Any:
        async with AsyncClient(redis_server.url) as client:
            await client.submit("w3 w4", request_id="squatted", max_tokens=6, ignore_eos=True)
            return await client.complete(
                "w5 w6", request_id="fine", max_tokens=6, ignore_eos=True, timeout_s=60
            )

    start_worker("w1")
    completion = asyncio.run(run_both())
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.token_ids) == 6
    deadline_s = time.monotonic() + 30
    while r.xlen(keys.requests) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert r.xlen(keys.requests) == 0  # both entries acknowledged and deleted, none retried
    assert r.get(keys.out("squatted")) == b"not a stream"
    r.close()


def test_a_full_redis_delays_events_and_loses_none(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """Under ``maxmemory`` with ``noeviction`` Redis refuses every event write: the worker keeps
    them and retries, so the caller gets every token and one ``done``, later."""
    keys = protocol.Keys()
    r = redis_server.client()
    num_tokens = 120

    async def fill_up_mid_request() -> Any:
        async with AsyncClient(redis_server.url) as client:
            task = asyncio.create_task(
                client.complete("w5 w6", request_id="r", max_tokens=num_tokens, ignore_eos=True,
                                temperature=0, timeout_s=60)
            )  # fmt: skip
            while not r.exists(keys.out("r")):
                await asyncio.sleep(0.01)
            r.config_set("maxmemory", 1)  # full: every XADD is refused with OOM from here
            await asyncio.sleep(1.0)
            refused_meanwhile = r.xlen(keys.out("r"))
            r.config_set("maxmemory", 0)
            return await task, refused_meanwhile

    # 120 steps of 20 ms: the request outlasts the second that Redis is full
    slow_steps(start_worker("w1").engine)
    completion, written_while_full = asyncio.run(fill_up_mid_request())
    assert completion.finish_reason is FinishReason.LENGTH and completion.num_restarts == 0
    assert len(completion.token_ids) == num_tokens
    events = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(keys.out("r"))]
    assert written_while_full < len(events)  # some events did wait for memory
    assert sum(isinstance(e, protocol.TERMINAL_EVENTS) for e in events) == 1
    seqs = [e.seq for e in events if isinstance(e, protocol.TokenEvent)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
    deadline_s = time.monotonic() + 10
    while r.xlen(keys.requests) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert r.xlen(keys.requests) == 0  # acknowledged once its done event was written
    r.close()
