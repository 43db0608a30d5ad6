"""Which kernel and launch shape ``quant_matmul`` takes by default, by format and row count.

The bounds and shapes come from H100 sweeps of llama3-8b's linears (bench/quant_kernels.py,
the records in bench/results/): by rows, the int8-activation GEMV (``INT8_X_ROWS``), the
tensor-core kernels (``MMA_ROWS``, ``INT8_MMA_ROWS``), the GEMVs up to ``MAX_GEMV_ROWS``, the
GEMM beyond; fp8 from ``MMA_ROWS["fp8"][1]`` rows on Hopper takes ``torch._scaled_mm``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.linear.gemv_triton import MAX_ROWS as MAX_GEMV_ROWS
from kernels.linear.quant import QK, QuantFormat
from kernels.linear.quant_mma_triton import MIN_BLOCK_M, MMA_DTYPES, mma_block_m

SCALED_MM_MIN_CAPABILITY = (9, 0)  # torch._scaled_mm with row-wise scales
SCALED_MM_ALIGNMENT = 16  # its N and K must be multiples of this


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Launch shape: output tile, K step, K split (GEMV only), warps, stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    blocked: bool = True  # GEMV: q8_0/q4_0/q4_1/fp8 through quant_gemv_blocked_triton.py
    int8_x: bool = False  # GEMV: q8_0/q4_0/q4_1 on x rounded to int8 (quant_gemv_int8_triton)
    mma: bool = False  # q8_0/q4_0/q4_1 on tensor cores (quant_mma_triton.py), any rows
    int8_mma: bool = False  # ... on int8 tensor cores, x rounded (quant_mma_int8_triton.py)


def default_config(
    num_rows: int, num_cols: int, size_k: int, fmt: QuantFormat, dtype: torch.dtype
) -> QuantMatmulConfig:
    """The launch shape ``quant_matmul`` takes when given none: the int8 tensor-core kernel in
    ``INT8_MMA_ROWS``, the tensor-core kernel in ``MMA_ROWS``, the int8 GEMV in
    ``INT8_X_ROWS``, else the GEMV up to ``MAX_GEMV_ROWS`` rows, else the GEMM."""
    if takes_int8_mma(fmt, num_rows) and size_k % QK == 0:
        return default_int8_mma_config(num_rows, num_cols, size_k)
    if takes_mma(fmt, num_rows, dtype):
        return default_mma_config(num_rows, num_cols, size_k, fmt)
    if takes_int8_gemv(fmt, num_rows):
        return default_int8_gemv_config(num_rows, num_cols, size_k, fmt)
    if num_rows <= MAX_GEMV_ROWS:
        return default_gemv_config(num_cols, size_k, fmt)
    return default_gemm_config(num_rows, num_cols)


def takes_int8_rows(fmt: QuantFormat, num_rows: int, size_k: int, dtype: torch.dtype) -> bool:
    """Whether ``quant_matmul`` by default multiplies ``num_rows`` rows of ``dtype`` by a
    kernel on int8-rounded activations (the int8 GEMV, the int8 tensor cores), so that the
    kernel producing them may round them (``Int8Rows``)."""
    if size_k % QK:
        return False
    if takes_int8_mma(fmt, num_rows):
        return True
    return not takes_mma(fmt, num_rows, dtype) and takes_int8_gemv(fmt, num_rows)


def uses_scaled_mm(x: torch.Tensor, fmt: QuantFormat, num_cols: int, size_k: int) -> bool:
    """Whether fp8 rows take ``torch._scaled_mm`` by default: from ``MMA_ROWS["fp8"][1]``
    rows (fewer take the GEMV or fp8_mma_triton.py), on Hopper+, bf16, aligned."""
    return x.shape[0] >= MMA_ROWS["fp8"][1] and scaled_mm_fits(x, fmt, num_cols, size_k)


def scaled_mm_fits(x: torch.Tensor, fmt: QuantFormat, num_cols: int, size_k: int) -> bool:
    """Whether ``torch._scaled_mm`` can multiply ``x`` by this weight at all."""
    if fmt.name != "fp8" or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    aligned = num_cols % SCALED_MM_ALIGNMENT == 0 and size_k % SCALED_MM_ALIGNMENT == 0
    return aligned and torch.cuda.get_device_capability(x.device) >= SCALED_MM_MIN_CAPABILITY


# q8_0/q4_0/q4_1 with 16-bit activations: (rows from which the tensor-core kernel is the
# default, rows from which engine/quant/linear.py dequantizes for cuBLAS instead). H100,
# llama3-8b's four layer linears: below the lower bounds the int8-activation GEMV
# (INT8_X_ROWS) is faster, q4_0 at 4 rows 105 us against 150 on tensor cores; at 6 rows the
# tensor cores win, 153 against 170 (quant-kernels-int8-rows-llama3-8b-h100.json; q4_1 there
# 174 against 161, taken as even); q8_0 at 8 rows 233 on tensor cores against the float
# GEMV's 349 (quant-kernels-defaults-llama3-8b-h100.json). The upper bounds against the
# blocked dequantizer + cuBLAS (quant-kernels-dequant-llama3-8b-h100.json): q4_0 at 128 rows
# 348 us against 386, at 160
# rows (two row tiles) 594 against 398; q8_0 at 128 rows 429 against 424; q4_1 at 64 rows 293
# against 386, at 96 rows (a 128-row tile) 410 against 391. fp8 (fp8_mma_triton.py,
# W8A8) from 2 rows, where its one-row GEMV stops winning, to 128, beyond which
# torch._scaled_mm takes over (quant-kernels-fp8-mma-sweep-llama3-8b-h100.json, a layer's
# four linears: 2 rows 98 us against the GEMV's 126 and _scaled_mm's 148; 8 rows 98 against
# 146; 128 rows qkv and o 1.1-1.2x _scaled_mm, gate_up even).
MMA_ROWS = {"q4_0": (5, 129), "q4_1": (5, 65), "q8_0": (8, 129), "fp8": (2, 129)}
# from here (gate_up, LM heads): 128-column tiles, no split (from 17 rows; fp8 at any rows)
MMA_WIDE_COLS = 16384


def takes_mma(fmt: QuantFormat, num_rows: int, dtype: torch.dtype) -> bool:
    """Whether ``num_rows`` rows of ``dtype`` take the tensor-core kernel by default (in
    ``MMA_ROWS``' range; beyond it the weight is dequantized for cuBLAS, fp8 takes
    ``torch._scaled_mm``)."""
    bounds = MMA_ROWS.get(fmt.name)
    in_range = bounds is not None and bounds[0] <= num_rows < bounds[1]
    return in_range and dtype in MMA_DTYPES


@functools.lru_cache(maxsize=256)
def default_mma_config(
    num_rows: int, num_cols: int, size_k: int, fmt: QuantFormat
) -> QuantMatmulConfig:
    """The best launch shapes of the H100 sweeps (bench/quant_kernels.py,
    quant-kernels-mma-sweep2-llama3-8b-h100.json): a row tile that holds the batch (16 to 128);
    64-column tiles, K steps of 64 split four ways, four stages, except for wide weights beyond
    16 rows: 128-column tiles of 8 warps, K steps of 128, no split. Against the shapes before
    (narrow weights: K steps of 128 split in two; wide ones: 128-column tiles at any rows),
    at 4-128 rows: qkv, o and down 1.18-1.46x in q4_0, 0.93-1.29x in q8_0; gate_up and the LM
    head up to 16 rows 1.02-1.18x in q4_0, 0.94-1.11x in q8_0. A decoder layer's four linears
    at 8 rows: q4_0 153 us instead of 191, q8_0 204 instead of 228."""
    block_m = mma_block_m(num_rows)
    if fmt.name == "fp8":
        return _fp8_mma_config(block_m, num_cols)
    if num_cols >= MMA_WIDE_COLS and block_m > MIN_BLOCK_M:
        block_n, block_k, split_k, warps, stages = 128, 128, 1, 8, 3
    else:
        block_n, block_k, split_k, warps, stages = 64, 64, 4, 4, 4
    while split_k > 1 and size_k < split_k * block_k * 2:  # every split two K steps or more
        split_k //= 2
    return QuantMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                             num_warps=warps, num_stages=stages, mma=True)  # fmt: skip


# Rows [low, high) that take the int8 tensor-core kernel (quant_mma_int8_triton.py).
# H100, llama3-8b's layer linears, its one launch shape (quant-kernels-int8-mma-sweep-llama3-
# 8b-h100.json), a layer's four linears in q8_0 against the float tensor-core kernel: 8 rows
# 142 us against 197 (bf16 cuBLAS 165), 16 rows 164 against 209 (cuBLAS 166), 32 rows 222
# against 278; 64 rows 305 against 314, 128 rows 428 against 416 (kept on the float kernel).
# 4-bit weights lose at every row count (q4_0 at 8 rows 191 against 140: their nibbles are
# unpacked and interleaved in registers, where the float kernel's conversion is cheaper).
INT8_MMA_ROWS = {"q8_0": (8, 33)}


def takes_int8_mma(fmt: QuantFormat, num_rows: int) -> bool:
    """Whether ``num_rows`` rows of ``fmt`` take the int8 tensor-core kernel by default."""
    bounds = INT8_MMA_ROWS.get(fmt.name)
    return bounds is not None and bounds[0] <= num_rows < bounds[1]


@functools.lru_cache(maxsize=256)
def default_int8_mma_config(num_rows: int, num_cols: int, size_k: int) -> QuantMatmulConfig:
    """The int8 tensor-core kernel's shape from the H100 sweep: 64-column tiles of 4 warps, K
    steps of four blocks split four ways (every split two K steps or more), three stages.
    Within 7% of the best of six shapes on every linear at 8-32 rows but gate_up at 32 rows
    (K steps of two blocks: 98 us, 113 here)."""
    block_k, split_k = 4 * QK, 4
    while split_k > 1 and size_k < split_k * block_k * 2:
        split_k //= 2
    return QuantMatmulConfig(block_m=mma_block_m(num_rows), block_n=64, block_k=block_k,
                             split_k=split_k, num_warps=4, num_stages=3, int8_mma=True)  # fmt: skip


def _fp8_mma_config(block_m: int, num_cols: int) -> QuantMatmulConfig:
    """fp8's tensor-core shapes, from the H100 sweep (quant-kernels-fp8-mma-sweep-llama3-8b-
    h100.json): no K split, long K steps (an e4m3 step of 512 is 512 bytes a row); wide
    weights 128-column tiles, K steps of 256; 8 warps from 64 rows."""
    if num_cols >= MMA_WIDE_COLS:
        block_n, block_k = 128, 256
        warps, stages = (4, 4) if block_m <= 32 else (8, 3)
    else:
        block_n, block_k, warps, stages = 64, 512 if block_m <= 64 else 256, 4, 3
    return QuantMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=1,
                             num_warps=warps, num_stages=stages, mma=True)  # fmt: skip


GEMV_MIN_PROGRAMS = 264  # two per SM of an H100/H200 (132 SMs)
# The GGUF block formats' GEMV, (columns, K step, warps): the 4-bit formats 2 columns of one
# warp and 32 blocks (1024 elements) a step (their layout conversions and barriers cost least
# in the smallest programs), q8_0 4 columns of 4 warps and 64 blocks. H100, llama3-8b's
# linears with the weights out of L2 (quant-kernels-gemv-llama3-8b-h100.json), a decoder
# layer's four linears and the LM head at one row: q4_0 232 us (266 with 8 columns of 4 warps,
# the shape before), q4_1 259 (308), q8_0 269 (285); at two rows q4_0 350 (430), q8_0 411
# (390: the one loss). fp8 takes q8_0's shape (quant-kernels-fp8-gemv-llama3-8b-h100.json): at one row
# the four linears 82.6 us (101.2 with the rule below; their limit 72.7). The k-quants keep
# the rule (not swept).
TUNED_GEMV = {"q8_0": (4, 2048, 4), "q4_0": (2, 1024, 1), "q4_1": (2, 1024, 1),
              "fp8": (4, 2048, 4)}  # fmt: skip


@functools.lru_cache(maxsize=256)  # called per linear per step: the shapes are few
def default_gemv_config(num_cols: int, size_k: int, fmt: QuantFormat) -> QuantMatmulConfig:
    """Enough programs to give every SM two, by narrower column tiles before splitting K:
    a split costs a zeroed fp32 buffer and a copy (two more kernels per linear). Untuned
    formats: a step of ``BLOCK_N`` rows reads 2 KiB of 4-bit quants, 16 bytes a thread of
    4 warps; the block formats take the measured TUNED_GEMV shape."""
    warps = 4
    if fmt.name in TUNED_GEMV:
        block_n, block_k, warps = TUNED_GEMV[fmt.name]
    else:
        block_n = 16 if triton.cdiv(num_cols, 16) >= 2 * GEMV_MIN_PROGRAMS else 8
        block_k = 256 * 16 // block_n
    block_k = min(block_k, max(triton.next_power_of_2(size_k), 16))
    split_k = _gemv_split_k(num_cols, size_k, block_n)
    return QuantMatmulConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps)


# Rows that take the int8-activation GEMV (quant_gemv_int8_triton.py: x rounded to
# int8, dp4a), one-warp programs. H100, llama3-8b (quant-kernels-int8-llama3-8b-h100.json), a
# layer's four linears, the rounding kernel included: q4_0 at one row 54 us against the float
# GEMV's 81 (limit 41), two rows 69 against 119; q4_1 59 against 107 at one row; a q4_0 LM
# head at one row 100 us (its limit 98) against 146; at 3-4 rows q4_0 95-105 us against the
# tensor-core kernel's 147-150, q4_1 97-117 against 168-172 (quant-kernels-int8-rows-llama3-
# 8b-h100.json). q8_0 is bound by its bytes at one row (92 us against 88 in a development
# run: it keeps the float GEMV) but not beyond: 100 against 126 at two rows, 117 against 195
# at four, its LM head 183 against 279 and 209 against 429 (quant-kernels-int8-q8_0-llama3-
# 8b-h100.json); at six rows 200 against 341 (a development run with bench.quant_kernels'
# timing; at eight the tensor cores' 196 beat it, 224).
INT8_X_ROWS = {"q4_0": (1, 4), "q4_1": (1, 4), "q8_0": (2, 7)}


def takes_int8_gemv(fmt: QuantFormat, num_rows: int) -> bool:
    """Whether ``num_rows`` rows of ``fmt`` take the int8-activation GEMV by default."""
    bounds = INT8_X_ROWS.get(fmt.name)
    return bounds is not None and bounds[0] <= num_rows <= bounds[1]


@functools.lru_cache(maxsize=256)
def default_int8_gemv_config(
    num_rows: int, num_cols: int, size_k: int, fmt: QuantFormat
) -> QuantMatmulConfig:
    """(columns, K step) of the int8-activation GEMV: one column and 64 blocks a step where
    there are few columns (more programs) or three rows (q8_0: up to two rows and from five),
    else two columns and 32 blocks at one row, 16 at more."""
    # the columns up to which one-column programs win, by rows (4-bit formats)
    one_column_up_to = {1: 4096, 2: 8192, 3: num_cols}.get(num_rows, 0)
    if fmt.name == "q8_0":
        block_n, block_k = (2, 512) if num_rows in (3, 4) else (1, 2048)
    elif num_cols <= one_column_up_to:
        block_n, block_k = 1, 2048
    else:
        block_n, block_k = 2, 1024 if num_rows == 1 else 512
    block_k = min(block_k, max(triton.next_power_of_2(size_k), QK))
    return QuantMatmulConfig(block_n=block_n, block_k=block_k, num_warps=1, int8_x=True,
                             split_k=_gemv_split_k(num_cols, size_k, block_n))  # fmt: skip


def _gemv_split_k(num_cols: int, size_k: int, block_n: int) -> int:
    """K splits (a power of two) that bring a GEMV to GEMV_MIN_PROGRAMS programs, each split
    keeping 1024 elements of K or more."""
    split_k = 1
    while (triton.cdiv(num_cols, block_n) * split_k < GEMV_MIN_PROGRAMS
           and size_k // (split_k * 2) >= 1024):  # fmt: skip
        split_k *= 2
    return split_k


@functools.lru_cache(maxsize=256)
def default_gemm_config(num_rows: int, num_cols: int) -> QuantMatmulConfig:
    """Row tiles as tall as the batch needs (each weight tile is dequantized once per row
    tile), up to 128 rows for prefill where the dequantization must hide behind ``tl.dot``;
    column tiles narrow enough that a decode batch still gives every SM work."""
    block_m = min(128, max(16, triton.next_power_of_2(num_rows)))
    block_n = 128 if block_m == 128 else 64
    while (
        block_n > 32
        and triton.cdiv(num_rows, block_m) * triton.cdiv(num_cols, block_n) < GEMV_MIN_PROGRAMS
    ):
        block_n //= 2
    return QuantMatmulConfig(block_m=block_m, block_n=block_n, block_k=64,
                             num_warps=8 if block_m * block_n >= 128 * 64 else 4)  # fmt: skip
