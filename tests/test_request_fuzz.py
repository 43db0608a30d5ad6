"""Random request bodies through every layer that reads them: each is run or refused, clearly.

Hypothesis writes OpenAI bodies from each endpoint's fields, with values that are right,
nearly right (out of range, wrong sign, huge integers, NaN) or of another type, plus unknown
fields. Each body takes the path a request takes through the gateway, the Redis protocol, the
worker and the engine:

    decode_completion / decode_chat   -> a Generation, or an OpenAIError 400
    Request(**inputs), encoded        -> what AsyncClient.submit writes to the stream
    decode_entry                      -> the worker's Request, or MalformedEntry
    engine_inputs, add_request        -> an admitted request, or InvalidRequestError
    two engine steps                  -> tokens, or a finished request

Stream entries written without the gateway (the Python clients, or anyone with XADD) take the
worker's half of that path: msgpack maps of the protocol's fields, integers up to 2**64 - 1.

Nothing else may be raised at any stage: an exception of another type is a request that would
be a 500 in the gateway or a failed engine step (every request in it lost). A refusal names a
field of the request. What the gateway accepts the protocol encodes. It found two: a seed of
2**64 through the gateway (a 500), a top_k of 2**63 in an entry (the step failed).

``PAGESTREAM_FUZZ_EXAMPLES=N`` runs N bodies a test instead of 300.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients import protocol
from engine import EngineConfig, InvalidRequestError, LLMEngine
from worker.admission import MalformedEntry, decode_entry, engine_inputs
from worker.gateway.errors import OpenAIError
from worker.gateway.translate import decode_chat, decode_completion
from worker.settings import RequestLimits

WORDS = ["paris", "hello", "world", "w5", "w6", "is"]  # in the tiny text model's vocabulary
LIMITS = RequestLimits(max_prompt_tokens=48, max_output_tokens=64)
CHAT_MAX_TOKENS = 8

# Values of every type, the troublesome ones often: integers at and past 64 bits, NaN and the
# infinities (json.dumps writes them; they are not JSON), empty and nested containers.
BIG_INTS = st.sampled_from([-(2**63) - 1, -(2**63), -1, 0, 2**31, 2**63 - 1, 2**63, 2**64, 2**70])
WIRE_BIG_INTS = st.sampled_from([-(2**63), 2**63 - 1, 2**63, 2**64 - 1])  # msgpack's range


def any_value(big_ints: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-5, 300), big_ints,
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS),
        st.text(max_size=8),
    )  # fmt: skip
    keys = st.sampled_from(["type", "text", "role", "content", "x"])
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3)
        ),
        max_leaves=8,
    )


ANY_JSON, ANY_WIRE = any_value(BIG_INTS), any_value(WIRE_BIG_INTS)


def sometimes_right(
    right: st.SearchStrategy[Any], anything: st.SearchStrategy[Any] | None = None
) -> st.SearchStrategy[Any]:
    """A plausible value of the field (which may still be out of range), one time in 16
    ``anything``: a body of eight fields then gets through the gateway's types half the time."""
    other = ANY_JSON if anything is None else anything
    return st.integers(0, 15).flatmap(lambda pick: other if pick == 0 else right)


