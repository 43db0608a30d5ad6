"""The other bench verbs on the CPU: latency, the paged-off baseline, kernels' refusal, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_cli import BENCH_ARGS, SMALL_POOL, run_cli
from tests.test_cli_inputs import assert_one_line


def test_latency_record_has_every_batch_size_and_no_limit_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latency.json"
    args = [
        "bench", "latency", "--model", "dummy:tiny", "--batch-sizes", "1,3", "--input-len", "12",
        "--output-len", "6", "--no-progress", "--output-json", str(path), *SMALL_POOL,
    ]  # fmt: skip
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "latency" and record["copy_bytes_per_s"] is None  # no GPU to copy on
    results = record["results"]
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        # a mean may exceed the p90 (one slow step does it), so only their signs are checked
        assert r["mean_ttft_s"] > 0 and r["mean_tpot_s"] > 0 and r["p90_tpot_s"] > 0
        assert r["output_tok_s"] > 0 and "fraction_of_limit" not in r
        assert r["decode_step_bytes"] > record["weights_bytes"]  # weights plus the KV read
    assert "TPOT ms" in out


def test_speculative_record_compares_both_engines_on_the_same_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "speculative.json"
    args = [
        "bench", "speculative", "--model", "dummy:tiny", "--batch-sizes", "1,3",
        "--output-len", "12", "--num-speculative-tokens", "3", "--no-progress",
        "--output-json", str(path), *SMALL_POOL,
    ]  # fmt: skip
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "speculative"
    assert record["settings"]["speculative"] == "ngram"  # implied by --num-speculative-tokens
    assert record["settings"]["prompts"].startswith("token ids")  # dummy: has no tokenizer
    assert [r["batch"] for r in record["results"]] == [1, 3]
    for r in record["results"]:
        assert r["plain"]["num_draft_tokens"] == 0 and r["speculative"]["num_draft_tokens"] > 0
        assert r["num_identical_outputs"] == r["num_requests"] == r["batch"]  # fp32 greedy
        assert r["plain"]["output_tokens"] == r["speculative"]["output_tokens"] == 12 * r["batch"]
        assert r["speedup_tok_s"] > 0
    assert "speedup" in out


def test_speculative_with_async_scheduling_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["bench", "speculative", "--model", "dummy:tiny", "--async-scheduling", "on"]
    code, _, err = run_cli([*args, *SMALL_POOL], capsys)
    assert code == 1 and "async_scheduling does not combine with speculative decoding" in err


def test_batch_sizes_above_max_seqs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "latency", "--model", "dummy:tiny", "--batch-sizes", "8", "--max-seqs", "4"]
    code, _, err = run_cli([*args, *SMALL_POOL], capsys)
    assert code == 1 and "--max-seqs 4" in err


def test_throughput_against_paged_off_in_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "record.json"
    code, out, _ = run_cli(
        [*BENCH_ARGS, "--compare", "paged-off", "--output-json", str(path)], capsys
    )
    assert code == 0
    record = json.loads(path.read_text())
    baseline = record["baselines"]["paged_off"]
    assert baseline["settings"] == {"paged_attn": "off", "max_model_len": 128}
    # the same prompts, so the same tokens; the ratio is of the two rates
    assert baseline["output_tokens"] == record["results"]["output_tokens"]
    assert baseline["ratio"] == pytest.approx(
        record["results"]["output_tok_s"] / baseline["output_tok_s"]
    )
    assert "paged_off:" in out


def test_unknown_baseline_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli([*BENCH_ARGS, "--compare", "sglang"], capsys)
    assert code == 2 and "--compare" in err and "paged-off, hf, vllm" in err


def test_kernel_bench_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["bench", "kernels"], capsys)
    assert code == 1 and "needs a CUDA device" in err


def test_plot_draws_a_png_from_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "record.json"
    assert run_cli([*BENCH_ARGS, "--output-json", str(path)], capsys)[0] == 0
    path.with_suffix(".png").unlink()
    code, _, _ = run_cli(["bench", "plot", str(path)], capsys)
    assert code == 0
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_an_unreadable_record_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run_cli(["bench", "plot", str(tmp_path / "bad.json")], capsys)
    assert code == 1 and "cannot read benchmark record" in err


def test_plot_of_a_record_kind_without_a_plot_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"kind": "kv_quality", "machine": {}, "settings": {}}))
    code, _, err = run_cli(["bench", "plot", str(path)], capsys)
    assert code == 1 and "no plot for a record of kind 'kv_quality'" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "not a benchmark record (a JSON object with a kind)"),
        ('{"kind": "throughput"}', "a throughput record without 'results', which its plot needs"),
    ],
)
def test_plot_of_a_malformed_record_names_the_file_and_what_it_lacks(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "record.json"
    path.write_text(text)
    code, _, err = run_cli(["bench", "plot", str(path)], capsys)
    assert code == 1
    assert_one_line(err, f"{path}: {message}")


@pytest.mark.parametrize("name", ["quant-smollm2-135m-h100", "speculative-ngram-smollm2-135m-h100"])
def test_plot_draws_the_feature_records(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name}.json"
    path.write_text((Path(__file__).parent.parent / "bench/results" / f"{name}.json").read_text())
    assert run_cli(["bench", "plot", str(path)], capsys)[0] == 0
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_a_cascade_decode_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.cascade_decode's record (GPU only: its shape here, with made-up times)."""
    rows = [
        dict(model=model, batch=batch, prefix=prefix, plain_us=10.0 * batch, cascade_us=batch,
             speedup=10.0, max_abs_diff=0.0, floor_bytes=1, cascade_of_copy=0.5)
        for model in ("llama3-8b", "qwen3-0.6b") for batch in (16, 256) for prefix in (512, 2048)
    ]  # fmt: skip
    machine = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6"}
    record = {"kind": "cascade-decode", "machine": machine, "settings": {}, "results": rows}
    path = tmp_path / "cascade-decode.json"
    path.write_text(json.dumps(record))
    assert run_cli(["bench", "plot", str(path)], capsys)[0] == 0
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


