"""``python -m bench.tp_scaling``: latency records of one card folded into one scaling record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.tp_scaling import main, scaling_record
from engine.errors import ConfigError


def latency(model: str, size: int, tpot_ms: dict[int, float], card: str = "H") -> dict[str, Any]:
    return {
        "kind": "latency",
        "created_utc": f"2026-11-26T00:00:0{size}+00:00",
        "machine": {"device_name": card, "torch": "t", "triton": "x"},
        "settings": {
            "model": model,
            "tensor_parallel_size": size,
            "input_len": 128,
            "output_len": 128,
        },
        "results": [
            {
                "batch": batch,
                "mean_tpot_s": ms / 1e3,
                "mean_ttft_s": 2 * ms / 1e3,
                "output_tok_s": batch * 1e3 / ms,
            }
            for batch, ms in tpot_ms.items()
        ],
    }


def test_rows_per_model_size_and_batch_with_the_ratio_to_one_gpu() -> None:
    record = scaling_record([
        latency("m", 2, {1: 3.0, 8: 4.5}),
        latency("m", 1, {1: 4.0, 8: 5.0}),
        latency("big", 2, {1: 20.0}),
    ])  # fmt: skip
    rows = {(r["model"], r["tensor_parallel_size"], r["batch"]): r for r in record["results"]}
    assert set(rows) == {("m", 1, 1), ("m", 1, 8), ("m", 2, 1), ("m", 2, 8), ("big", 2, 1)}
    assert rows["m", 2, 1]["tpot_over_tp1"] == pytest.approx(0.75)
    assert rows["m", 2, 8]["tpot_over_tp1"] == pytest.approx(0.9)
    assert rows["m", 2, 8]["ttft_s"] == pytest.approx(9e-3)
    assert "tpot_over_tp1" not in rows["big", 2, 1]  # no one-GPU run to compare with
    assert "tpot_over_tp1" not in rows["m", 1, 1]
    assert record["kind"] == "tp-scaling"


def test_records_of_two_cards_or_another_kind_are_refused() -> None:
    with pytest.raises(ConfigError, match="several cards"):
        scaling_record([latency("m", 1, {1: 4.0}, card="A"), latency("m", 2, {1: 3.0}, card="B")])
    with pytest.raises(ConfigError, match="not a latency record"):
        scaling_record([{**latency("m", 1, {1: 4.0}), "kind": "throughput"}])


def test_the_command_writes_the_record(tmp_path: Path) -> None:
    paths = []
    for size, ms in ((1, 4.0), (2, 3.0)):
        path = tmp_path / f"tp{size}.json"
        path.write_text(json.dumps(latency("m", size, {1: ms})))
        paths.append(str(path))
    out = tmp_path / "tp-scaling.json"
    main([str(out), *paths])
    rows = json.loads(out.read_text())["results"]
    assert [(r["tensor_parallel_size"], r.get("tpot_over_tp1")) for r in rows] == [
        (1, None),
        (2, 0.75),
    ]