TEXT = st.lists(st.sampled_from(WORDS), min_size=0, max_size=6).map(" ".join)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 40), st.integers(-3, 400), BIG_INTS), max_size=8)
COMMON = {
    "model": sometimes_right(st.sampled_from(["", "llama"])),
    "max_tokens": sometimes_right(st.integers(-2, 80)),
    "temperature": sometimes_right(st.floats(-1, 3)),
    "top_p": sometimes_right(st.floats(-0.5, 1.5)),
    "top_k": sometimes_right(st.integers(-2, 50)),
    "min_p": sometimes_right(st.floats(-0.5, 1.5)),
    "seed": sometimes_right(st.one_of(st.integers(-10, 10**6), BIG_INTS)),
    "presence_penalty": sometimes_right(st.floats(-3, 3)),
    "frequency_penalty": sometimes_right(st.floats(-3, 3)),
    "repetition_penalty": sometimes_right(st.floats(-1, 3)),
    "min_tokens": sometimes_right(st.integers(-2, 80)),
    "ignore_eos": sometimes_right(st.booleans()),
    "stop": sometimes_right(st.one_of(TEXT, st.lists(TEXT, max_size=5))),
    "n": sometimes_right(st.integers(0, 3)),
    "stream": sometimes_right(st.booleans()),
    "stream_options": sometimes_right(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": sometimes_right(st.dictionaries(st.sampled_from(["5", "x"]), st.floats(-1, 1))),
    "best_of": sometimes_right(st.integers(0, 3)),
    # not honoured: refused unless null (worker/gateway/fields.py)
    "user": st.one_of(st.none(), TEXT),
    "unknown_field": st.one_of(st.none(), ANY_JSON),
}
MESSAGE = st.fixed_dictionaries(
    {
        "role": sometimes_right(st.sampled_from(["user", "system", "assistant", "developer"])),
        "content": sometimes_right(
            st.one_of(
                TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))
            )
        ),
    }
)
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": sometimes_right(st.one_of(TEXT, TOKEN_IDS)),
    "logprobs": sometimes_right(st.integers(-1, 7)),
    "echo": sometimes_right(st.booleans()),
}
CHAT_FIELDS = {
    **COMMON,
    "messages": sometimes_right(st.lists(MESSAGE, max_size=3)),
    "max_completion_tokens": sometimes_right(st.integers(-2, 80)),
    "logprobs": sometimes_right(st.booleans()),
    "top_logprobs": sometimes_right(st.integers(-1, 22)),
    "response_format": sometimes_right(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    ),
    "tools": sometimes_right(st.just([{"type": "function", "function": {"name": "f"}}])),
    "tool_choice": sometimes_right(st.sampled_from(["none", "auto", "required"])),
    "chat_template_kwargs": sometimes_right(
        st.fixed_dictionaries({"enable_thinking": st.booleans()})
    ),
}


# The protocol's own fields, for entries written to the stream without the gateway (the Python
# clients, or anyone with XADD): msgpack integers reach 2**64 - 1.
WIRE_INTS = st.one_of(st.integers(0, 40), st.integers(0, 40), st.integers(-3, 80), WIRE_BIG_INTS)
WIRE_FLOATS = st.one_of(st.floats(0, 2), st.floats(0, 2), st.floats(allow_nan=True))
WIRE_FIELDS = {
    "prompt": TEXT,
    "token_ids": st.lists(st.integers(0, 40), min_size=1, max_size=8) | st.lists(WIRE_INTS),
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})),
    **{name: WIRE_INTS for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs")},
    **{name: WIRE_INTS for name in ("priority", "deadline_ms", "enqueued_at_ms")},
    **{name: WIRE_FLOATS for name in ("temperature", "top_p", "min_p", "repetition_penalty")},
    **{name: WIRE_FLOATS for name in ("presence_penalty", "frequency_penalty")},
    "stop": st.lists(TEXT, max_size=3),
    "stop_token_ids": st.lists(WIRE_INTS, max_size=3),
    "ignore_eos": st.booleans(),
    "tenant": st.sampled_from(["default", "a", ""]),
}


@st.composite
def entries(draw: st.DrawFn) -> bytes:
    """A msgpack request map: an id, one prompt form, other fields at random, each with a
    value of its type (which may be out of range) or, one time in 16, anything."""
    forms = ["prompt", "token_ids", "messages"]
    others = sorted(set(WIRE_FIELDS) - set(forms))
    chosen = draw(st.sets(st.sampled_from(others), max_size=5))
    chosen.add(draw(st.sampled_from(forms)))
    fields = {name: draw(sometimes_right(WIRE_FIELDS[name], ANY_WIRE)) for name in sorted(chosen)}
    return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, "id": "fuzz", **fields})


@st.composite
def bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: str) -> bytes:
    """A JSON body: the required field most of the time, a random subset of the others."""
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=8))
    if draw(st.integers(0, 9)) > 0:
        chosen.add(required)
    body = {name: draw(fields[name]) for name in sorted(chosen)}
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def engine(chat_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(chat_model_dir), max_model_len=128, max_seqs=4))


