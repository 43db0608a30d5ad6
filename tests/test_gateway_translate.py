"""OpenAI request bodies to protocol requests, and events to OpenAI bodies, without a server."""

from __future__ import annotations

import json

import pytest

from clients.protocol import DoneEvent, FinishReason, RestartEvent, TokenEvent, TokenLogprob, Usage
from worker.gateway.errors import OpenAIError
from worker.gateway.responses import ResponseBuilder, Transcripts
from worker.gateway.translate import decode_chat, decode_completion


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_fields_map_onto_the_protocol() -> None:
    generation = decode_completion(json.dumps({
        "model": "m", "prompt": [1, 2], "max_tokens": 5, "temperature": 0, "stop": "x",
        "seed": 3, "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
        "top_k": 4, "user": None,  # null: as if not sent
    }).encode())  # fmt: skip
    assert generation.inputs == {"token_ids": [1, 2], "max_tokens": 5, "temperature": 0.0,
                                 "seed": 3, "top_k": 4, "stop": ["x"], "logprobs": 2}  # fmt: skip
    assert generation.model == "m" and generation.stream and generation.include_usage
    assert generation.request_id.startswith("cmpl-")
    # no max_tokens: OpenAI's default of 16, lowered by the worker to fit the context
    assert decode_completion(b'{"prompt": "hi"}').inputs == {
        "prompt": "hi", "max_tokens": 16, "clamp_max_tokens": True,
    }  # fmt: skip


def test_chat_messages_and_its_max_tokens() -> None:
    body = json.dumps({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
    ], "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2}).encode()  # fmt: skip
    generation = decode_chat(body, chat_max_tokens=100)
    assert generation.inputs["messages"] == [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "a b"}]  # fmt: skip
    assert generation.inputs["max_tokens"] == 7 and generation.logprobs == 2
    assert not generation.inputs["clamp_max_tokens"]  # the user's own: refused past the context
    defaulted = decode_chat(chat(), chat_max_tokens=100).inputs
    assert (defaulted["max_tokens"], defaulted["clamp_max_tokens"]) == (100, True)
    assert decode_chat(chat(stream=True), 100).include_usage is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(n=0), "n"),
        (chat(n=2, best_of=1), "best_of"),
        (chat(n=1, best_of=2, stream=True), "best_of"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(response_format={"type": "structural_tag"}), "response_format"),
        (  # a forced call decodes under its tool's schema: no second output format
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                tool_choice="required",
                response_format={"type": "json_object"},
            ),
            "tool_choice",
        ),
        (chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(user="u1"), "user"),
        (chat(unknown_field=1), "unknown_field"),
        (chat(logit_bias={"5": 1.0}), "logit_bias"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(top_logprobs=21, logprobs=True), "top_logprobs"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
        (b'{"messages": [{"role": "user"}]}', "messages"),
        (chat(temperature="hot"), "temperature"),
        # a nested error names the top-level field it is in, not the nested one
        (b'{"messages": [{"content": "x"}]}', "messages"),
        (chat(response_format={}), "response_format"),
        (chat(stream_options={"include_usage": True}), "stream_options"),  # without stream
        (chat(response_format={"type": "text", "json_schema": {"schema": {}}}), "response_format"),
        (chat(max_tokens=2, max_completion_tokens=50), "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}', "messages"),
    ],
)
def test_chat_refusals_name_the_field(body: bytes, param: str) -> None:
    with pytest.raises(OpenAIError) as exc:
        decode_chat(body, 100)
    assert exc.value.status == 400 and exc.value.body.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # an unknown key is named itself, as a top-level one is
        (b'{"messages": [{"role": "user", "content": "x", "foo": 1}]}', "foo"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", '
         b'"cache_control": {}}]}]}', "cache_control"),
        (chat(stream=True, stream_options={"continuous_usage_stats": True}),
         "continuous_usage_stats"),
        (chat(response_format={"type": "json_object", "strict": True}), "strict"),
        (chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}),
         "x"),
        (b'{"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}', "messages"),
        (b'{"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}',
         "messages"),
    ],
)  # fmt: skip
def test_nested_fields_not_honoured_are_refused(body: bytes, param: str) -> None:
    """Inside a message, a content part, stream_options or response_format as at the top
    level: a field the gateway does not honour is a 400 naming it, never dropped."""
    with pytest.raises(OpenAIError) as exc:
        decode_chat(body, 100)
    assert exc.value.status == 400 and exc.value.body.param == param
    assert exc.value.body.code == "unsupported_parameter"


def test_message_names_and_reasoning_reach_the_template() -> None:
    """``name`` on any role and an assistant's ``reasoning_content`` go on to the chat
    template; what a client sends back of an assistant message unchanged is accepted."""
    body = json.dumps({"messages": [
        {"role": "system", "content": "s", "name": "rules"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "yo", "reasoning_content": "greet back", "refusal": None,
         "annotations": [], "audio": None, "function_call": None, "tool_calls": None},
    ], "max_tokens": 3, "max_completion_tokens": 3}).encode()  # fmt: skip
    messages = decode_chat(body, 100).inputs["messages"]
    assert messages == [
        {"role": "system", "content": "s", "name": "rules"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "yo", "reasoning_content": "greet back"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [(b'{"prompt": "x", "echo": true}', "echo"), (b'{"prompt": "x", "best_of": 2, "stream": true}', "best_of"),
     (b'{"prompt": "x", "tools": []}', "tools"), (b'{"prompt": "x", "user": "u"}', "user"),
     (b'{"prompt": "x", "suffix": "y"}', "suffix"), (b'{"prompt": "x", "logprobs": 6}', "logprobs"),
     (b'{"prompt": ["a", "b"]}', "prompt"), (b'{"max_tokens": 3}', "prompt")],
)  # fmt: skip
def test_completion_refusals_name_the_field(body: bytes, param: str) -> None:
    with pytest.raises(OpenAIError) as exc:
        decode_completion(body)
    assert exc.value.status == 400 and exc.value.body.param == param


def test_not_json_is_400_without_a_param() -> None:
    with pytest.raises(OpenAIError) as exc:
        decode_completion(b"")
    assert exc.value.body.code == "invalid_json" and exc.value.body.param is None


def test_whole_body_forgets_a_dead_attempt_and_maps_finish_reasons() -> None:
    generation = decode_completion(b'{"prompt": "x", "logprobs": 1}')
    transcript = Transcripts()
    transcript.add(TokenEvent(seq=0, text=" dead", token_ids=[9]))
    transcript.add(RestartEvent(attempt=1, worker="w2"))
    lp = TokenLogprob(7, -0.5, [(7, -0.5)])
    transcript.add(TokenEvent(seq=0, text=" a", token_ids=[7], logprobs=[lp]))
    transcript.add(TokenEvent(seq=1, text=" bc", token_ids=[8, 9], logprobs=[
        TokenLogprob(8, -1.0, [(5, -0.1)]), TokenLogprob(9, -2.0, [(9, -2.0)])]))  # fmt: skip
    done = DoneEvent(finish_reason=FinishReason.TIMEOUT,
                     usage=Usage(prompt_tokens=1, completion_tokens=3, cached_prompt_tokens=1))  # fmt: skip
    body = json.loads(ResponseBuilder(generation, "m").body(transcript, done))
    choice = body["choices"][0]
    assert choice["text"] == " a bc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [" a", "token_id:8", "token_id:9"]
    assert choice["logprobs"]["top_logprobs"] == [{" a": -0.5}, {"token_id:5": -0.1},
                                                  {"token_id:9": -2.0}]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
