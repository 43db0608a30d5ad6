"""``--compare vllm`` and the throughput sweep on the CPU (vLLM itself runs on the lent GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from bench.latency import LatencyWorkload
from bench.speculative import SpeculativeWorkload
from bench.sweep import hold_ratios
from bench.vllm_peer import (
    INSTALL_HINT,
    PeerError,
    add_vllm_speculative,
    latency_peer_args,
    speculative_peer_args,
    throughput_peer_args,
)
from bench.workloads import ThroughputWorkload
from engine.config import EngineConfig
from tests.test_cli import BENCH_ARGS, SMALL_POOL, run_cli

NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here")
@pytest.mark.parametrize("verb", ["throughput", "latency", "speculative"])
def test_compare_vllm_without_vllm_is_one_clear_error(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", verb, "--model", "dummy:tiny", "--compare", "vllm", *SMALL_POOL]
    code, out, err = run_cli(args, capsys)
    assert code == 1 and INSTALL_HINT in err and "Traceback" not in err
    assert "tok/s" not in out  # it stopped before running anything


def test_a_sweep_records_every_count_and_how_throughput_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sweep.json"
    args = [*BENCH_ARGS, "--output-json", str(path)]
    args[args.index("--num-prompts") + 1] = "4,8"
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "throughput-sweep" and record["settings"]["num_prompts"] == [4, 8]
    rows = record["results"]
    assert [row["num_prompts"] for row in rows] == [4, 8]
    assert [row["pagestream"]["num_requests"] for row in rows] == [4, 8]
    expected = rows[1]["pagestream"]["output_tok_s"] / rows[0]["pagestream"]["output_tok_s"]
    assert record["hold_ratio"] == {"pagestream": pytest.approx(expected)}
    # no count reaches 256: the ratio is taken against the smallest, and says so
    assert record["hold_base_prompts"] == 4 and "largest / 4-prompt rate" in out
    if importlib.util.find_spec("matplotlib"):
        assert path.with_suffix(".png").stat().st_size > 0


def test_a_sweep_compares_with_vllm_only(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*BENCH_ARGS, "--compare", "paged-off"]
    args[args.index("--num-prompts") + 1] = "4,8"
    code, _, err = run_cli(args, capsys)
    assert code == 1 and "vllm only" in err


def test_hold_ratio_reads_the_largest_count_against_256() -> None:
    def row(n: int, ours: float, theirs: float) -> dict[str, object]:
        return {
            "num_prompts": n,
            "pagestream": {"output_tok_s": ours},
            "vllm": {"output_tok_s": theirs},
        }

    rows = [row(64, 50.0, 40.0), row(256, 100.0, 80.0), row(4096, 97.0, 70.0)]
    assert hold_ratios(rows) == {"pagestream": 0.97, "vllm": 0.875}


def test_the_peer_gets_the_engines_workload_and_limits(tmp_path: Path) -> None:
    config = EngineConfig(model="dummy:qwen3-0.6b", max_seqs=128, max_model_len=4096)
    workloads = [ThroughputWorkload(n, (10, 20), (5, 9), seed=3) for n in (64, 256)]
    assert throughput_peer_args(config, workloads) == [
        "--model", "dummy:qwen3-0.6b", "--max-seqs", "128", "--max-model-len", "4096",
        "--num-prompts", "64,256", "--input-len", "10-20", "--output-len", "5-9", "--seed", "3",
    ]  # fmt: skip
    fp8 = EngineConfig(model="dummy:llama3-8b", quantization="fp8")
    assert throughput_peer_args(fp8, workloads)[4:6] == ["--quantization", "fp8"]
    with pytest.raises(PeerError, match="cannot quantize to q4_0"):
        throughput_peer_args(EngineConfig(model="dummy:llama3-8b", quantization="q4_0"), workloads)
    sharded = EngineConfig(model="dummy:llama3-70b", tensor_parallel_size=4)
    assert throughput_peer_args(sharded, workloads)[4:6] == ["--tensor-parallel-size", "4"]
    local = EngineConfig(model=str(tmp_path))
    latency = latency_peer_args(local, LatencyWorkload((1, 8), 128, 64))
    assert latency[:2] == ["--model", str(tmp_path.resolve())]
    assert latency[-8:] == [
        "--batch-sizes", "1,8", "--latency-input-len", "128", "--latency-output-len", "64",
        "--seed", "0",
    ]  # fmt: skip


def test_the_speculative_peer_runs_the_same_model_and_draft_directories(
    tiny_model_dirs: dict[str, Path],
) -> None:
    target, draft = tiny_model_dirs["llama"], tiny_model_dirs["mistral"]
    workload = SpeculativeWorkload((1, 8), output_len=64, seed=2)
    config = EngineConfig(model=str(target), speculative_model=str(draft), max_seqs=8,
                          num_speculative_tokens=3)  # fmt: skip
    plain, spec = speculative_peer_args(config, workload)
    assert plain == [
        "--model", str(target.resolve()), "--max-seqs", "8", "--batch-sizes", "1,8",
        "--speculative-output-len", "64", "--seed", "2",
    ]  # fmt: skip
    assert spec == [
        *plain, "--num-speculative-tokens", "3", "--speculative-method", "draft_model",
        "--speculative-model", str(draft.resolve()),
    ]  # fmt: skip
    lookup = EngineConfig(model=str(target), speculative="ngram", speculative_ngram_max=3)
    assert speculative_peer_args(lookup, workload)[1][-8:] == [
        "--num-speculative-tokens", "4", "--speculative-method", "ngram",
        "--ngram-min", "1", "--ngram-max", "3",
    ]  # fmt: skip
    for model, draft_name in (("dummy:tiny", str(draft)), (str(target), "dummy:tiny")):
        with pytest.raises(PeerError, match="weights and a tokenizer, not dummy:tiny"):
            speculative_peer_args(EngineConfig(model=model, speculative_model=draft_name), workload)


def test_vllms_runs_sit_beside_the_engines_with_both_ratios() -> None:
    def run(tok_s: float) -> dict[str, Any]:
        return {"output_tok_s": tok_s}

    record = {"results": [{"batch": 1, "plain": run(100.0), "speculative": run(300.0)}]}
    plain = {"results": [{"batch": 1, **run(80.0)}]}
    spec = {"vllm": "0.26.0", "results": [{"batch": 1, **run(60.0), "acceptance_rate": 0.8}]}
    add_vllm_speculative(record, plain, spec)
    row = record["results"][0]["vllm"]
    assert row["speedup_tok_s"] == pytest.approx(0.75) and row["acceptance_rate"] == 0.8
    assert row["ratio"] == pytest.approx(5.0) and row["plain_ratio"] == pytest.approx(1.25)
    assert record["vllm"] == {"vllm": "0.26.0"}