MULTITURN_ARGS = [
    "bench", "multiturn", "--model", "dummy:tiny", "--num-sessions", "6", "--num-turns", "3",
    "--system-len", "64", "--user-len", "8-16", "--output-len", "4", "--concurrency", "2",
    "--pa-block-size", "16", "--pa-context-len", "256", "--max-model-len", "128", "--no-progress",
]  # fmt: skip


def test_multiturn_serves_evicted_histories_from_the_host_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 16-page pool holds the system prompt and two chats at once; six chats' histories do
    # not stay on the GPU between their turns.
    path = tmp_path / "multiturn.json"
    code, out, _ = run_cli([*MULTITURN_ARGS, "--kv-offload-mb", "1", "--output-json", str(path)],
                           capsys)  # fmt: skip
    assert code == 0 and "host hit tokens" in out
    record = json.loads(path.read_text())
    assert record["kind"] == "multiturn" and record["settings"]["kv_offload_mb"] == 1
    results = record["results"]
    off, on = results["offload_off"], results["offload_on"]
    for run in (off, on):
        assert run["num_requests"] == 18 and run["output_tokens"] == 72
        assert run["ttft_s"]["p50"] > 0 and run["ttft_later_turns_s"]["p90"] > 0
        # every turn but the first two (admitted together) finds the system prompt on the GPU
        assert run["prefix_cache"]["device_hit_tokens"] >= 16 * 64
    assert off["prefix_cache"]["host_hit_tokens"] == 0
    assert on["prefix_cache"]["host_hit_tokens"] > 0 and on["prefix_cache"]["offloaded_pages"] > 0
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert results["same_replies"] == 1.0  # fp32: restored pages are the computed ones
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multiturn_without_a_host_tier_to_compare_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(MULTITURN_ARGS, capsys)
    assert code == 1 and "give --kv-offload-mb N" in err
    code, _, err = run_cli([*MULTITURN_ARGS, "--kv-offload-mb", "1", "--num-turns", "9"], capsys)
    assert code == 1 and "past the context of 128" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-offload-mb", "64", "--prefix-caching", "off"], "needs --prefix-caching on"),
        (["--kv-offload-mb", "-1"], "kv_offload_mb must be >= 0"),
    ],
)
def test_bad_offload_flags_are_clear_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli([*BENCH_ARGS, *flags], capsys)
    assert code == 1 and message in err
