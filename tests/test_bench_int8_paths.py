"""bench/int8_paths.py on the CPU with a tiny model: the engines it builds, the patch it lifts
after building the "off" one, the record it writes (the paths themselves run on CUDA only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engine.models.layers as layers
import kernels.linear.quant_matmul_config as quant_matmul
from bench import int8_paths


def test_a_path_is_off_only_while_an_engine_is_built() -> None:
    shipped_rows = dict(quant_matmul.INT8_MMA_ROWS)
    shipped_takes = layers.takes_int8_rows
    with int8_paths.path_off("int8-mma"):
        assert quant_matmul.INT8_MMA_ROWS == {}
    assert shipped_rows == quant_matmul.INT8_MMA_ROWS
    with pytest.raises(RuntimeError), int8_paths.path_off("producers"):
        assert layers.takes_int8_rows is not shipped_takes
        raise RuntimeError  # restored however the block ends
    assert layers.takes_int8_rows is shipped_takes


def test_record_has_each_engine_and_the_ratios(tmp_path: Path) -> None:
    record = int8_paths.measure_paths(
        "dummy:tiny", ["q8_0"], "int8-mma", (1, 2), rounds=2, bf16=True, output_len=3,
        max_model_len=256, max_seqs=4,
    )  # fmt: skip
    assert set(record["results"]) == {"none", "q8_0-int8-mma-off", "q8_0"}
    assert all(len(r[2]["tpot_ms"]) == 2 for r in record["results"].values())  # each round
    assert set(record["ratios"]["q8_0"]) == {1, 2}
    assert record["greedy_identical"]["q8_0"] == "16/16"  # on CPU both take the reference path
    path = tmp_path / "int8.json"
    int8_paths.save(record, str(path))
    assert json.loads(path.read_text())["kind"] == "int8_paths"
    with pytest.raises(ValueError, match="--off"):
        int8_paths.measure_paths("dummy:tiny", ["q8_0"], "nope", (1,), 1)
