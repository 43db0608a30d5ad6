"""The ``pagestream`` command line: generate (streamed and JSONL) and bench throughput."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.workloads import ThroughputWorkload, make_random_prompts
from commands import main
from engine import LLM, SamplingParams
from tests.conftest import build_tiny_model

# A 16 MiB KV pool instead of the CPU default of 1 GiB: plenty for these tiny models.
SMALL_POOL = ["--pa-memory-mb", "16"]
TRAINING_TEXT = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world, the answer is 42. Say hello to the world.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
DESIGN_ENGINE_FLAGS = [
    "--paged-attn", "--pa-memory-mb", "--pa-memory-fraction", "--pa-context-len",
    "--pa-block-size", "--pa-cache-type", "--max-seqs", "--max-batched-tokens",
    "--prefill-chunk", "--prefix-caching", "--preemption", "--cuda-graphs", "--dtype",
]  # fmt: skip
BENCH_ARGS = [
    "bench", "throughput", "--model", "dummy:tiny", "--num-prompts", "6",
    "--input-len", "10-30", "--output-len", "5-12", "--max-model-len", "128", "--no-progress",
    *SMALL_POOL,
]  # fmt: skip
DUMMY_TINY_VOCAB = 512


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (vocab 320) with a byte-level BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = build_tiny_model("llama", tmp_path_factory.mktemp("chat-model"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2 as in the model's config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    return str(path)


class WriteRecorder:
    """Stands in for stdout and keeps each write, to tell streamed output from one print."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


# -- help ----------------------------------------------------------------------------------


def test_generate_help_lists_every_engine_and_sampling_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(["generate", "--help"], capsys)
    assert code == 0
    sampling = ["--max-tokens", "--temperature", "--top-p", "--stop", "--stop-token-id"]
    missing = [flag for flag in [*DESIGN_ENGINE_FLAGS, *sampling] if flag not in out]
    assert missing == []


def test_top_level_help_does_not_import_torch() -> None:
    script = (
        "import sys; from commands import main; main(['--help']); print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert "generate" in result.stdout and "bench" in result.stdout
    assert result.stdout.strip().endswith("False")


# -- generate: one prompt ------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_generate_streams_the_offline_text(
    chat: bool,
    chat_model: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=16)
    llm = LLM(chat_model, pa_memory_mb=16)
    if chat:
        expected = llm.chat([{"role": "user", "content": prompt}], greedy, use_tqdm=False)[0]
    else:
        expected = llm.generate(prompt, greedy, use_tqdm=False)[0]
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    args = ["generate", prompt, "--model", chat_model, "--max-tokens", "16", *SMALL_POOL]
    code, _, err = run_cli([*args, "--chat"] if chat else args, capsys)
    assert code == 0
    assert "".join(recorder.writes) == expected.text + "\n"
    assert len([w for w in recorder.writes if w]) > 2  # one write per token, not one at the end
    assert f"{len(expected.token_ids)} tokens" in err
    assert f"finish_reason={expected.finish_reason.value}" in err  # type: ignore[union-attr]


# -- generate: a JSONL file ---------------------------------------------------------------


def test_generate_file_keeps_order_overrides_and_reports_bad_lines(
    chat_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps({"id": "short", "prompt": "Hello world", "max_tokens": 3}),
        json.dumps({"id": "hot", "prompt": "Hello", "temperature": -1}),
        "this is not json",
        json.dumps({"id": "long", "prompt": "The quick brown fox", "max_tokens": 9}),
        json.dumps({"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Say hello"}]}),
        json.dumps({"id": "odd", "prompt": "x", "colour": "blue"}),
        json.dumps({"prompt": "the lazy dog", "max_tokens": 2, "logprobs": 2}),
        json.dumps({"id": "typed", "prompt": "x", "stop": 5, "ignore_eos": "no"}),
    ]
    source, target = tmp_path / "prompts.jsonl", tmp_path / "out" / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")
    args = ["generate", "--input", str(source), "--output", str(target), "--model", chat_model]
    code, out, err = run_cli([*args, "--max-tokens", "5", "--ignore-eos", *SMALL_POOL], capsys)
    assert code == 0 and out == ""
    results = read_jsonl(target.read_text())
    assert [r["id"] for r in results] == [
        "short",
        "hot",
        3,
        "long",
        "both",
        "chat",
        "odd",
        8,
        "typed",
    ]
    by_id = {r["id"]: r for r in results}
    # per-line max_tokens overrides --max-tokens 5; the chat line keeps the flag's value
    assert [len(by_id[i]["token_ids"]) for i in ("short", "long", "chat", 8)] == [3, 9, 5, 2]
    assert by_id["long"]["usage"]["completion_tokens"] == 9
    assert by_id["long"]["finish_reason"] == "length"
    assert [len(entry["top"]) for entry in by_id[8]["logprobs"]] == [2, 2]
    assert "logprobs" not in by_id["short"]
    errors = {i: by_id[i]["error"]["field"] for i in ("hot", 3, "both", "odd", "typed")}
    assert errors == {
        "hot": "temperature",
        3: "line",
        "both": "prompt",
        "odd": "colour",
        "typed": "stop",
    }
    assert "5 errors" in err


