"""The quantized matmuls against cuBLAS bf16 on a model's linear shapes, CUDA only.

    python -m bench.quant_kernels --model llama3-8b --formats q4_0,q4_k,q8_0 \\
        --rows 1,8,144,4096 --output-json bench/results/quant-kernels-llama3-8b-h100.json

For each linear of one decoder layer and the LM head, each format and each row count, times
``quant_matmul`` (the default launch shape and a grid of others: ``GEMV_GRID`` up to 8 rows,
``GEMM_GRID`` beyond, q4_0/q4_1's int8-activation GEMV's ``INT8_GEMV_GRID``, and for
q8_0/q4_0/q4_1 the tensor-core kernel's ``MMA_GRID`` and the int8 tensor-core kernel's
``INT8_MMA_GRID`` at every row count) and ``F.linear`` on the bf16 weight; beyond 8 rows also the
dequantize-then-cuBLAS path (``dequant_matmul``) and its dequantization alone. Reports each
time against the streaming limit (the bytes moved over the copy bandwidth measured in the same
run), the best launch shape, and the quantized paths against cuBLAS bf16: the data for tuning
``default_config`` (GEMV, tensor-core kernel, GEMM) and for ``DEQUANT_GEMM_MIN_ROWS``.
``--defaults-only`` times the default launch shapes alone: the record of what ships; beyond
``MMA_ROWS`` it still times the tensor-core kernel's default shape (key ``mma_default``),
the other side of the bound. ``--dequant-grid`` times the blocked dequantizer's launch shapes
(``DEQUANT_GRID``) once per weight.

Timed calls replay from a CUDA graph and cycle through copies of the weight that together
exceed the L2 cache, as a model's consecutive linears do.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.first_calls import first_calls
from bench.kernels import measure_copy_bandwidth
from bench.records import machine_info, save
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from kernels.linear.fp8_rows_triton import fp8_scaled_mm
from kernels.linear.quant import (
    FORMATS,
    IN_SITU_FORMATS,
    QuantFormat,
    dequantize,
    empty_planes,
    plane_bytes,
    quantize,
    quantize_rows_fp8,
)
from kernels.linear.quant_dequant_triton import BLOCKED_FORMATS as DEQUANT_BLOCKED_FORMATS
from kernels.linear.quant_dequant_triton import dequant_matmul, dequantize_into
from kernels.linear.quant_gemv_int8_triton import INT8_X_FORMATS
from kernels.linear.quant_matmul_config import (
    MAX_GEMV_ROWS,
    MMA_ROWS,
    QuantMatmulConfig,
    default_config,
    default_mma_config,
    scaled_mm_fits,
)
from kernels.linear.quant_matmul_triton import quant_matmul
from kernels.linear.quant_mma_triton import MMA_DTYPES, mma_block_m

DEVICE = "cuda"
DTYPE = torch.bfloat16  # of the activations, the dense weight and the dequantized one
# (block_n, block_k, split_k, num_warps): column tile, K step (block_k / 32 blocks a step),
# K split and warps around the defaults; each compiles once per format and row padding
GEMV_GRID = [
    QuantMatmulConfig(block_n=n, block_k=k, split_k=split, num_warps=warps)
    for n, k, split, warps in (
        (2, 1024, 1, 1), (4, 1024, 1, 1), (4, 1024, 1, 2), (4, 2048, 1, 2), (4, 2048, 1, 4),
        (4, 512, 1, 2), (8, 1024, 1, 2),
        (8, 256, 1, 4), (8, 512, 1, 4), (8, 1024, 1, 4), (8, 512, 1, 2), (16, 256, 1, 4), (16, 512, 1, 4),
        (16, 512, 1, 8), (16, 1024, 1, 8), (32, 128, 1, 4), (32, 256, 1, 4), (32, 256, 1, 8),
        (64, 128, 1, 4), (64, 256, 1, 8), (8, 512, 2, 4), (16, 256, 2, 4), (16, 256, 4, 4),
        (32, 256, 4, 8),
    )
]  # fmt: skip
# q4_0/q4_1 on int8-rounded x (kernels/linear/quant_gemv_int8_triton.py): (block_n, block_k, warps)
INT8_GEMV_GRID = [
    QuantMatmulConfig(block_n=n, block_k=k, num_warps=warps, int8_x=True)
    for n, k, warps in ((1, 2048, 1), (2, 1024, 1), (2, 512, 1), (4, 512, 1), (4, 1024, 2))
]
GEMM_GRID = [
    QuantMatmulConfig(block_m=m, block_n=n, block_k=k, num_warps=w)
    for m, n, k, w in ((32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8), (128, 128, 32, 8),
                       (128, 64, 64, 4))
]  # fmt: skip
# the tensor-core kernel at every row count, its row tile from the rows (mma_configs):
# (block_n, block_k, split_k, num_warps, num_stages)
MMA_GRID = ((32, 256, 1, 4, 3), (64, 128, 1, 4, 3), (64, 256, 1, 4, 3), (64, 512, 1, 4, 3),
            (128, 128, 1, 8, 3), (128, 256, 1, 8, 3), (64, 128, 2, 4, 3), (128, 256, 1, 4, 4),
            (64, 64, 4, 4, 4))  # fmt: skip
# the int8 tensor-core kernel (x rounded to int8 blocks, timed with the rounding kernel),
# the same tuple; the H100 sweep of quant-kernels-int8-mma-sweep-llama3-8b-h100.json
INT8_MMA_GRID = ((64, 128, 1, 4, 3), (64, 128, 4, 4, 3), (64, 256, 2, 4, 4), (128, 128, 1, 8, 3),
                 (128, 128, 2, 8, 3), (64, 64, 4, 4, 4))  # fmt: skip
# the blocked dequantizer (q8_0/q4_0/q4_1): (weight rows, 32-element blocks, warps)
DEQUANT_GRID = ((4, 32, 4), (2, 64, 4), (4, 64, 4), (4, 64, 8), (8, 32, 4), (8, 16, 4),
                (8, 8, 2), (16, 8, 4), (2, 32, 2), (4, 16, 2))  # fmt: skip
OTHER_PATHS = ("cublas_bf16", "dequant_cublas", "dequant_only", "scaled_mm", "mma_default")
ROTATION_BYTES = 256 << 20  # weight copies cycled through: 5x an H100's 50 MiB L2
MAX_COPIES = 16
GRAPH_MS = 5.0  # a timed graph holds enough calls to run this long
NUM_REPLAYS = 5


def linear_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Linear name -> (N, K) of one decoder layer and the LM head."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "qkv": (q_size + 2 * kv_size, arch.hidden_size),
        "o": (arch.hidden_size, q_size),
        "gate_up": (2 * arch.intermediate_size, arch.hidden_size),
        "down": (arch.hidden_size, arch.intermediate_size),
        "lm_head": (arch.vocab_size, arch.hidden_size),
    }


class Shape:
    """One weight in a format: its planes and bf16 dense copies, and a dequantization room."""

    def __init__(self, fmt: QuantFormat, num_cols: int, size_k: int) -> None:
        self.fmt, self.num_cols, self.size_k = fmt, num_cols, size_k
        if fmt.name in IN_SITU_FORMATS:
            planes = quantize(torch.randn(num_cols, size_k, device=DEVICE) * 0.02, fmt)
        else:  # no in-situ k-quants: random blocks of the right shape
            planes = _random_planes(fmt, num_cols, size_k)
        dense = dequantize(fmt, planes).to(DTYPE)
        self.planes = [planes] + [
            {name: p.clone() for name, p in planes.items()}
            for _ in range(_num_copies(plane_bytes(planes)) - 1)
        ]
        self.dense = [dense] + [dense.clone() for _ in range(_num_copies(dense.nbytes) - 1)]
        self.scratch = torch.empty(num_cols * size_k, dtype=DTYPE, device=DEVICE)
        self.packed_bytes = plane_bytes(planes)


def measure(
    shape: Shape, rows: int, copy_bytes_per_s: float, full_grid: bool = True
) -> dict[str, Any]:
    """Timings of one (format, shape, rows) against cuBLAS bf16, checked against the
    reference (bf16 weights and outputs: 3% of the output's scale)."""
    fmt, size_k = shape.fmt, shape.size_k
    x = torch.randn(rows, size_k, device=DEVICE, dtype=DTYPE)
    reference = F.linear(x, shape.dense[0]).float()
    tolerance = 3e-2 * reference.abs().max().item() + 1e-3
    dense = itertools.cycle(shape.dense)
    timings = {"cublas_bf16": _time_us(lambda: F.linear(x, next(dense)))}
    gemv = rows <= MAX_GEMV_ROWS
    default = default_config(rows, shape.num_cols, size_k, fmt, DTYPE)
    grid: list[QuantMatmulConfig] = []
    if full_grid:
        grid = GEMV_GRID if gemv else GEMM_GRID
        if gemv and fmt.name in INT8_X_FORMATS:
            grid = [*grid, *INT8_GEMV_GRID]
        if fmt.name in MMA_ROWS and DTYPE in MMA_DTYPES:
            grid = [*grid, *mma_configs(rows)]
        if fmt.name in INT8_X_FORMATS and not gemv:
            grid = [*grid, *mma_configs(rows, int8=True)]
    configs = {_key(c): c for c in [default, *grid]}
    if not gemv and not default.mma and fmt.name in MMA_ROWS and DTYPE in MMA_DTYPES:
        configs["mma_default"] = default_mma_config(rows, shape.num_cols, size_k, fmt)
    runs = {key: _triton_call(shape, x, config) for key, config in configs.items()}
    w8a8 = _w8a8_reference(shape, x) if fmt.name == "fp8" else reference
    for (key, run), got in zip(runs.items(), first_calls(list(runs.values())), strict=True):
        if got is None:  # the launch shape does not fit the GPU (shared memory)
            continue
        expected = w8a8 if configs[key].mma else reference
        assert (got.float() - expected).abs().max().item() <= tolerance, (fmt.name, key)
        timings[key] = _time_us(run)
    if not gemv:
        timings.update(_time_dequant(shape, x, reference, tolerance))
    if scaled_mm_fits(x, fmt, shape.num_cols, size_k):
        timings["scaled_mm"] = _time_scaled_mm(shape, x, tolerance)
    return {"summary": _summary(shape, rows, timings, _key(default), copy_bytes_per_s),
            "timings_us": timings}  # fmt: skip


def mma_configs(rows: int, int8: bool = False) -> list[QuantMatmulConfig]:
    """MMA_GRID (INT8_MMA_GRID) with a row tile that holds ``rows`` (16 to 128)."""
    block_m = mma_block_m(rows)
    return [
        QuantMatmulConfig(block_m, n, k, split, warps, stages, mma=not int8, int8_mma=int8)
        for n, k, split, warps, stages in (INT8_MMA_GRID if int8 else MMA_GRID)
    ]


def _triton_call(
    shape: Shape, x: torch.Tensor, config: QuantMatmulConfig
) -> Callable[[], torch.Tensor]:
    planes_of = _cycler(shape.planes)
    return lambda: quant_matmul(x, shape.fmt, planes_of(), shape.size_k, config=config)


def _w8a8_reference(shape: Shape, x: torch.Tensor) -> torch.Tensor:
    """The reference with x rounded to e4m3 per row, as the W8A8 paths round it."""
    x_fp8, x_scale = quantize_rows_fp8(x)
    return F.linear((x_fp8.float() * x_scale).to(DTYPE), shape.dense[0]).float()


def _time_scaled_mm(shape: Shape, x: torch.Tensor, tolerance: float) -> float:
    """W8A8 through ``torch._scaled_mm``, checked against x rounded to e4m3 as it rounds it."""
    reference = _w8a8_reference(shape, x)
    planes_of = _cycler(shape.planes)
    got = fp8_scaled_mm(x, planes_of()).float()
    assert (got - reference).abs().max().item() <= tolerance, (shape.fmt.name, "scaled_mm")
    return _time_us(lambda: fp8_scaled_mm(x, planes_of()))


def _time_dequant(
    shape: Shape, x: torch.Tensor, reference: torch.Tensor, tolerance: float
) -> dict[str, float]:
    """The dequantize-then-cuBLAS path, and its dequantization alone."""
    fmt, room = shape.fmt, shape.scratch
    planes_of = _cycler(shape.planes)
    weight = room.view(shape.num_cols, shape.size_k)
    got = dequant_matmul(x, fmt, planes_of(), room).float()
    assert (got - reference).abs().max().item() <= tolerance, (fmt.name, "dequant_cublas")
    return {
        "dequant_cublas": _time_us(lambda: dequant_matmul(x, fmt, planes_of(), room)),
        "dequant_only": _time_us(lambda: dequantize_into(fmt, planes_of(), weight)),
    }


def _summary(
    shape: Shape, rows: int, timings: dict[str, float], default: str, copy_bytes_per_s: float
) -> dict[str, Any]:
    limit_us = shape.packed_bytes / copy_bytes_per_s * 1e6
    configs = [k for k in timings if k not in OTHER_PATHS]
    best = min(configs, key=timings.__getitem__)
    mma = [k for k in configs if k.endswith("t")]
    cublas_us = timings["cublas_bf16"]
    summary = {
        "format": shape.fmt.name, "rows": rows, "N": shape.num_cols, "K": shape.size_k,
        "limit_us": round(limit_us, 2), "cublas_bf16_us": round(cublas_us, 2),
        "default_us": round(timings[default], 2), "best": best,
        "best_us": round(timings[best], 2),
        "default_of_limit": round(limit_us / timings[default], 3),
        "best_of_limit": round(limit_us / timings[best], 3),
        "default_of_cublas": round(cublas_us / timings[default], 3),
    }  # fmt: skip
    if mma:  # the tensor-core kernel's best launch shape
        key = min(mma, key=timings.__getitem__)
        summary |= {"mma_best": key, "mma_us": round(timings[key], 2),
                    "mma_of_limit": round(limit_us / timings[key], 3)}  # fmt: skip
    if "scaled_mm" in timings:  # the figures SCALED_MM_MIN_ROWS is set from
        summary |= {"scaled_mm_us": round(timings["scaled_mm"], 2),
                    "scaled_mm_of_limit": round(limit_us / timings["scaled_mm"], 3)}  # fmt: skip
    if "mma_default" in timings:  # beyond MMA_ROWS: the bound's other side
        summary |= {"mma_default_us": round(timings["mma_default"], 2)}
    if "dequant_cublas" in timings:  # the figures DEQUANT_GEMM_MIN_ROWS is set from
        written_bytes = shape.scratch.nbytes
        dequant_limit_us = (shape.packed_bytes + written_bytes) / copy_bytes_per_s * 1e6
        summary |= {
            "dequant_cublas_us": round(timings["dequant_cublas"], 2),
            "dequant_cublas_of_cublas": round(cublas_us / timings["dequant_cublas"], 3),
            "dequant_us": round(timings["dequant_only"], 2),
            "dequant_of_limit": round(dequant_limit_us / timings["dequant_only"], 3),
            "faster": "dequant_cublas"
            if timings["dequant_cublas"] < timings[default]
            else "triton",
        }
    return summary


def measure_dequant_grid(shape: Shape, copy_bytes_per_s: float) -> dict[str, Any]:
    """The blocked dequantizer at each of DEQUANT_GRID's launch shapes into bf16, each
    checked bit for bit against the default shape's weight."""
    weight = shape.scratch.view(shape.num_cols, shape.size_k)
    expected = dequantize_into(shape.fmt, shape.planes[0], torch.empty_like(weight))
    timings = {}
    for launch in DEQUANT_GRID:
        got = dequantize_into(shape.fmt, shape.planes[0], torch.empty_like(weight), shape=launch)
        assert torch.equal(got, expected), (shape.fmt.name, launch)
        timings["x".join(map(str, launch))] = _time_us(_dequant_call(shape, weight, launch))
    limit_us = (shape.packed_bytes + weight.nbytes) / copy_bytes_per_s * 1e6
    best = min(timings, key=timings.__getitem__)
    summary = {"format": shape.fmt.name, "N": shape.num_cols, "K": shape.size_k,
               "limit_us": round(limit_us, 2), "best": best, "best_us": round(timings[best], 2),
               "best_of_limit": round(limit_us / timings[best], 3)}  # fmt: skip
    return {"summary": summary, "timings_us": timings}


def _dequant_call(
    shape: Shape, weight: torch.Tensor, launch: tuple[int, int, int]
) -> Callable[[], torch.Tensor]:
    planes_of = _cycler(shape.planes)
    return lambda: dequantize_into(shape.fmt, planes_of(), weight, shape=launch)


def _random_planes(fmt: QuantFormat, num_rows: int, size_k: int) -> dict[str, torch.Tensor]:
    """Uniform random quant bytes, small positive fp16 scales."""
    planes = empty_planes(fmt, num_rows, size_k, DEVICE)
    for plane in planes.values():
        if plane.dtype == torch.float16:
            plane.copy_(torch.rand_like(plane, dtype=torch.float32) * 1e-3)
        else:
            plane.view(torch.uint8).copy_(torch.randint_like(plane.view(torch.uint8), 0, 256))
    return planes


def _num_copies(num_bytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-ROTATION_BYTES // num_bytes)))


def _cycler(items: list[Any]) -> Callable[[], Any]:
    """A function that returns the next of ``items`` at each call (one per captured call)."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def _key(config: QuantMatmulConfig) -> str:
    key = f"m{config.block_m}n{config.block_n}k{config.block_k}s{config.split_k}w{config.num_warps}"
    if config.mma:  # t: tensor cores
        return f"{key}p{config.num_stages}t"
    if config.int8_mma:  # q: int8 tensor cores
        return f"{key}p{config.num_stages}q"
    if config.int8_x:  # i: int8 activations
        return f"{key}i"
    return f"{key}{'b' if config.blocked else ''}"


def _time_us(fn: Callable[[], Any]) -> float:
    """Median time of one call, replayed from a CUDA graph of about GRAPH_MS of calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # fn's inputs were made there
    with torch.cuda.stream(stream):
        fn()  # compiles, warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        num_calls = max(1, min(1000, int(GRAPH_MS * 3 / max(start.elapsed_time(end), 1e-3))))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()  # not torch.cuda.graph: its gc.collect() per timing adds up
        try:
            for _ in range(num_calls):
                fn()
        finally:
            graph.capture_end()
        graph.replay()
        per_call_ms = []
        for _ in range(NUM_REPLAYS):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            per_call_ms.append(start.elapsed_time(end) / num_calls)
    return statistics.median(per_call_ms) * 1000.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a dummy: shape name")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1,q4_k,q6_k,fp8")
    parser.add_argument("--rows", default="1,8,144,4096")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--defaults-only", action="store_true",
                        help="time the default launch shapes only, not the tuning grids")  # fmt: skip
    parser.add_argument("--dequant-grid", action="store_true",
                        help="also time the blocked dequantizer's launch shapes (DEQUANT_GRID)")  # fmt: skip
    args = parser.parse_args(argv)
    arch = ModelArch.from_hf_config(dummy_hf_config(args.model))
    copy_bytes_per_s = measure_copy_bandwidth("cuda")
    row_counts = [int(r) for r in args.rows.split(",")]
    results, dequant_grid = [], []
    for fmt_name in args.formats.split(","):
        for name, (num_cols, size_k) in linear_shapes(arch).items():
            shape = Shape(FORMATS[fmt_name], num_cols, size_k)
            if args.dequant_grid and fmt_name in DEQUANT_BLOCKED_FORMATS:
                dequant_grid.append(measure_dequant_grid(shape, copy_bytes_per_s))
                dequant_grid[-1]["summary"]["linear"] = name
                print(dequant_grid[-1]["summary"], flush=True)
            for rows in row_counts:
                result = measure(shape, rows, copy_bytes_per_s, not args.defaults_only)
                result["summary"]["linear"] = name
                results.append(result)
                print(result["summary"], flush=True)
            del shape  # its copies before the next format's
    record = {"kind": "quant_kernels", "machine": machine_info("cuda"),
              "settings": {"model": args.model, "formats": args.formats, "rows": args.rows,
                           "grids": not args.defaults_only},
              "copy_bytes_per_s": copy_bytes_per_s, "results": results}  # fmt: skip
    if dequant_grid:
        record["dequant_grid"] = dequant_grid
    save(record, args.output_json)


if __name__ == "__main__":
    main()
