"""Delivery guarantees: bad entries dead-lettered while the worker serves on, takeover of a dead
worker's entries with ``restart``, ``max_deliveries``, and hand-back on shutdown."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients import (
    Client,
    ErrorCode,
    FinishReason,
    RequestFailedError,
    RestartEvent,
    TokenEvent,
    protocol,
)
from tests.gateway_fixtures import wait_for
from tests.redis_server import RedisServer
from tests.service_fixtures import WORDS, slow_steps
from worker.delivery import Entry, OutEvent, Ownership, RequestStream

KEYS = protocol.Keys()
GOOD = dict(max_tokens=6, temperature=0, ignore_eos=True)
MAX_PROMPT_TOKENS = 8
MAX_OUTPUT_TOKENS = 64


def pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def good(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": request_id, "prompt": "w5 w6 w7", **fields}


# name: (entry fields, request id (None: unreadable), words the error message must hold)
BAD_ENTRIES: dict[str, tuple[dict[str, bytes], str | None, list[str]]] = {
    "no payload field": ({"other": b"x"}, None, ["no 'msg' field"]),
    "not msgpack": ({"msg": b"\xc1\xc1"}, None, ["not a msgpack request"]),
    "not a map": ({"msg": pack([1, 2, 3])}, None, ["Expected `object`"]),
    "no id": ({"msg": pack({"prompt": "w5"})}, None, ["id"]),
    "wrong type": ({"msg": pack(good("r-type", max_tokens="ten"))}, "r-type", ["max_tokens", "int"]),
    "temperature a string": (
        {"msg": pack(good("r-hot", temperature="hot"))}, "r-hot", ["temperature", "Expected `float`, got `str`"],
    ),
    "unknown field": ({"msg": pack(good("r-unknown", colour="red"))}, "r-unknown", ["colour"]),
    "no samples": ({"msg": pack(good("r-n", n=0))}, "r-n", ["n", ">= 1"]),
    "best_of below n": ({"msg": pack(good("r-best", n=3, best_of=2))}, "r-best", ["best_of", ">= n"]),
    "tools without messages": (
        {"msg": pack(good("r-tools", tools=[{"type": "function"}]))}, "r-tools", ["tools", "messages only"],
    ),
    "prompt over the limit": (
        {"msg": pack(good("r-long", prompt=" ".join(WORDS[4:24])))}, "r-long",
        ["prompt", f"at most {MAX_PROMPT_TOKENS}"],
    ),
    "prompt over the context": (
        {"msg": pack({"id": "r-ctx", "token_ids": [5] * 300})}, "r-ctx", ["prompt", "model context"],
    ),
    "max_tokens over the limit": (
        {"msg": pack(good("r-max", max_tokens=1000))}, "r-max", ["max_tokens", str(MAX_OUTPUT_TOKENS)],
    ),
    "invalid temperature": ({"msg": pack(good("r-temp", temperature=-1))}, "r-temp", ["temperature", ">= 0"]),
    "invalid top_p": ({"msg": pack(good("r-topp", top_p=0))}, "r-topp", ["top_p"]),
    "two prompts": ({"msg": pack(good("r-two", token_ids=[5, 6]))}, "r-two", ["exactly one"]),
    "token id past the vocabulary": (
        {"msg": pack({"id": "r-vocab", "token_ids": [5, 10_000]})}, "r-vocab", ["token_ids", "10000"],
    ),
    "future schema": ({"msg": pack(good("r-v2", v=2))}, "r-v2", ["schema version 2"]),
    "empty prompt": ({"msg": pack(good("r-empty", prompt=""))}, "r-empty", ["prompt", "empty"]),
    "session too long": ({"msg": pack(good("r-sess", session="s" * 300))}, "r-sess", ["session", "printable"]),
}  # fmt: skip


def dead_letters(server: RedisServer) -> list[protocol.DeadLetter]:
    r = server.client()
    rows = r.xrange(KEYS.dead)
    r.close()
    return [protocol.decode_struct(f[b"msg"], protocol.DeadLetter) for _, f in rows]


@pytest.fixture
def strict_worker(start_worker: Any) -> Any:
    return start_worker(
        "w1",
        limits=protocol_limits(),
        engine=dict(max_model_len=256),
    )


def protocol_limits() -> Any:
    from worker.settings import RequestLimits

    return RequestLimits(max_prompt_tokens=MAX_PROMPT_TOKENS, max_output_tokens=MAX_OUTPUT_TOKENS)


def test_every_kind_of_bad_entry_is_dead_lettered_and_the_worker_serves_on(
    strict_worker: Any, redis_server: RedisServer
) -> None:
    r = redis_server.client()
    with Client(redis_server.url) as client:
        running = client.submit("w5 w6", request_id="running", max_tokens=40, ignore_eos=True)
        for fields, _, _ in BAD_ENTRIES.values():
            r.xadd(KEYS.requests, fields)
        # Hostile: a bad entry reusing a running request's id must not touch its stream.
        r.xadd(KEYS.requests, {"msg": pack(good("running", max_tokens="x"))})
        for name, (_, request_id, words) in BAD_ENTRIES.items():
            if request_id is None:
                continue
            with pytest.raises(RequestFailedError) as error:
                client.result(request_id, timeout_s=30)
            assert error.value.code is ErrorCode.INVALID_REQUEST, name
            for word in words:
                assert word in error.value.message, (name, error.value.message)
        assert len(client.result(running, timeout_s=30).token_ids) == 40
        after = client.complete("w8 w9", request_id="after", **GOOD)
    assert len(after.token_ids) == 6
    letters = dead_letters(redis_server)
    assert len(letters) == len(BAD_ENTRIES) + 1
    unreadable = [letter for letter in letters if letter.request_id is None]
    assert len(unreadable) == sum(rid is None for _, rid, _ in BAD_ENTRIES.values())
    (hostile,) = [letter for letter in letters if letter.request_id == "running"]
    assert "no error event written" in hostile.message  # the running request's stream is its own
    assert all(letter.message and letter.worker == "w1" for letter in letters)
    r.close()


def test_a_request_that_asks_to_clamp_is_lowered_to_the_workers_limit(
    strict_worker: Any, redis_server: RedisServer
) -> None:
    with Client(redis_server.url) as client:
        done = client.complete("w5 w6", max_tokens=1000, clamp_max_tokens=True, timeout_s=30,
                               ignore_eos=True)  # fmt: skip
    assert (len(done.token_ids), done.finish_reason) == (MAX_OUTPUT_TOKENS, FinishReason.LENGTH)


def test_random_bytes_never_stop_the_worker(start_worker: Any, redis_server: RedisServer) -> None:
    start_worker("w1")
    r = redis_server.client()
    sent: list[bytes] = []

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.binary(max_size=200),
        st.dictionaries(st.binary(max_size=8), st.binary(max_size=40), max_size=3),
    )
    def send(payload: bytes, extra: dict[bytes, bytes]) -> None:
        r.xadd(KEYS.requests, {**extra, b"msg": payload})
        sent.append(payload)

    send()
    with Client(redis_server.url) as client:
        assert len(client.complete("w5 w6", **GOOD).token_ids) == 6
    deadline_s = time.monotonic() + 20
    while len(dead_letters(redis_server)) < len(sent) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert sorted(letter.payload or b"" for letter in dead_letters(redis_server)) == sorted(sent)
    r.close()


def ghost_reads(server: RedisServer, request_id: str, *, times: int = 1) -> str:
    """A worker that reads a request, writes a token, and dies (``times`` deliveries)."""
    r = server.client()
    r.xgroup_create(KEYS.requests, KEYS.group, "0", mkstream=True)
    with Client(server.url) as client:
        client.submit("w5 w6 w7", request_id=request_id, **GOOD)
    entry_id = r.xreadgroup(KEYS.group, "ghost", {KEYS.requests: ">"})[0][1][0][0].decode()
    for _ in range(times - 1):
        r.xclaim(KEYS.requests, KEYS.group, "ghost", 0, [entry_id])
    r.set(KEYS.claim(request_id), entry_id)
    partial = protocol.TokenEvent(seq=0, text="w99", token_ids=[99])
    r.xadd(KEYS.out(request_id), {"msg": protocol.encode(partial)})
    r.close()
    return entry_id


def test_a_dead_workers_entry_is_taken_over_with_restart(
    start_worker: Any, redis_server: RedisServer
) -> None:
    ghost_reads(redis_server, "orphan")
    start_worker("w1")
    with Client(redis_server.url) as client:
        events = list(client.resume("orphan", timeout_s=30))
        reference = client.complete("w5 w6 w7", **GOOD)
    restarts = [e for e in events if isinstance(e, RestartEvent)]
    assert len(restarts) == 1 and restarts[0].worker == "w1" and restarts[0].attempt == 1
    after = events[events.index(restarts[0]) + 1 :]
    assert [
        t for e in after if isinstance(e, TokenEvent) for t in e.token_ids
    ] == reference.token_ids
    with Client(redis_server.url) as client:
        completion = client.result("orphan", timeout_s=5)
    assert completion.num_restarts == 1 and completion.token_ids == reference.token_ids


def test_a_redelivered_entry_refused_at_admission_gets_one_error_and_no_restart(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """A worker died holding a request that admission refuses (max_tokens over the limit): its
    second delivery writes the error alone, as a first delivery would, not a restart first."""
    r = redis_server.client()
    r.xgroup_create(KEYS.requests, KEYS.group, "0", mkstream=True)
    r.xadd(KEYS.requests, {"msg": pack(good("r-retry-max", max_tokens=1000))})
    entry_id = r.xreadgroup(KEYS.group, "ghost", {KEYS.requests: ">"})[0][1][0][0].decode()
    r.set(KEYS.claim("r-retry-max"), entry_id)  # the ghost owned it: this delivery is a retry
    start_worker("w1", limits=protocol_limits())
    deadline_s = time.monotonic() + 30
    while not dead_letters(redis_server) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    (letter,) = dead_letters(redis_server)
    assert letter.request_id == "r-retry-max" and letter.times_delivered == 2
    events = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(KEYS.out("r-retry-max"))]
    r.close()
    (event,) = events
    assert isinstance(event, protocol.ErrorEvent) and "max_tokens" in event.message


def test_too_many_deliveries_goes_to_the_dead_stream(
    start_worker: Any, redis_server: RedisServer
) -> None:
    ghost_reads(redis_server, "cursed", times=3)
    start_worker("w1", max_deliveries=3)
    with Client(redis_server.url) as client, pytest.raises(RequestFailedError) as error:
        client.result("cursed", timeout_s=30)
    assert error.value.code is ErrorCode.TOO_MANY_DELIVERIES
    # the letter follows the error event the client already saw
    (letter,) = wait_for(lambda: dead_letters(redis_server))
    assert letter.request_id == "cursed" and letter.times_delivered == 4


def test_shutdown_hands_back_unfinished_work(start_worker: Any, redis_server: RedisServer) -> None:
    first = start_worker("w1", grace_s=0.0)
    slow_steps(first.engine)  # the stop lands mid-request
    with Client(redis_server.url) as client:
        request_id = client.submit("w5", max_tokens=250, ignore_eos=True, temperature=0)
        events = client.resume(request_id, timeout_s=60)
        assert isinstance(next(events), TokenEvent)
        first.stop()
        start_worker("w2")
        completion = client.result(request_id, timeout_s=60)
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.token_ids) == 250
    assert completion.num_restarts == 1


def test_an_oversized_entry_is_refused_by_size_and_its_payload_not_kept(
    start_worker: Any, redis_server: RedisServer
) -> None:
    from worker.settings import RequestLimits

    start_worker("w1", limits=RequestLimits(max_entry_bytes=1024))
    big = pack(good("r-big", prompt=" ".join(["w5"] * 2000)))
    r = redis_server.client()
    r.xadd(KEYS.requests, {"msg": big})
    with Client(redis_server.url) as client:
        with pytest.raises(RequestFailedError) as error:
            client.result("r-big", timeout_s=30)
        after = client.complete("w8 w9", request_id="after", **GOOD)
    assert error.value.code is ErrorCode.MALFORMED
    assert f"payload is {len(big)} bytes; this worker accepts at most 1024" in error.value.message
    (letter,) = dead_letters(redis_server)
    assert (letter.request_id, letter.payload) == ("r-big", None)  # the size is in the message
    assert len(after.token_ids) == 6
    r.close()


def test_an_undecodable_entry_with_a_readable_id_names_it() -> None:
    # Invalid UTF-8 after the id, or nesting past msgspec's limit: the caller of that id
    # must get its error event, so the worker must read the id.
    from worker.admission import MalformedEntry, decode_entry
    from worker.settings import RequestLimits

    head = b"\x83" + pack("v") + pack(1) + pack("id") + pack("r-odd")
    invalid_utf8 = head + pack("prompt") + b"\xa2\xff\xfe"
    deep = head + pack("messages") + b"\x91" * 20_000 + pack("x")
    for payload, code in ((invalid_utf8, ErrorCode.MALFORMED), (deep, ErrorCode.INVALID_REQUEST)):
        with pytest.raises(MalformedEntry) as error:
            decode_entry({b"msg": payload}, RequestLimits())
        assert (error.value.request_id, error.value.code) == ("r-odd", code)


def test_a_worker_whose_lease_was_taken_over_writes_and_acknowledges_nothing(
    redis_server: RedisServer,
) -> None:
    """Fencing: a stalled worker (or one cut off while Redis restarted) whose entry another
    worker took over cannot write after the new owner's ``restart`` nor acknowledge its entry."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        stalled, taker = RequestStream(r, KEYS, "stalled"), RequestStream(r, KEYS, "taker")
        await stalled.ensure_group()
        entry_id = (await r.xadd(KEYS.requests, {"msg": b"x"})).decode()
        await r.xreadgroup(KEYS.group, "stalled", {KEYS.requests: ">"}, count=1)
        entry = Entry(entry_id, {})
        assert await stalled.own("fenced", entry) is Ownership.NEW
        await r.xautoclaim(KEYS.requests, KEYS.group, "taker", 0, "0-0")
        token = OutEvent("fenced", entry_id, b"token", True)
        # Taken over but not yet run: the stalled worker's token still lands (before the
        # new owner's restart); its acknowledgement does not.
        published = await stalled.publish([token], acks=[("", entry_id)])
        assert published.lost == [("", entry_id)] and await r.xlen(KEYS.out("fenced")) == 1
        assert await taker.own("fenced", entry) is Ownership.RETRY  # the claim moves
        published = await stalled.publish([token, token], acks=[("", entry_id)])
        assert published.lost == [("", entry_id)] and published.unwritten == []
        assert await r.xlen(KEYS.out("fenced")) == 1
        pending = await r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 10)
        assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
            (entry_id, "taker")
        ]
        published = await taker.publish([token], acks=[("", entry_id)])  # the owner writes and acks
        assert published.lost == [] and await r.xlen(KEYS.out("fenced")) == 2
        assert await r.xpending(KEYS.requests, KEYS.group) == {
            "pending": 0, "min": None, "max": None, "consumers": []
        }  # fmt: skip
        await r.aclose()

    asyncio.run(scenario())


