"""Structured outputs asked through the Redis request (bundled client), batch JSONL lines
and arq batch jobs, on a worker serving the tiny SmolLM2-vocabulary model."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from clients import Client
from clients.aio import RequestFailedError
from clients.protocol import StructuredOutputs, decode_request, encode_request, new_request
from tests.redis_server import RedisServer
from tests.test_batch_jobs import WAIT_S, BatchWorker
from worker.defaults import DEFAULT_TEMPERATURE
from worker.jsonl_lines import parse_line

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(
    smollm2_vocab_model: Path, tmp_path_factory: Any
) -> Iterator[tuple[Client, BatchWorker]]:
    server = RedisServer(tmp_path_factory.mktemp("structured-surfaces"), appendonly=False)
    server.start()
    worker = BatchWorker(smollm2_vocab_model, server.url)
    try:
        with Client(server.url) as sync_client:
            yield sync_client, worker
    finally:
        worker.stop()
        server.stop()


@pytest.fixture(scope="module")
def client(served: tuple[Client, BatchWorker]) -> Client:
    return served[0]


def test_the_request_field_round_trips_and_old_payloads_still_decode() -> None:
    request = new_request("r1", prompt="x", json_schema=SCHEMA, now_ms=0)
    assert request.structured_outputs == StructuredOutputs(json_schema=json.dumps(SCHEMA))
    assert decode_request(encode_request(request)) == request
    old = new_request("r2", prompt="x", now_ms=0)  # what a client of before sends
    assert decode_request(encode_request(old)).structured_outputs is None
    with pytest.raises(ValueError, match="structured_outputs"):
        new_request("r3", prompt="x", structured_outputs={"jsonschema": "{}"}, now_ms=0)


def test_the_client_asks_with_json_schema_or_structured_outputs(client: Client) -> None:
    for seed in range(3):
        done = client.complete("a record:", json_schema=SCHEMA, max_tokens=32, temperature=1.0,
                               seed=seed, timeout_s=WAIT_S)  # fmt: skip
        assert done.finish_reason.value == "stop"
        jsonschema.validate(json.loads(done.text), SCHEMA)
    choice = client.complete("pick:", structured_outputs={"choice": ["on", "off"]}, max_tokens=8,
                             timeout_s=WAIT_S)  # fmt: skip
    assert choice.text in ("on", "off")


def test_an_uncompilable_schema_is_an_error_event_for_that_request_only(client: Client) -> None:
    with pytest.raises(RequestFailedError) as failed:
        client.complete("x", structured_outputs={"regex": "(open"}, max_tokens=4, timeout_s=WAIT_S)
    assert failed.value.field == "structured_outputs.regex"
    assert "cannot be compiled" in failed.value.message
    fine = client.complete("x", structured_outputs={"regex": "[0-9]{3}"}, max_tokens=8,
                           timeout_s=WAIT_S)  # fmt: skip
    assert re.fullmatch("[0-9]{3}", fine.text)


def test_the_worker_makes_a_requests_matchers_before_the_engine_takes_it(
    served: tuple[Client, BatchWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One matcher per sample, made off the worker's loop before the request is added; the
    engine's thread takes them ready and compiles none (about 1 ms each on its step path)."""
    client, worker = served
    grammars = worker.engine.grammars
    made_on: list[str] = []
    new_matcher = grammars._new_matcher

    def spy(*args: Any) -> Any:
        made_on.append(threading.current_thread().name)
        return new_matcher(*args)

    monkeypatch.setattr(grammars, "_new_matcher", spy)
    done = client.complete(
        "x", structured_outputs={"regex": "[0-9]{3}"}, n=2, max_tokens=8, temperature=1.0,
        timeout_s=WAIT_S,
    )  # fmt: skip
    assert len(done.choices) == 2
    assert all(re.fullmatch("[0-9]{3}", choice.text) for choice in done.choices)
    assert len(made_on) == 2 and "pagestream-engine" not in made_on
    assert grammars.num_prebuilt == 0  # both taken


def test_batch_lines_and_defaults_carry_structured_outputs(client: Client) -> None:
    lines = [
        json.dumps({"prompt": "a", "structured_outputs": {"json_schema": SCHEMA}}),
        json.dumps({"prompt": "b", "temperature": 1.0, "seed": 4}),  # the job's default below
        json.dumps({"prompt": "c", "structured_outputs": {"regex": "(open"}}),
        json.dumps({"prompt": "d", "structured_outputs": {"regex": "x", "choice": ["y"]}}),
    ]
    job_id = client.submit_batch(
        lines=lines, max_tokens=32, structured_outputs={"json_schema": SCHEMA}
    )
    records = client.batch_result(job_id, timeout_s=WAIT_S).records
    for record in records[:2]:
        jsonschema.validate(json.loads(record["text"]), SCHEMA)
    assert records[2]["error"]["field"] == "structured_outputs.regex"
    assert records[3]["error"]["field"] == "structured_outputs"


def test_a_jsonl_line_names_a_bad_constraint() -> None:
    defaults = {"temperature": DEFAULT_TEMPERATURE}
    good = parse_line(
        1, '{"prompt": "a", "structured_outputs": {"choice": ["x"]}}', defaults, chat=False
    )
    assert good.sampling is not None and good.sampling.structured is not None
    assert good.sampling.structured.choice == ("x",)
    bad = parse_line(
        2, '{"prompt": "a", "structured_outputs": {"grammer": "x"}}', defaults, chat=False
    )
    assert bad.error is not None and "unknown field 'grammer'" in bad.error.message


def test_the_generate_command_takes_structured_outputs(
    smollm2_vocab_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commands import main

    model = ["--model", str(smollm2_vocab_model), "--device", "cpu", "--max-model-len", "256"]
    flag = ["--structured-outputs", '{"regex": "[a-z]{2}-[0-9]{3}"}']
    assert main(["generate", *model, *flag, "--temperature", "1.0", "id?"]) == 0
    assert re.fullmatch("[a-z]{2}-[0-9]{3}", capsys.readouterr().out.strip())
    bad = ["--structured-outputs", '{"regex": "a", "choice": ["b"]}']
    assert main(["generate", *model, *bad, "x"]) == 2
    assert "--structured-outputs: set exactly one" in capsys.readouterr().err
    assert main(["generate", *model, "--structured-outputs", "[1]", "x"]) == 2