def check_entry(payload: bytes, engine: LLMEngine) -> str:
    """The worker's half of ``check_body``: admit a stream entry and step it, or refuse it."""
    try:
        admitted = decode_entry({protocol.PAYLOAD_FIELD.encode(): payload}, LIMITS)
        inputs_for_engine = engine_inputs(admitted, engine, LIMITS, now_ms=0)
        engine.add_request(admitted.id, **vars(inputs_for_engine))
    except MalformedEntry as error:
        assert error.field is not None, (str(error), payload)
        return "worker"
    except InvalidRequestError as error:
        assert error.field, (str(error), payload)
        return "engine"
    try:
        for _ in range(2):
            engine.step()
    finally:  # after a failed step too: the next example (and Hypothesis's replay) starts clean
        engine.abort(admitted.id)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return "ran"


def check_body(body: bytes, decode: Any, engine: LLMEngine) -> str:
    """Take ``body`` as far as it goes; returns the stage that refused it ("ran" if none)."""
    try:
        generation = decode(body)
    except OpenAIError as error:
        assert error.status == 400, (error.status, body)
        # NaN and the infinities make a body that is not JSON: no field to name
        assert error.body.param or error.body.code == "invalid_json", (error.body, body)
        return "gateway"
    # What AsyncClient.submit builds from the gateway's inputs, and writes to the stream
    request = protocol.new_request(generation.request_id, now_ms=0, **generation.inputs)
    return check_entry(protocol.encode_request(request), engine)  # what it accepted encodes


FUZZ = settings(
    max_examples=int(os.environ.get("PAGESTREAM_FUZZ_EXAMPLES", 300)), deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


STAGES: Counter[tuple[str, str]] = Counter()  # (endpoint, where each body ended)
STAGES_PAST = ("gateway", "engine", "ran")  # a gateway body; the worker's decoding takes all


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, "prompt"))
def test_completion_bodies_run_or_are_refused_naming_a_field(
    engine: LLMEngine, body: bytes
) -> None:
    STAGES["completions", check_body(body, decode_completion, engine)] += 1


@FUZZ
@given(body=bodies(CHAT_FIELDS, "messages"))
def test_chat_bodies_run_or_are_refused_naming_a_field(engine: LLMEngine, body: bytes) -> None:
    decode = lambda data: decode_chat(data, CHAT_MAX_TOKENS)  # noqa: E731
    STAGES["chat", check_body(body, decode, engine)] += 1


@FUZZ
@given(payload=entries())
def test_stream_entries_run_or_are_refused_naming_a_field(
    engine: LLMEngine, payload: bytes
) -> None:
    STAGES["entries", check_entry(payload, engine)] += 1


def test_the_bodies_reach_every_stage(engine: LLMEngine) -> None:
    """Bodies of both endpoints run, and are refused by the gateway and by the engine's checks:
    a generator whose bodies all failed at the gateway would pass whatever the worker and the
    engine did. (The worker's own decoding refuses none: the gateway's types are stricter.)"""
    if not STAGES:  # the two tests above did not run in this session
        test_completion_bodies_run_or_are_refused_naming_a_field(engine=engine)
        test_chat_bodies_run_or_are_refused_naming_a_field(engine=engine)
        test_stream_entries_run_or_are_refused_naming_a_field(engine=engine)
    wanted = [(endpoint, stage) for endpoint in ("completions", "chat") for stage in STAGES_PAST]
    wanted += [("entries", stage) for stage in ("worker", "engine", "ran")]
    assert all(STAGES[key] > 0 for key in wanted), STAGES


def test_integers_past_64_bits_are_a_400_naming_the_field() -> None:
    """msgspec reads JSON integers of any size; the protocol's msgpack holds 64 bits."""
    for field in ("seed", "max_tokens", "top_k", "min_tokens"):
        body = json.dumps({"prompt": "hello", field: 2**64}).encode()
        with pytest.raises(OpenAIError) as error:
            decode_completion(body)
        assert error.value.body.param == field
    with pytest.raises(OpenAIError) as error:
        decode_completion(json.dumps({"prompt": [5, 2**70]}).encode())
    assert error.value.body.param == "prompt"