def test_a_write_sent_again_after_its_reply_was_lost_writes_no_second_end(
    redis_server: RedisServer,
) -> None:
    """Redis killed after it ran a write but before the reply came back (or the
    acknowledgement after it failed): the worker sends the same call again. The terminal
    event's mark on the claim keeps the resend from writing a second end (the chaos run saw
    two ``done`` events), and the entry is still this worker's to acknowledge."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        worker = RequestStream(r, KEYS, "w")
        await worker.ensure_group()
        entry_id = (await r.xadd(KEYS.requests, {"msg": b"x"})).decode()
        await r.xreadgroup(KEYS.group, "w", {KEYS.requests: ">"}, count=1)
        assert await worker.own("twice", Entry(entry_id, {})) is Ownership.NEW
        events = [
            OutEvent("twice", entry_id, b"token", True),
            OutEvent("twice", entry_id, b"done", True, terminal=True),
        ]
        first = await worker.publish(events, acks=[])  # the reply "lost": no ack yet
        assert (first.lost, first.unwritten) == ([], [])
        again = await worker.publish(events, acks=[("", entry_id)])
        assert (again.lost, again.unwritten) == ([], [])
        assert [m[b"msg"] for _, m in await r.xrange(KEYS.out("twice"))] == [b"token", b"done"]
        assert await r.xpending(KEYS.requests, KEYS.group) == {
            "pending": 0, "min": None, "max": None, "consumers": []
        }  # fmt: skip
        # a takeover of the finished entry still counts as a retry (and finds the end written)
        assert await RequestStream(r, KEYS, "v").own("twice", Entry(entry_id, {})) is (
            Ownership.RETRY
        )
        await r.aclose()

    asyncio.run(scenario())


def test_an_entry_dead_lettered_twice_has_one_letter(redis_server: RedisServer) -> None:
    """The chaos run's hostile entries: the letter's call sent again after Redis died, or
    a redelivery of an entry already dead-lettered, leaves one letter (and the entry gone)."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        worker = RequestStream(r, KEYS, "w")
        await worker.ensure_group()
        entry_id = (await r.xadd(KEYS.requests, {"msg": b"junk"})).decode()
        await r.xreadgroup(KEYS.group, "w", {KEYS.requests: ">"}, count=1)
        letter = protocol.DeadLetter(
            entry_id=entry_id, code=ErrorCode.INVALID_REQUEST, message="bad", worker="w",
            payload=b"junk",
        )  # fmt: skip
        await worker.dead_letter(Entry(entry_id, {}), letter)
        await worker.dead_letter(Entry(entry_id, {}), letter)
        assert await r.xlen(KEYS.dead) == 1
        assert await r.xlen(KEYS.requests) == 0
        await r.aclose()

    asyncio.run(scenario())


