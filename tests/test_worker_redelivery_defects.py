"""Two defects a chaos run found (issue 31, item 6), each pinned by a test.

- A request whose worker died after streaming tokens, cancelled before another worker took it
  over: its stream must say that the dead attempt's tokens do not count (``restart`` before
  ``done``), and ``complete()`` must return none of them.
- An entry that decodes but is invalid, reusing the id of a running request: dead-lettered
  (never acknowledged and dropped as a duplicate), without an event in the running request's
  stream.
"""

from __future__ import annotations

import time
from typing import Any

from clients import Client, FinishReason, RestartEvent, TokenEvent, protocol
from tests.gateway_fixtures import wait_for
from tests.redis_server import RedisServer
from tests.test_worker_delivery import GOOD, KEYS, dead_letters, ghost_reads, good, pack
from worker.requests import DUPLICATE_NOTE


def out_events(server: RedisServer, request_id: str) -> list[protocol.Event]:
    r = server.client()
    rows = r.xrange(KEYS.out(request_id))
    r.close()
    return [protocol.decode_event(fields[b"msg"]) for _, fields in rows]


def test_a_dead_workers_request_cancelled_before_takeover_ends_with_restart_then_done(
    start_worker: Any, redis_server: RedisServer
) -> None:
    ghost_reads(redis_server, "orphan-cancelled")  # one token (w99) streamed, then it died
    with Client(redis_server.url) as client:
        client.cancel("orphan-cancelled")
        start_worker("w1")
        completion = client.result("orphan-cancelled", timeout_s=30)
    events = out_events(redis_server, "orphan-cancelled")
    kinds = [type(event).__name__ for event in events]
    assert kinds == ["TokenEvent", "RestartEvent", "DoneEvent"], kinds
    restart, done = events[1], events[2]
    assert isinstance(restart, RestartEvent) and restart.worker == "w1" and restart.attempt == 1
    assert isinstance(done, protocol.DoneEvent)
    assert done.finish_reason is FinishReason.CANCELLED
    assert done.usage.completion_tokens == 0  # the tokens after the last restart: none
    assert completion.finish_reason is FinishReason.CANCELLED
    assert (completion.token_ids, completion.text, completion.num_restarts) == ([], "", 1)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(completion.token_ids)


def test_an_invalid_entry_reusing_a_running_id_is_dead_lettered_without_touching_its_stream(
    start_worker: Any, redis_server: RedisServer
) -> None:
    start_worker("w1")
    r = redis_server.client()
    with Client(redis_server.url) as client:
        running = client.submit("w5 w6", request_id="running", max_tokens=60, ignore_eos=True,
                                temperature=0)  # fmt: skip
        events = client.resume(running, timeout_s=30)
        assert isinstance(next(events), TokenEvent)  # it runs
        hostile_id = r.xadd(KEYS.requests, {"msg": pack(good("running", max_tokens=-5))})
        deadline_s = time.monotonic() + 30
        while not dead_letters(redis_server) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        completion = client.result(running, timeout_s=30)
        reference = client.complete("w5 w6", max_tokens=60, ignore_eos=True, temperature=0)
    (letter,) = dead_letters(redis_server)
    assert (letter.entry_id, letter.request_id) == (hostile_id.decode(), "running")
    assert letter.code is protocol.ErrorCode.INVALID_REQUEST
    assert "max_tokens" in letter.message and DUPLICATE_NOTE in letter.message
    # the running request's stream: its own tokens and one done, no foreign error
    kinds = {type(event).__name__ for event in out_events(redis_server, "running")}
    assert kinds == {"TokenEvent", "DoneEvent"}
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.token_ids == reference.token_ids
    # acknowledged and deleted just after the terminal events the client saw
    assert wait_for(
        lambda: r.xlen(KEYS.requests) == 0 and r.xpending(KEYS.requests, KEYS.group)["pending"] == 0
    )
    r.close()


def test_a_valid_resubmission_of_a_running_id_is_still_dropped_without_a_letter(
    start_worker: Any, redis_server: RedisServer
) -> None:
    """The other side of the order: validation first must not dead-letter a valid duplicate."""
    start_worker("w1")
    with Client(redis_server.url) as client:
        client.submit("w5 w6", request_id="twice", **GOOD)
        client.submit("w5 w6", request_id="twice", **GOOD)
        completion = client.result("twice", timeout_s=30)
    assert len(completion.token_ids) == GOOD["max_tokens"]
    terminals = [e for e in out_events(redis_server, "twice") if isinstance(e, protocol.DoneEvent)]
    assert len(terminals) == 1 and dead_letters(redis_server) == []