# A JSONL line's field of the wrong type: (field, value, the error message). The message says
# what the field holds, not that a string is out of range.
MISTYPED_FIELDS = [
    ("temperature", "hot", 'expected a number, got str "hot"'),
    ("max_tokens", "ten", 'expected an integer or null, got str "ten"'),
    ("max_tokens", 2.5, "expected an integer or null, got float 2.5"),
    ("top_p", [0.9], "expected a number, got list [0.9]"),
    ("top_k", True, "expected an integer, got bool true"),
    ("presence_penalty", None, "expected a number, got null"),
    ("seed", "42", 'expected an integer or null, got str "42"'),
    ("logprobs", 1.5, "expected an integer or null, got float 1.5"),
    ("ignore_eos", "no", 'expected true or false, got str "no"'),
    ("stop", 5, "expected a string or a list of strings, got int 5"),
    ("stop", ["x", 7], "expected a list of strings; [1] is int 7"),
    ("stop_token_ids", ["2"], 'expected a list of integers; [0] is str "2"'),
    ("prompt", 5, "expected a string, got int 5"),
]


def mistyped_lines() -> list[str]:
    lines = []
    for field, value, _ in MISTYPED_FIELDS:
        line = {"prompt": "x", field: value}
        lines.append(json.dumps(line))
    return lines


def test_generate_file_names_the_type_a_field_should_have(
    chat_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join([*mistyped_lines(), json.dumps({"prompt": "x"})]) + "\n")
    args = ["generate", "--input", str(source), "--model", chat_model, "--max-tokens", "2"]
    code, out, err = run_cli([*args, "--no-progress", *SMALL_POOL], capsys)
    assert code == 0
    *errors, good = read_jsonl(out)
    got = [(r["error"]["field"], r["error"]["message"]) for r in errors]
    assert got == [(field, message) for field, _, message in MISTYPED_FIELDS]
    assert len(good["token_ids"]) == 2  # the good line still runs
    assert f"{len(MISTYPED_FIELDS)} errors" in err


