"""``bench matrix`` run for real on the CPU: dummy:tiny against itself (``--compare self``, the
peer in a subprocess through the protocol vLLM's child speaks), then resumed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import SMALL_POOL, run_cli

SCALE = ["--scale", "0.02"]  # 1-20 prompts of 2-20 tokens: seconds on the CPU
# a small step budget spreads the prompts over several steps: later ones find the prefix cached
BUDGET = ["--max-batched-tokens", "64", "--max-seqs", "8"]


def _matrix(path: Path, workloads: str, *extra: str) -> list[str]:
    return [
        "bench", "matrix", "--models", "tiny", "--workloads", workloads, "--compare", "self",
        *SCALE, "--no-progress", "--output-json", str(path), *SMALL_POOL, *BUDGET, *extra,
    ]  # fmt: skip


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    return {row["workload"]: row for row in json.loads(path.read_text())["results"]}


def test_a_matrix_against_itself_then_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "matrix-cpu.json"
    code, out, _ = run_cli(_matrix(path, "standard-64,shared-prefix,tpot-b1"), capsys)
    assert code == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "matrix" and record["peer"] == "self" and record["scale"] == 0.02
    assert record["machine"]["device_name"] == "cpu" and record["machine"]["torch"]
    assert record["settings"]["models"] == ["tiny"] and record["settings"]["pa_memory_mb"] == 16
    assert set(record["engines"]) == set(record["peers"]) == {"dummy:tiny"}
    rows = _rows(path)
    assert list(rows) == ["standard-64", "shared-prefix", "tpot-b1"]
    for name in ("standard-64", "shared-prefix"):
        row = rows[name]
        assert (row["metric"], row["better"], row["target"]) == ("output_tok_s", "higher", 1.1)
        assert row["ratio"] == row["pagestream_tok_s"] / row["self_tok_s"] == row["speedup"]
        assert row["meets_target"] == (row["ratio"] >= 1.1)
        # both sides made the same tokens from the same prompts
        assert row["pagestream"]["output_tokens"] == row["self"]["output_tokens"] > 0
        assert row["pagestream"]["input_tokens"] == row["self"]["input_tokens"]
    shared = rows["shared-prefix"]["pagestream"]
    assert shared["prefix_cache"]["device_hit_tokens"] > 0  # the system prompt was reused
    assert shared["prefix_cache"]["deferred_admissions"] > 0  # computed once, not by each
    tpot = rows["tpot-b1"]
    assert (tpot["metric"], tpot["better"], tpot["target"]) == ("tpot_s", "lower", 0.91)
    assert "pagestream_tok_s" not in tpot and tpot["self_tpot_s"] > 0
    assert tpot["ratio"] == tpot["pagestream_tpot_s"] / tpot["self_tpot_s"]
    assert tpot["speedup"] == pytest.approx(1 / tpot["ratio"])
    assert tpot["meets_target"] == (tpot["ratio"] <= 0.91)
    assert "shared-prefix" in out and ("met" in out or "missed" in out)
    if importlib.util.find_spec("matplotlib"):
        assert path.with_suffix(".png").stat().st_size > 0

    # the same file again without --resume: refused, nothing lost
    code, _, err = run_cli(_matrix(path, "tpot-b64"), capsys)
    assert code == 1 and "pass --resume" in err
    # resumed with other settings: refused
    code, _, err = run_cli(_matrix(path, "tpot-b64", "--resume", "--max-seqs", "4"), capsys)
    assert code == 1 and "--max-seqs 8 (now 4)" in err

    # a call cut short after the peer's side of standard-64: resume measures only what lacks
    del record["results"][0]["pagestream"]
    path.write_text(json.dumps(record))
    before = _rows(path)
    code, _, _ = run_cli(_matrix(path, "standard-64,tpot-b64", "--resume"), capsys)
    assert code == 0
    after = _rows(path)
    assert list(after) == ["standard-64", "shared-prefix", "tpot-b1", "tpot-b64"]
    assert after["standard-64"]["self"] == before["standard-64"]["self"]  # kept, not rerun
    assert "pagestream" in after["standard-64"] and "ratio" in after["standard-64"]
    assert after["shared-prefix"] == before["shared-prefix"]
    assert after["tpot-b64"]["pagestream"]["batch"] == 1  # 64 at scale 0.02
    assert after["tpot-b64"]["self"]["batch"] == 1


def test_a_profiled_matrix_says_where_each_sides_time_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    code, out, _ = run_cli(
        [*_matrix(folder, "standard-64,tpot-b1", "--profile-every", "2")], capsys
    )
    assert code == 0
    path = folder / "matrix-cpu-scale0.02-profile.json"  # never mistaken for measured figures
    record = json.loads(path.read_text())
    assert record["profile_every"] == 2
    row = _rows(path)["standard-64"]
    for side in ("pagestream", "self"):
        profile = row[side]["kernel_profile"]
        assert profile["every"] == 2 and profile["time"] == "cpu"
        assert profile["steps"] == row[side]["num_steps"] if side == "pagestream" else True
        assert 0 < profile["sampled_steps"] <= profile["steps"]
        assert profile["kernel_s"] == pytest.approx(sum(profile["categories_s"].values()))
        assert profile["categories_s"]["gemm"] > 0  # the projections' aten::mm on the CPU
    gap = row["kernel_gap_s"]
    ours, theirs = row["pagestream"]["kernel_profile"], row["self"]["kernel_profile"]
    assert gap["gemm"] == pytest.approx(
        ours["categories_s"]["gemm"] - theirs["categories_s"]["gemm"]
    )
    bound = sum(theirs["categories_s"][name] for name in ("gemm", "attention", "moe"))
    assert row["kernel_ceiling"] == pytest.approx(theirs["kernel_s"] / bound)
    assert row["kernel_ceiling"] > 1  # norms, rotary, sampling: time outside those kinds
    assert "kernel_profile" not in _rows(path)["tpot-b1"]["pagestream"]  # latency rows: none
    assert "tiny standard-64: kernel seconds" in out and "gemm" in out
    assert f"kernels as fast as self's: {row['kernel_ceiling']:.2f}x" in out
    if importlib.util.find_spec("matplotlib"):  # the ratios beside both sides' kinds of kernel
        assert path.with_suffix(".png").stat().st_size > 0
    # a profiled record is not resumed as a plain one, nor the other way round
    code, _, err = run_cli(_matrix(path, "tpot-b64", "--resume"), capsys)
    assert code == 1 and "profile_every 2 (now 0)" in err
