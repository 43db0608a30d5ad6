"""bench.quant_kernels' figures on CPU (kernels interpreted, timing replaced by a counter): each
row count gets the launch shapes of its kernel, and beyond the GEMV the dequant+cuBLAS path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import bench.quant_kernels as quant_kernels
from kernels.linear.quant import FORMATS, dequantize
from kernels.linear.quant_matmul_config import QuantMatmulConfig
from kernels.linear.quant_matmul_triton import quant_matmul
from tests.test_quant_kernels import random_planes


@pytest.mark.interpreted
@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_each_row_count_gets_its_kernels_launch_shapes_and_the_dequant_path(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def count_calls(fn: Callable[[], Any]) -> float:  # runs fn as a timing would, once
        fn()
        calls.append(1)
        return float(len(calls))

    monkeypatch.setattr(quant_kernels, "DEVICE", "cpu")
    # float32: the interpreter's tl.dot on bf16 (Triton 3.9) gives garbage, the GPU's does not
    monkeypatch.setattr(quant_kernels, "DTYPE", torch.float32)
    monkeypatch.setattr(quant_kernels, "_time_us", count_calls)
    monkeypatch.setattr(quant_kernels, "GEMV_GRID", [QuantMatmulConfig(block_n=16, block_k=256)])
    gemm = QuantMatmulConfig(block_m=16, block_n=32, block_k=64)
    monkeypatch.setattr(quant_kernels, "GEMM_GRID", [gemm])
    shape = quant_kernels.Shape(FORMATS[name], 48, 256)
    assert len(shape.planes) == quant_kernels.MAX_COPIES  # tiny: the copies' cap
    monkeypatch.setattr(quant_kernels, "INT8_GEMV_GRID", [QuantMatmulConfig(int8_x=True)])
    monkeypatch.setattr(quant_kernels, "INT8_MMA_GRID", [(32, 64, 1, 4, 3)])
    decode = quant_kernels.measure(shape, 2, copy_bytes_per_s=1e9)
    # q4_0 at two rows: the int8-activation GEMV by default, and its grid beside the float one
    default = {"q4_0": "m64n1k256s1w1i", "q4_k": "m64n8k256s1w4b"}[name]
    int8_grid = {"q4_0": {"m64n64k64s1w4i"}, "q4_k": set()}[name]
    assert set(decode["timings_us"]) == {"cublas_bf16", default, "m64n16k256s1w4b", *int8_grid}
    assert "dequant_cublas_us" not in decode["summary"]
    prefill = quant_kernels.measure(shape, 20, copy_bytes_per_s=1e9)
    summary = prefill["summary"]
    # and for q4_0 the int8 tensor-core kernel's grid (its row tile holds the 20 rows)
    int8_mma = {"q4_0": {"m32n32k64s1w4p3q"}, "q4_k": set()}[name]
    assert set(prefill["timings_us"]) == {
        "cublas_bf16", "m32n32k64s1w4b", "m16n32k64s1w4b", "dequant_cublas", "dequant_only",
        *int8_mma,
    }  # fmt: skip
    timings = prefill["timings_us"]  # the counter: the order of the timings
    assert summary["best"] == "m32n32k64s1w4b"  # the default, timed first of the configs
    assert summary["dequant_cublas_of_cublas"] == round(
        timings["cublas_bf16"] / timings["dequant_cublas"], 3
    )
    assert summary["faster"] == "triton"  # timed after the default: a larger count
    packed_and_written = shape.packed_bytes + 48 * 256 * 4
    limit_us = packed_and_written / 1e9 * 1e6
    assert summary["dequant_of_limit"] == round(limit_us / timings["dequant_only"], 3)


@pytest.mark.interpreted
@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q4_k", "q6_k"])  # each GEMV's code paths
def test_every_gemv_launch_shape_of_the_sweep_multiplies_right(name: str) -> None:
    fmt = FORMATS[name]
    planes = random_planes(fmt, 40, 1024, seed=9)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(9))
    expected = x @ dequantize(fmt, planes).T
    for config in quant_kernels.GEMV_GRID:
        got = quant_matmul(x, fmt, planes, 1024, config=config)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


def test_tensor_core_grid_tiles_the_rows() -> None:
    configs = quant_kernels.mma_configs(20)
    assert {c.block_m for c in configs} == {32}
    assert all(c.mma for c in configs)
    assert len(configs) == len(quant_kernels.MMA_GRID)
    assert {c.block_m for c in quant_kernels.mma_configs(1)} == {16}  # the dot's least
    assert {c.block_m for c in quant_kernels.mma_configs(4096)} == {128}
    keys = {quant_kernels._key(c) for c in configs}
    assert len(keys) == len(configs)  # each launch shape its own timing
    assert all(k.endswith("t") for k in keys)


@pytest.mark.interpreted
def test_defaults_only_times_the_default_launch_shape_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant_kernels, "DEVICE", "cpu")
    monkeypatch.setattr(quant_kernels, "DTYPE", torch.float32)
    monkeypatch.setattr(quant_kernels, "_time_us", lambda fn: (fn(), 1.0)[1])
    shape = quant_kernels.Shape(FORMATS["q8_0"], 16, 64)
    decode = quant_kernels.measure(shape, 2, copy_bytes_per_s=1e9, full_grid=False)
    assert set(decode["timings_us"]) == {"cublas_bf16", decode["summary"]["best"]}


@pytest.mark.interpreted
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_dequant_grid_checks_and_times_every_blocked_launch_shape(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def count_calls(fn: Callable[[], Any]) -> float:
        fn()
        calls.append(1)
        return 100.0 - len(calls)  # each later shape "faster": the last is the best

    monkeypatch.setattr(quant_kernels, "DEVICE", "cpu")
    monkeypatch.setattr(quant_kernels, "DTYPE", torch.float32)
    monkeypatch.setattr(quant_kernels, "_time_us", count_calls)
    # 12 rows, 40 blocks: ragged for every shape of the grid
    shape = quant_kernels.Shape(FORMATS[name], 12, 1280)
    result = quant_kernels.measure_dequant_grid(shape, copy_bytes_per_s=1e9)
    grid = ["x".join(map(str, launch)) for launch in quant_kernels.DEQUANT_GRID]
    assert list(result["timings_us"]) == grid
    summary = result["summary"]
    assert summary["best"] == grid[-1] and summary["best_us"] == 100.0 - len(grid)
    written = 12 * 1280 * 4  # the float32 weight
    limit_us = (shape.packed_bytes + written) / 1e9 * 1e6
    assert summary["best_of_limit"] == round(limit_us / summary["best_us"], 3)