def test_generate_file_matches_offline_generate_and_writes_stdout(
    chat_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["Hello world", "The capital of France is", "Say hello to the"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    args = ["generate", "--input", str(source), "--model", chat_model, "--max-tokens", "6"]
    code, out, _ = run_cli([*args, "--no-progress", *SMALL_POOL], capsys)
    assert code == 0
    greedy = SamplingParams(temperature=0, max_tokens=6)
    expected = LLM(chat_model, pa_memory_mb=16).generate(prompts, greedy, use_tqdm=False)
    results = read_jsonl(out)
    assert [r["token_ids"] for r in results] == [e.token_ids for e in expected]
    assert [r["text"] for r in results] == [e.text for e in expected]


def test_generate_refuses_max_tokens_past_the_context_in_one_line(
    chat_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    context = 256  # the tiny model's
    args = ["generate", "--model", chat_model, *SMALL_POOL]
    code, out, err = run_cli([*args, "Hello world", "--max-tokens", "1000"], capsys)
    assert (code, out) == (2, "")
    assert f"--max-tokens: this model's context is {context} tokens; the prompt has " in err
    assert "max_tokens asks for 1000 more: lower max_tokens to at most" in err
    assert "Traceback" not in err
    # a file: the line that asks too much is an error record; one that asks nothing gets the
    # default (256 tokens) lowered to what fits
    source = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Hello world", "max_tokens": 1000}, {"prompt": "Hello world"}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, _ = run_cli([*args, "--input", str(source), "--ignore-eos", "--no-progress"], capsys)
    assert code == 0
    refused, clamped = read_jsonl(out)
    assert refused["error"]["field"] == "max_tokens"
    assert "lower max_tokens to at most" in refused["error"]["message"]
    usage = clamped["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == context
    assert clamped["finish_reason"] == "length"


# -- errors a user can cause -------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [("PAGESTREAM_PREFILL_ATTN", "flash"), ("PAGESTREAM_ATTN_BACKEND", "cuda")],
)
def test_a_wrong_kernel_switch_is_one_clear_line(
    variable: str,
    value: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's kernel switches in the environment, checked whatever the backend (the
    prefill one has no use on this CPU's torch backend, and is still refused)."""
    monkeypatch.chdir(tmp_path)  # a run the check missed writes its record there
    monkeypatch.setenv(variable, value)
    code, out, err = run_cli(BENCH_ARGS, capsys)
    assert (code, out) == (1, "")
    assert f"{variable}={value!r}: expected one of" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        (["generate"], 2, "usage: pagestream generate"),
        (["generate", "hi", "--temperature", "-1"], 2, "--temperature: must be finite and >= 0"),
        (["generate", "--input", "/no/such/prompts.jsonl"], 2, "/no/such/prompts.jsonl"),
        (["generate", "hi", "--output", "out.jsonl"], 2, "--output needs --input"),
        (["generate", "hi", "--model", "/no/such/model"], 1, "'/no/such/model' not found"),
        (["generate", "hi", "--model", "dummy:tiny", *SMALL_POOL], 2, "has no tokenizer"),
        (["bench", "throughput", "--input-len", "30-10"], 2, "--input-len"),
        ([*BENCH_ARGS, "--input-len", "200"], 1, "exceeds the context of 128 tokens"),
        (["worker", "--log-level", "verbose"], 2, "--log-level: invalid choice: 'VERBOSE'"),
        (["up", "--log-level", "verbose"], 2, "--log-level: invalid choice: 'VERBOSE'"),
        (["worker", "--batch-jobs", "-1"], 2, "--batch-jobs: expected an integer of 0 or more"),
        (["worker", "--model", "dummy:tiny", "--device", "cpu", "--grace-s", "inf"], 2,
         "--grace-s (PAGESTREAM_GRACE_S) must be finite and >= 0"),
        (["worker", "--model", "dummy:tiny", "--device", "cpu", "--pa-memory-fraction", "2"], 2,
         "error: --pa-memory-fraction (PAGESTREAM_PA_MEMORY_FRACTION) must be in (0, 1]"),
    ],
    ids=[
        "no-prompt", "bad-sampling", "no-input-file", "output-without-input", "unknown-model",
        "text-to-dummy", "bad-range", "too-long-for-context", "worker-log-level", "up-log-level",
        "negative-batch-jobs", "endless-grace", "engine-setting-named-as-its-flag",
    ],
)  # fmt: skip
def test_user_errors_exit_with_one_clear_line(
    args: list[str], exit_code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(args, capsys)
    assert code == exit_code
    assert message in err
    assert "Traceback" not in err and out == ""


# -- bench throughput ----------------------------------------------------------------------


def test_bench_throughput_writes_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAGESTREAM_GEMV_TABLE", "off")  # a switch of the engine's, recorded
    code, out, _ = run_cli(BENCH_ARGS, capsys)
    assert code == 0
    [path] = (tmp_path / "bench" / "results").glob("throughput-dummy-tiny-cpu-*.json")
    record = json.loads(path.read_text())
    workload = ThroughputWorkload(num_prompts=6, input_len=(10, 30), output_len=(5, 12))
    prompts = make_random_prompts(workload, DUMMY_TINY_VOCAB)
    results = record["results"]
    assert record["kind"] == "throughput"
    assert results["num_requests"] == 6
    assert results["input_tokens"] == sum(len(p.token_ids) for p in prompts)
    assert results["output_tokens"] == sum(p.output_len for p in prompts)
    assert results["output_tok_s"] > 0 and results["total_tok_s"] > results["output_tok_s"]
    assert 0 < results["mean_ttft_s"] <= results["elapsed_s"]
    assert {"hostname", "python", "cpu_count", "torch", "triton"} <= record["machine"].keys()
    assert record["machine"]["pagestream_env"]["PAGESTREAM_GEMV_TABLE"] == "off"
    settings = record["settings"]
    assert settings["model"] == "dummy:tiny" and settings["pa_memory_mb"] == 16
    assert settings["resolved"]["prefill_attention"] in ("torch", "triton")
    assert settings["input_len"] == [10, 30] and settings["num_prompts"] == 6
    assert f"{results['output_tokens']}" in out and "output tok/s" in out
    # the CPU runs the kernels through Triton's interpreter: nothing is built
    assert results["jit_compiles"] in (None, {"count": 0, "seconds": 0, "kernels": []})


def test_bench_output_json_path_and_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts: list[tuple[int, int]] = []
    for seed in ("0", "0", "1"):
        path = tmp_path / f"run{len(counts)}" / "record.json"
        code, _, _ = run_cli([*BENCH_ARGS, "--seed", seed, "--output-json", str(path)], capsys)
        assert code == 0
        results = json.loads(path.read_text())["results"]
        counts.append((results["input_tokens"], results["output_tokens"]))
    assert counts[0] == counts[1] != counts[2]


def test_random_prompts_are_deterministic_and_in_range() -> None:
    workload = ThroughputWorkload(num_prompts=20, input_len=(3, 9), output_len=(4, 4), seed=5)
    prompts = make_random_prompts(workload, vocab_size=50)
    assert prompts == make_random_prompts(workload, vocab_size=50)
    other = ThroughputWorkload(num_prompts=20, input_len=(3, 9), output_len=(4, 4), seed=6)
    assert prompts != make_random_prompts(other, vocab_size=50)
    assert all(3 <= len(p.token_ids) <= 9 and p.output_len == 4 for p in prompts)
    assert all(0 <= t < 50 for p in prompts for t in p.token_ids)
    assert len({len(p.token_ids) for p in prompts}) > 1


def test_worker_checks_the_batch_connection_before_loading_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "redis://localhost:6379/0?socket_keepalive=true"  # arq has no such setting
    assert main(["worker", "--redis-url", url, "--model", "dummy:tiny"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "pagestream worker: error: batch jobs cannot apply socket_keepalive from the Redis URL "
        "(arq has no such setting): drop it from the URL, or run the worker with --batch-jobs 0"
    ]
