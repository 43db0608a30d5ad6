"""The tuned GEMV table: bench.gemv --install writes a shape's config only where the sweep
beat the engine's current choice, and the engine reads it back by device and shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.gemv import INSTALL_MARGIN, config_key, decode_linears, install_faster, parse_key
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from engine.models.linears import LAYER_GEMV_CONFIG
from kernels.linear.gemv_triton import GemvConfig, default_config
from kernels.linear.gemv_tuning import shape_key, tuned_config, tuned_for

FAST = GemvConfig(block_n=4, block_k=256, split_k=2, num_warps=4, num_stages=4)


def _result(
    linear: str, n: int, k: int, current: GemvConfig, current_us: float, best_us: float,
    cublas_us: float = 99.0,
) -> dict[str, Any]:  # fmt: skip
    timings = {config_key(current): current_us, config_key(FAST): best_us, "cublas": cublas_us}
    summary = {"linear": linear, "rows": 1, "N": n, "K": k, "best": config_key(FAST)}
    return {"summary": summary, "timings_us": timings}


def test_keys_round_trip() -> None:
    assert parse_key(config_key(FAST)) == FAST


def test_the_sweep_takes_the_linears_a_decode_step_runs() -> None:
    dense = decode_linears(ModelArch.from_hf_config(dummy_hf_config("llama3-8b")))
    assert list(dense) == ["qkv", "o", "gate_up", "down+silu", "lm_head"]
    assert dense["gate_up"] == (2 * 14336, 4096, False) and dense["down+silu"][2]
    # every layer of qwen3-30b-a3b is sparse: its router, no dense MLP; the router whole on
    # every rank, the attention split
    moe = decode_linears(ModelArch.from_hf_config(dummy_hf_config("qwen3-30b-a3b")), tp=2)
    assert list(moe) == ["qkv", "o", "router", "lm_head"]
    assert moe["router"] == (128, 2048, False) and moe["o"] == (2048, 4096 // 2, False)


def test_install_takes_only_clear_wins_and_the_engine_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "gemv_configs.json"
    clear_win = 10.0 * (1 - 2 * INSTALL_MARGIN)
    noise = 10.0 * (1 - INSTALL_MARGIN / 2)
    results = [
        _result("o", 4096, 2048, LAYER_GEMV_CONFIG, 10.0, clear_win),
        _result("down+silu", 4096, 7168, LAYER_GEMV_CONFIG, 10.0, noise),
        _result("lm_head", 64128, 4096, default_config(64128, 4096), 10.0, clear_win),
        # qkv and gate_up run on cuBLAS (99 us here) unless the GEMV beats it
        _result("qkv", 3072, 4096, default_config(3072, 4096), 10.0, 1.0),
        _result("gate_up", 14336, 4096, default_config(14336, 4096), 98.6, 98.5),
    ]
    installed = install_faster(results, "Test GPU", path)
    assert installed == {
        shape_key(1, 4096, 2048, False): config_key(FAST),
        shape_key(1, 64128, 4096, False): config_key(FAST),
        shape_key(1, 3072, 4096, False): config_key(FAST),
    }
    assert tuned_for("Test GPU", shape_key(1, 4096, 2048, False), None, path) == FAST
    assert tuned_for("Other GPU", shape_key(1, 4096, 2048, False), None, path) is None
    # a second sweep measures against the installed config now
    again = [_result("o", 4096, 2048, FAST, 10.0, 9.9)]
    assert install_faster(again, "Test GPU", path) == {}


def test_cublas_is_installed_where_it_beats_every_gemv_shape(tmp_path: Path) -> None:
    """As on an H200 (70B shard, down with its activation): cuBLAS 60 us, the GEMV's best 72."""
    path = tmp_path / "gemv_configs.json"
    key = shape_key(1, 8192, 14336, True)
    results = [_result("down+silu", 8192, 14336, LAYER_GEMV_CONFIG, 88.0, 72.0, cublas_us=60.0)]
    assert install_faster(results, "Test GPU", path) == {key: "cublas"}
    assert "cublas" in path.read_text()
    # None is the table's cuBLAS, distinct from "no entry" (the caller's default)
    assert tuned_for("Test GPU", key, LAYER_GEMV_CONFIG, path) is None
    assert tuned_for("Test GPU", shape_key(1, 1, 1, True), LAYER_GEMV_CONFIG, path) is (
        LAYER_GEMV_CONFIG
    )
    # and a GEMV shape that later beats cuBLAS clearly replaces it
    faster = [_result("down+silu", 8192, 14336, LAYER_GEMV_CONFIG, 88.0, 50.0, cublas_us=60.0)]
    assert install_faster(faster, "Test GPU", path) == {key: config_key(FAST)}
    assert tuned_for("Test GPU", key, None, path) == FAST


def test_a_cpu_weight_keeps_the_default() -> None:
    weight = torch.empty(8, 16)
    assert tuned_config(weight, 1, False, LAYER_GEMV_CONFIG) is LAYER_GEMV_CONFIG
