"""bench.prefill_attention at a tiny size on the CPU (the interpreter): the record, the ranking,
a failing config's skip, and what ``--install`` writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import prefill_attention as bench
from bench.prefill_problem import PrefillProblem, PrefillShape
from kernels.attention.prefill_tuning import FALLBACK, PrefillConfig
from tests.test_triton_kernels import KERNELS  # noqa: F401  # the kernels, interpreted

CPU = torch.device("cpu")
TINY = dict(model="tiny", num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
SWEEP_SHAPE = PrefillShape(**TINY, num_seqs=1, query_len=24, context_len=20)  # type: ignore[arg-type]
OTHER_SHAPE = PrefillShape(**TINY, num_seqs=2, query_len=9, context_len=40)  # type: ignore[arg-type]
GOOD, BROKEN = PrefillConfig(32, 16, 4, 2), PrefillConfig(16, 32, 4, 2)


def test_flops_count_causal_pairs() -> None:
    # 24 queries over 20 cached keys: 24 * 20 + (1 + ... + 24) visible pairs per head
    assert SWEEP_SHAPE.flops == 4 * 16 * 4 * (24 * 20 + 300)
    assert OTHER_SHAPE.flops == 4 * 16 * 4 * 2 * (9 * 40 + 45)
    assert SWEEP_SHAPE.name == "tiny/page16/1x24@20"
    assert SWEEP_SHAPE.table_key == "d=16,group=2,q=bfloat16,kv=bfloat16,page=16"


@pytest.mark.interpreted
def test_record_at_a_tiny_size(monkeypatch: pytest.MonkeyPatch) -> None:
    run = PrefillProblem.run

    def run_with_a_broken_config(self: PrefillProblem, config: PrefillConfig) -> torch.Tensor:
        out = run(self, config)
        return out.zero_() if config == BROKEN else out

    monkeypatch.setattr(PrefillProblem, "run", run_with_a_broken_config)
    record = bench.run([SWEEP_SHAPE, OTHER_SHAPE], [SWEEP_SHAPE], [GOOD, BROKEN], 1, CPU)
    assert record["kind"] == "prefill_attention" and record["machine"]["device"] == "cpu"
    assert record["finalists"] == [GOOD.key] or record["finalists"] == [FALLBACK.key]
    sweep, other = record["results"]
    assert sweep["summary"]["shape"] == SWEEP_SHAPE.name
    assert set(sweep["configs"]) == {GOOD.key, BROKEN.key, FALLBACK.key}  # + the current one
    assert sweep["configs"][BROKEN.key]["error"].startswith("off the reference")
    assert set(other["configs"]) == {record["finalists"][0], FALLBACK.key}
    for result in record["results"]:
        summary = result["summary"]
        assert summary["current"] == FALLBACK.key  # the CPU's choice
        assert summary["best"] in (GOOD.key, FALLBACK.key) and summary["best_tflops"] > 0
        assert summary["sdpa_ms"] is None and "CUDA" in summary["sdpa_error"]
        # the engine's SDPA path (plain torch on the CPU), checked against the reference
        path = summary["sdpa_path"]
        assert path["ms"] > 0 and path["tflops"] == pytest.approx(
            summary["flops"] / path["ms"] / 1e9, rel=0.01
        )
        assert path["speedup_over_best"] > 0 and path["first_call_ms"] > 0
        assert path["engine_takes_it"] is False  # tiny chunks: the engine keeps them on Triton
        timed = result["configs"][summary["best"]]
        assert timed["tflops"] == pytest.approx(summary["flops"] / timed["ms"] / 1e9, rel=0.01)
    chosen = record["chosen"][SWEEP_SHAPE.table_key]
    assert chosen["config"] in (GOOD.key, FALLBACK.key) and chosen["mean_ratio_to_best"] >= 1
    json.dumps(record)  # a JSON record


def _record(ratios: dict[str, float], current: str) -> dict[str, Any]:
    best = min(ratios, key=ratios.__getitem__)
    chosen = {"config": best, "mean_ratio_to_best": ratios[best], "ratios": ratios}
    summary = {"table_key": "row", "current": current}
    return {"chosen": {"row": chosen}, "results": [{"summary": summary}]}


def test_install_only_a_clear_win(tmp_path: Path) -> None:
    path = tmp_path / "prefill_configs.json"
    current, other = FALLBACK.key, "m128n64w8s3"
    # within the margin: the table stays as it is
    assert bench.install_faster(_record({other: 1.0, current: 1.02}, current), "G", path) == {}
    assert not path.exists()
    # a clear win, and a current choice that failed: both installed
    assert bench.install_faster(_record({other: 1.0, current: 1.2}, current), "G", path) == {
        "row": other
    }
    assert bench.install_faster(_record({other: 1.0}, current), "H", path) == {"row": other}
    assert json.loads(path.read_text()) == {"G": {"row": other}, "H": {"row": other}}


def test_candidates_flag_refuses_a_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--out", "x.json", "--candidates", "m128n128w8s3,m128n32-tma"])
    assert "not a prefill config key" in capsys.readouterr().err
    # every candidate's key names it again, the Hopper options included
    assert all(PrefillConfig.from_key(c.key) == c for c in bench.CANDIDATES)
    assert any(c.tma for c in bench.CANDIDATES) and any(c.warp_specialize for c in bench.CANDIDATES)


def test_a_wrong_sdpa_path_is_recorded_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    run = PrefillProblem.run_sdpa_path
    monkeypatch.setattr(PrefillProblem, "run_sdpa_path", lambda self: run(self).mul_(2))
    problem = PrefillProblem.build(OTHER_SHAPE, CPU)
    path = bench.sdpa_path(problem, CPU)
    assert set(path) == {"error"} and path["error"].startswith("off the reference")


def test_the_record_says_which_shapes_the_engine_sends_to_the_sdpa_path() -> None:
    def shape(num_seqs: int, query_len: int, context_len: int) -> PrefillShape:
        return dataclasses.replace(SWEEP_SHAPE, num_seqs=num_seqs, query_len=query_len,
                                   context_len=context_len)  # fmt: skip

    assert bench.engine_takes_sdpa(shape(1, 8192, 16384))
    assert bench.engine_takes_sdpa(shape(1, 8192, 0))  # 8,192 tokens of context: its own
    assert not bench.engine_takes_sdpa(shape(1, 4096, 0))  # short context: Triton
    assert not bench.engine_takes_sdpa(shape(32, 256, 2048))  # short chunks, too many
    assert not bench.engine_takes_sdpa(shape(9, 1024, 16384))  # more than SDPA_MAX_CHUNKS