def test_restarts_are_numbered_and_say_why_across_hand_backs(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """Handing back keeps the entry's delivery count (it is no failure), so the attempt is the
    request's own count: two hand-backs are attempts 1 and 2, each saying it was handed back."""
    first = start_worker("w1", grace_s=0.0)
    slow_steps(first.engine)
    with Client(redis_server.url) as client:
        request_id = client.submit("w5", max_tokens=250, ignore_eos=True, temperature=0)
        events = client.resume(request_id, timeout_s=60)
        assert isinstance(next(events), TokenEvent)
        first.stop()
        second = start_worker("w2", grace_s=0.0)
        slow_steps(second.engine)
        next(e for e in events if isinstance(e, RestartEvent))  # w2 took it over
        assert isinstance(next(events), TokenEvent)  # and runs it
        second.stop()
        start_worker("w3")
        completion = client.result(request_id, timeout_s=60)
        restarts = [e for e in client.resume(request_id) if isinstance(e, RestartEvent)]
    assert len(completion.token_ids) == 250 and completion.num_restarts == 2
    assert [(r.attempt, r.worker, r.reason) for r in restarts] == [
        (1, "w2", "handed back"), (2, "w3", "handed back"),
    ]  # fmt: skip


def test_a_duplicate_of_an_answer_whose_events_expired_gets_an_error(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """Past the out stream's TTL (an hour) and within the claim's (a day), an id sent again
    cannot be read back: its caller gets an error saying so, not a wait for ever."""
    start_worker("w1")
    with Client(redis_server.url) as client:
        first = client.complete("w5 w6", request_id="once", **GOOD)
        assert len(first.token_ids) == 6
        r = redis_server.client()
        r.delete(KEYS.out("once"))  # what the TTL does after an hour
        r.close()
        with pytest.raises(RequestFailedError) as error:
            client.complete("w5 w6", request_id="once", timeout_s=30, **GOOD)
    assert error.value.field == "id" and "expired" in error.value.message
