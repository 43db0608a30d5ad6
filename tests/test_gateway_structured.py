"""Structured outputs through the gateway: OpenAI's ``response_format`` and vLLM's fields on
chat and completions, translated to the protocol, and end to end with the ``openai`` client
(a worker on the tiny SmolLM2-vocabulary model: only the masks make its outputs valid)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.doc_examples import python_example
from tests.gateway_fixtures import API_KEY, GatewayThread, start_gateway, wait_for
from tests.redis_server import RedisServer
from tests.service_fixtures import InProcessWorker, worker_settings
from worker.gateway.errors import OpenAIError
from worker.gateway.translate import decode_chat, decode_completion

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}


def body(**fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


# -- translation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": RESPONSE_FORMAT}, {"json_schema": json.dumps(SCHEMA)}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}),
        ({"structured_outputs": {"choice": ["a"]}}, {"choice": ["a"]}),
        ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
        ({"guided_regex": "a", "guided_decoding_backend": "guidance"}, {"regex": "a"}),
    ],
)
def test_each_form_maps_to_the_protocols_structured_outputs(
    fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    assert decode_chat(body(**fields), 100).inputs["structured_outputs"] == expected
    completion = json.dumps({"prompt": "x", **fields}).encode()
    assert decode_completion(completion).inputs["structured_outputs"] == expected


def test_plain_text_asks_for_nothing() -> None:
    inputs = decode_chat(body(response_format={"type": "text"}), 100).inputs
    assert "structured_outputs" not in inputs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
        # msgspec names the unknown key (its message: "... at `$.structured_outputs`")
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    for decode in (lambda: decode_chat(body(**fields), 100),
                   lambda: decode_completion(json.dumps({"prompt": "x", **fields}).encode())):  # fmt: skip
        with pytest.raises(OpenAIError) as refused:
            decode()
        assert refused.value.status == 400 and refused.value.body.param == param


# -- end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(smollm2_vocab_model: Path, tmp_path_factory: Any) -> Iterator[str]:
    redis = RedisServer(tmp_path_factory.mktemp("structured-redis"), appendonly=False)
    redis.start()
    worker = InProcessWorker(smollm2_vocab_model, worker_settings(redis, "so-worker"))
    gateway: GatewayThread | None = None
    try:
        worker.start()
        gateway = start_gateway(redis.url, api_keys=(API_KEY,))
        beats = redis.client()
        wait_for(lambda: beats.keys("pagestream:worker:*"), timeout_s=30)
        beats.close()
        yield f"{gateway.url}/v1"
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        redis.stop()


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
        yield client


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_json_schema_validates_streamed_and_not(client: openai.OpenAI) -> None:
    model = model_of(client)
    for seed in (1, 2):
        whole = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a city?"}], max_tokens=48,
            temperature=1.0, seed=seed, response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        )  # fmt: skip
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content or ""), SCHEMA)
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a city?"}], max_tokens=48,
        temperature=0, stream=True, response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_honour_response_format_and_vllm_fields(client: openai.OpenAI) -> None:
    model = model_of(client)
    schema_out = client.completions.create(
        model=model, prompt="JSON:", max_tokens=48, temperature=0.7, seed=3,
        extra_body={"response_format": RESPONSE_FORMAT},
    )  # fmt: skip
    jsonschema.validate(json.loads(schema_out.choices[0].text), SCHEMA)
    regex_out = client.completions.create(
        model=model, prompt="id:", max_tokens=16, temperature=1.0,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"},
    )  # fmt: skip
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex_out.choices[0].text)
    choice_out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "pick"}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )  # fmt: skip
    assert choice_out.choices[0].message.content in ("left", "right")


def test_a_schema_the_engine_cannot_compile_is_a_400(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model_of(client), messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format=bad,  # type: ignore[arg-type]
        )  # fmt: skip
    assert "cannot be compiled" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as two_ways:
        client.completions.create(
            model=model_of(client), prompt="x", max_tokens=4,
            extra_body={"guided_regex": "a", "guided_choice": ["a"]},
        )  # fmt: skip
    assert two_ways.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_the_docs_openai_example_runs(base_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/structured-outputs.md's ``openai`` example, as written, against this gateway."""
    doc = "docs/structured-outputs.md"
    code = python_example(doc, "from openai import OpenAI")
    code = code.replace("http://127.0.0.1:8000/v1", base_url).replace('"sk-local"', "KEY")
    exec(compile(code, doc, "exec"), {"KEY": API_KEY})
    content, ticket = capsys.readouterr().out.splitlines()
    assert isinstance(json.loads(content)["city"], str)
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", ticket)
