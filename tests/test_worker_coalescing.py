"""A request's tokens that are ready together go out as one event (issue 31, item 5): when Redis
is slower than the engine, the steps that waited are written as one ``token`` event per request
(one ``XADD``), never delaying the first token."""

from __future__ import annotations

import threading
from typing import Any

from clients import Client, TokenEvent, protocol
from engine import FinishReason, StepOutput
from engine.sampler import TokenLogprobs
from engine.sequence import Usage
from tests.redis_server import RedisServer
from tests.service_fixtures import slow_steps
from worker.events import coalesce

KEYS = protocol.Keys()


def test_outputs_of_one_request_merge_in_order_and_others_stay_apart() -> None:
    outputs = [
        StepOutput("a", [1], "x", [None], finished=False),
        StepOutput("b", [7], "q", [None], finished=False),
        StepOutput("a", [2, 3], "yz", [None, None], finished=False),
        StepOutput("a", [4], "w", [None], finished=True, finish_reason=FinishReason.LENGTH,
                   stop_reason=None, usage=Usage(3, 4, 0)),
    ]  # fmt: skip
    a, b = coalesce(outputs)
    assert (a.request_id, a.new_token_ids, a.text_delta, len(a.logprobs)) == (
        "a",
        [1, 2, 3, 4],
        "xyzw",
        4,
    )
    assert a.finished and a.finish_reason is FinishReason.LENGTH and a.usage == Usage(3, 4, 0)
    assert (b.request_id, b.new_token_ids, b.finished) == ("b", [7], False)
    single = [StepOutput("c", [5], "v", [None], finished=False)]
    assert coalesce(single) == single  # one step's output is written as it is


def test_samples_of_one_request_merge_each_on_its_own() -> None:
    """n > 1: each sample's tokens merge, never into another sample's event; a sample's end
    keeps its finish reason."""
    outputs = [
        StepOutput("a", [1], "x", [None], finished=False, index=0),
        StepOutput("a", [9], "p", [None], finished=False, index=1),
        StepOutput("a", [2], "y", [None], finished=False, index=0,
                   finish_reason=FinishReason.STOP, sample_finished=True),
        StepOutput("a", [8], "q", [None], finished=False, index=1),
    ]  # fmt: skip
    merged = coalesce(outputs)
    assert [(o.index, o.new_token_ids, o.text_delta) for o in merged] == [
        (0, [1, 2], "xy"),
        (1, [9, 8], "pq"),
    ]
    assert merged[0].sample_finished and merged[0].finish_reason is FinishReason.STOP
    assert not merged[1].sample_finished


def test_outputs_with_logprobs_stay_one_event_per_step() -> None:
    """The gateway names a token by the text of an event that carried it alone."""
    entry = TokenLogprobs(token_id=5, logprob=-0.5, top=())
    outputs = [
        StepOutput("a", [5], "x", [entry], finished=False),
        StepOutput("a", [6], "y", [entry], finished=True, finish_reason=FinishReason.LENGTH),
    ]
    assert coalesce(outputs) == outputs


FIRST_EVENT_MAX_TOKENS = 8  # far below the 0.5 s stall's merge, which takes dozens


def test_tokens_that_waited_for_a_stalled_redis_go_out_as_one_event(
    start_worker: Any, redis_server: RedisServer
) -> None:
    # 200 steps of 5 ms: the stall begins before the request ends, and the writer keeps up
    slow_steps(start_worker("w1").engine, 0.005)
    max_tokens = 200
    with Client(redis_server.url) as client:
        reference = client.complete("w5 w6", max_tokens=max_tokens, ignore_eos=True, temperature=0)
        request_id = client.submit("w5 w6", max_tokens=max_tokens, ignore_eos=True, temperature=0)
        events = client.resume(request_id, timeout_s=60)
        first = next(events)
        # Redis stalls for 0.5 s (its only thread sleeps) while the engine keeps stepping.
        stalling = redis_server.client()
        stall = threading.Thread(target=stalling.execute_command, args=("DEBUG", "SLEEP", "0.5"))
        stall.start()
        rest = list(events)
        stall.join()
        stalling.close()
        completion = client.result(request_id, timeout_s=60)
    tokens = [e for e in [first, *rest] if isinstance(e, TokenEvent)]
    # the first goes out at once: one token, or the few that were ready when the write ran if
    # other work on this machine (a parallel test process) kept the writer from running first
    assert isinstance(first, TokenEvent) and len(first.token_ids) <= FIRST_EVENT_MAX_TOKENS
    assert [e.seq for e in tokens] == list(range(len(tokens)))
    assert max(len(e.token_ids) for e in tokens) > 1  # the stall's steps: one event
    assert len(tokens) < max_tokens
    assert completion.token_ids == reference.token_ids and len(completion.token_ids) == max_tokens
    assert completion.usage is not None and completion.usage.completion_tokens == max_tokens
