# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Decode GEMV for q8_0, q4_0, q4_1 and fp8 weights, the scale factored out of each block.

At batch 1 a linear streams its packed weight once; dequantizing element by element spends
several instructions per weight on loads and scale products, which at 4.5 bits a weight
costs more than the bytes. Here a program holds its tile as ``[BLOCK_N, BLOCKS, 32]`` (rows,
32-element blocks, elements) and, per block, sums the raw quants against ``x`` first:

    sum_j w_j x_j = d * sum_j q_j x_j              (q8_0)
                  = d * (sum_j q_j x_j - 8 sum_j x_j)   (q4_0)
                  = d * sum_j q_j x_j + m * sum_j x_j   (q4_1)

so each weight costs a nibble extraction and one fused multiply-add, and each block one scale.
fp8 has one scale per row: it multiplies the finished sums. The 4-bit tiles load each block's
16 bytes once and split them into the low nibbles (elements 0..15) and high (16..31), which
meet ``x[0:16]`` and ``x[16:32]`` of the block. ``SPLIT_K > 1`` adds fp32 partial sums
atomically into a zeroed buffer (common.py: ``store_split_k``).

The 4-bit formats go further, as at 4.5 bits a weight the instructions, not the bytes, bound
the kernel (H100: q4_0 and q8_0 took the same time per linear, q8_0 reading twice the bytes):

