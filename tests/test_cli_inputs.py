"""Inputs of ``generate`` and ``batch``: JSONL files, ``PAGESTREAM_*`` sources, output paths
and devices. Each mistake is one line on stderr and a usage or error exit, never a traceback."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from clients import Client
from commands import main
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer

MODEL = ["--model", "smollm2-135m", "--device", "cpu", "--max-model-len", "256"]
# a 16 MiB KV pool and one token: enough to see each line answered
SMALL_RUN = ["--pa-memory-mb", "16", "--max-tokens", "1", "--no-progress"]
NOT_UTF8_LINE = b'{"prompt": "caf\xe9"}\n'  # Latin-1 bytes


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_one_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert all(word in lines[0] for word in words), err


@pytest.fixture
def server(tmp_path: Path) -> Any:
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis", appendonly=False)
    redis_server.start()
    yield redis_server
    redis_server.stop()


# -- generate --input: numbering and encoding ---------------------------------------------------


def test_generate_numbers_lines_among_non_blank_lines_as_batch_jobs_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n   \n{"prompt": "c", "id": "c"}\n')
    args = ["generate", "--input", str(source), "--output", str(target), *MODEL, *SMALL_RUN]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert [record["id"] for record in read_jsonl(target)] == [1, 2, "c"]  # as docs/batch.md


@pytest.mark.parametrize(
    "command", [["generate", *MODEL], ["batch", "submit"]], ids=["generate", "batch-submit"]
)
def test_a_file_that_is_not_utf8_is_one_line_naming_file_and_byte(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "latin1.jsonl"
    source.write_bytes(b'{"prompt": "ok"}\n' + NOT_UTF8_LINE)
    # batch submit never reaches Redis: its file is read first
    code, out, err = run_cli([*command, "--input", str(source)], capsys)
    assert code == 2 and out == ""
    assert_one_line(err, str(source), "not UTF-8", "0xe9", "offset 32", "line 2")


# -- batch result --output ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["under-a-file", "a-folder"])
def test_batch_result_to_an_unwritable_output_is_one_line(
    where: str, server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--redis-url", server.url]
    assert main(["batch", "submit", "--prompt", "hi", "--id", "job-1", *common]) == 0
    capsys.readouterr()
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "out.jsonl" if where == "under-a-file" else tmp_path
    code, _, err = run_cli(
        ["batch", "result", "job-1", "--no-wait", "--output", str(output), *common], capsys
    )
    assert code == 1
    assert_one_line(err, f"--output {output}:")


def test_batch_result_makes_its_output_folder(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As generate's --output does: a results folder that does not exist yet is made."""
    common = ["--redis-url", server.url]
    assert main(["batch", "submit", "--prompt", "hi", "--id", "job-1", *common]) == 0
    capsys.readouterr()
    output = tmp_path / "results" / "day-1" / "out.jsonl"
    code, _, err = run_cli(
        ["batch", "result", "job-1", "--no-wait", "--output", str(output), *common], capsys
    )
    assert code == 0, err
    assert output.is_file()


@pytest.mark.parametrize("told", [False, True])
def test_batch_verbs_on_a_redis_cluster_are_one_line(
    told: bool,
    redis_cluster: RedisCluster,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch jobs need one Redis: a cluster's node is refused as such, told it is a cluster
    (PAGESTREAM_REDIS_CLUSTER=1) or not (the node answers MOVED), never with a traceback or
    the other verbs' hint of a --redis-cluster flag that batch does not take."""
    if told:
        monkeypatch.setenv("PAGESTREAM_REDIS_CLUSTER", "1")
    url = redis_cluster.url
    for verb in (["submit", "--prompt", "hi", "--id", "job-1"], ["status", "job-1"]):
        code, out, err = run_cli(["batch", *verb, "--redis-url", url], capsys)
        assert code == 1 and out == ""
        assert_one_line(err, "batch jobs need a single Redis")
        assert "--redis-cluster" not in err
    # redis-py leaves the connection a MOVED answer broke to the collector, whose warning
    # imports tracemalloc: collected here, not inside a later import's ast.parse (a nested
    # parse fails on CPython 3.11.7: "AST constructor recursion depth mismatch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


# -- --device --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda:x", "cudafoo", "cuda:-1"])
def test_a_malformed_cuda_device_is_one_line(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["generate", "hi", "--device", device], capsys)
    assert code == 1 and out == ""
    assert_one_line(err, f"device: {device!r} is not one of auto, cpu, cuda[:N]")


def test_a_cuda_device_past_the_visible_ones_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(["generate", "hi", "--device", "cuda:99"], capsys)
    assert code == 1 and out == ""
    assert_one_line(err, "device: 'cuda:99' but", "visible")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_on_a_host_without_it_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["generate", "hi", "--device", "cuda"], capsys)
    assert code == 1 and out == ""
    assert_one_line(err, "no CUDA device is visible; use --device cpu")


# -- input sources from the environment ------------------------------------------------------------


def test_generate_takes_its_input_from_pagestream_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"prompt": "The capital of France is", "id": "env"}\n')
    monkeypatch.setenv("PAGESTREAM_INPUT", str(source))
    code, _, err = run_cli(["generate", "--output", str(target), *MODEL, *SMALL_RUN], capsys)
    assert code == 0, err
    (record,) = read_jsonl(target)
    assert record["id"] == "env" and len(record["token_ids"]) == 1


def test_a_prompt_on_the_command_line_beats_pagestream_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESTREAM_INPUT", str(tmp_path / "in.jsonl"))
    # --output is refused because the prompt won: the variable's --input went back to unset
    code, _, err = run_cli(["generate", "hi", "--output", str(tmp_path / "out.jsonl")], capsys)
    assert code == 2
    assert_one_line(err, "--output needs --input")


def test_without_a_source_from_flags_or_environment_generate_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGESTREAM_INPUT", raising=False)
    code, _, err = run_cli(["generate", "--device", "cpu"], capsys)
    assert code == 2
    assert "one of the arguments prompt --input is required" in err


def test_batch_submit_takes_its_prompt_from_pagestream_prompt(
    server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESTREAM_PROMPT", "hi")
    code, out, err = run_cli(
        ["batch", "submit", "--id", "env-1", "--redis-url", server.url], capsys
    )
    assert code == 0, err
    assert out.strip() == "env-1"
    with Client(server.url) as client:
        status = client.batch_status("env-1")
    assert (status.state.value, status.total) == ("queued", 1)  # the one prompt, no worker yet


# -- --logprobs with one prompt --------------------------------------------------------------------


def test_logprobs_without_input_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["generate", "The capital of France is", "--max-tokens", "4", "--logprobs", "2"]
    code, out, err = run_cli([*args, *MODEL], capsys)
    assert code == 2 and out == ""
    assert_one_line(err, "--logprobs applies to --input results")