* A nibble ``q`` becomes the float ``1 + q / 16`` by integer logic alone: shifted into the
  top of a float32's mantissa under the exponent of 1.0 (``_unit_floats``). Converting an
  integer to a float is a quarter-rate instruction on NVIDIA GPUs, one per weight; this is two
  full-rate ones. The block sums then recover ``sum q x = 16 (sum f x - sum x)`` exactly up to
  fp32 rounding (``f x`` is exact: 5 significant bits times bf16's 8).
* Block sums stay per block in a ``[M_PAD, BLOCK_N, BLOCKS]`` accumulator and are added
  across blocks once, after the loop, not with a cross-thread reduction every step.

Together with one-warp programs of two columns (quant_matmul_config.py's
TUNED_GEMV), q4_0 on llama3-8b's four layer linears at one row 1.21x, at two 1.17x (H100,
quant-kernels-gemv-llama3-8b-h100.json). q8_0 keeps the per-step sums, which measured 4-6%
faster for it than deferring them; fp8 too (not measured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, store_split_k, tile_offsets
from kernels.linear.quant import QK, QuantFormat
from kernels.pdl import pdl_launch, wait_for_producers

BLOCKED_FORMATS = ("q8_0", "q4_0", "q4_1", "fp8")


@triton.jit
def _unit_floats(byte, SHIFT: tl.constexpr):
    """``1 + q / 16`` in float32 for the nibble of ``byte`` (int32) that ``<< SHIFT`` puts at
    mantissa bits 19..22 (19: the low nibble, 15: the high), under the bits of 1.0."""
    return (((byte << SHIFT) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _block_sums(x_ptr, q, lo, hi, m, blk, mask_b, M, stride_xm, FORMAT: tl.constexpr):
    """Row ``m`` of x against the tile: (per-block sum of q * x [BLOCK_N, BLOCKS], sum of x
    per block); for the 4-bit formats ``lo`` and ``hi`` hold unit floats, so the first sum is
    of ``(1 + q / 16) x``. The second ([1, BLOCKS]) is only used by the 4-bit formats."""
    x_row = x_ptr + m * stride_xm + blk * 32
    x_mask = mask_b & (blk * 0 + m < M)  # padding rows of x read nothing
    if FORMAT == 0 or FORMAT == 5:  # q8_0, fp8: [BLOCKS, 32]
        x = tl.load(x_row[:, None] + tl.arange(0, 32)[None, :], mask=x_mask[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        sums = tl.sum(q * x[None, :, :], axis=2)
        x_sums = tl.sum(x, axis=1)[None, :]
    else:  # q4_0, q4_1: the block's first and second halves, [1, BLOCKS, 16] like the tile
        x_lo_ptrs = x_row[None, :, None] + tl.arange(0, 16)[None, None, :]
        x_mask_3d = x_mask[None, :, None]
        x_lo = tl.load(x_lo_ptrs, mask=x_mask_3d, other=0.0).to(tl.float32)
        x_hi = tl.load(x_lo_ptrs + 16, mask=x_mask_3d, other=0.0).to(tl.float32)
        sums = tl.sum(lo * x_lo + hi * x_hi, axis=2)
        x_sums = tl.sum(x_lo + x_hi, axis=2)
    return sums, x_sums


@triton.jit
def _load_tile(p0, p1, p2, s0, s1, s2, offs_n, blk, mask_nb, FORMAT: tl.constexpr):
    """A K step's tile: quants as float32 ``q`` [BLOCK_N, BLOCKS, 32] (8-bit formats) or unit
    floats ``lo``, ``hi`` [BLOCK_N, BLOCKS, 16] (4-bit), scales ``d`` and (q4_1) ``mins``
    [BLOCK_N, BLOCKS]; what a format has not is a [1, 1(, 1)] zero."""
    mask_3d = mask_nb[:, :, None]
    rows = offs_n[:, None, None]
    q = tl.zeros((1, 1, 1), dtype=tl.float32)
    lo = q
    hi = q
    if FORMAT == 5:  # fp8: w is plane 0
        offs = rows * s0 + blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        q = tl.load(p0 + offs, mask=mask_3d, other=0.0).to(tl.float32)
    elif FORMAT == 0:  # q8_0: d, qs
        offs = rows * s1 + blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        q = tl.load(p1 + offs, mask=mask_3d, other=0).to(tl.float32)
    else:  # q4_0: d, qs / q4_1: d, qs, m
        offs = rows * s1 + blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        byte = tl.load(p1 + offs, mask=mask_3d, other=0).to(tl.int32)
        lo = _unit_floats(byte, 19)
        hi = _unit_floats(byte, 15)
    d = tl.zeros((1, 1), dtype=tl.float32)
    mins = d
    if FORMAT != 5:
        d = tl.load(p0 + offs_n[:, None] * s0 + blk[None, :], mask=mask_nb, other=0.0)
        d = d.to(tl.float32)
    if FORMAT == 2:
        mins = tl.load(p2 + offs_n[:, None] * s2 + blk[None, :], mask=mask_nb, other=0.0)
        mins = mins.to(tl.float32)
    return q, lo, hi, d, mins


@triton.jit
def _quant_gemv_blocked_kernel(
    x_ptr, out_ptr, p0, p1, p2, s0, s1, s2,
    M, N, K,
    stride_xm,  # x: [M, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    FORMAT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m = tl.arange(0, M_PAD)
    num_blocks = K // 32
    first_block, blocks_per_split = k_split(pid_k, num_blocks, BLOCKS, SPLIT_K)
    FOUR_BIT: tl.constexpr = FORMAT == 1 or FORMAT == 2
    if FOUR_BIT:  # block sums, added across blocks after the loop
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCKS), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for b0 in range(first_block, first_block + blocks_per_split, BLOCKS):
        blk = b0 + tl.arange(0, BLOCKS)
        mask_b = blk < num_blocks
        mask_nb = mask_n[:, None] & mask_b[None, :]  # [BLOCK_N, BLOCKS]
        # 1. the tile's quants, scales and (q4_1) mins
        q, lo, hi, d, mins = _load_tile(p0, p1, p2, s0, s1, s2, offs_n, blk, mask_nb, FORMAT)
        # 2. per row of x: block sums, scaled once per block
        for m in tl.static_range(M_PAD):
            sums, x_sums = _block_sums(x_ptr, q, lo, hi, m, blk, mask_b, M, stride_xm, FORMAT)
            if FORMAT == 5:
                scaled = sums
            elif FORMAT == 0:
                scaled = d * sums
            elif FORMAT == 1:  # sum (q - 8) x = 16 sum f x - 24 sum x
                scaled = d * (16.0 * sums - 24.0 * x_sums)
            else:  # d sum q x + m sum x, sum q x = 16 (sum f x - sum x)
                scaled = d * (16.0 * (sums - x_sums)) + mins * x_sums
            if FOUR_BIT:
                acc += tl.where(offs_m[:, None, None] == m, scaled[None, :, :], 0.0)
            else:
                acc += tl.where(offs_m[:, None] == m, tl.sum(scaled, axis=1)[None, :], 0.0)
    if FOUR_BIT:
        acc = tl.sum(acc, axis=2)
    if FORMAT == 5:  # 3. fp8: the row scale, once
        acc *= tl.load(p1 + offs_n * s1, mask=mask_n, other=0.0)[None, :]
    out_mask = (offs_m[:, None] < M) & mask_n[None, :]
    store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K)


def quant_gemv_blocked(
    x: torch.Tensor,  # [M, K], M <= 8
    out: torch.Tensor,  # [M, N] (fp32 and zeroed when split_k > 1)
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # three, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_n: int,
    blocks: int,  # 32-element blocks per K step
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = x @ dequantize(w).T`` for a format of BLOCKED_FORMATS; K a multiple of 32."""
    if fmt.name not in BLOCKED_FORMATS or size_k % QK:
        raise ValueError(f"quant_gemv_blocked: {fmt.name} with K={size_k} is not blocked")
    num_cols = planes[0].shape[0]
    grid = (triton.cdiv(num_cols, block_n), split_k)
    _quant_gemv_blocked_kernel[grid](
        x, out, *planes, *(p.stride(0) for p in planes), x.shape[0], num_cols, size_k,
        x.stride(0), out.stride(0), FORMAT=fmt.kernel_id,
        M_PAD=rows_pad(x.shape[0]), BLOCK_N=block_n, BLOCKS=blocks,
        SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages, **pdl_launch(x),
    )  # fmt: skip
