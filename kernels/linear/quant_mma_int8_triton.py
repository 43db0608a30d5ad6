# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Decode batches of q8_0, q4_0 and q4_1 on int8 tensor cores, the activations rounded to int8.

quant_mma_triton.py forms every weight as a 16-bit float before its dot: for q8_0 an
int-to-float conversion and a scale product per weight, which bounds it at 8-16 rows (H100,
llama3-8b, a layer's four linears at 8 rows: 207 us in q8_0 against bf16 cuBLAS's 165 and a
77 us streaming limit). Here, as llama.cpp's ``mmq`` kernels do, the activations come as the
int8 GEMV takes them (int8_rows_triton.py: 32-element blocks ``x ~ dx * xq``,
from the kernel that produced them or the rounding kernel) and each 32-element block of the
weight meets them in one int8 dot, scaled once per output:

    q8_0:  sum_b d_b dx_b (q_b . xq_b)
    q4_0:  sum_b d_b dx_b ((q_b - 8) . xq_b)
    q4_1:  sum_b d_b dx_b (q_b . xq_b) + m_b (dx_b sum xq_b)

q8_0's quants go to the dot as they are in memory; a 4-bit block's 16 bytes become 32 int8
values by a mask and a shift, interleaved (element j's low nibble beside element 16 + j's
high one), and ``xq`` is read in that same order. The tile is transposed as in the float
kernel (``out^T = w @ x^T``): the weight is the dot's tall side, the batch its narrow one.
The products are exact integers; what differs from the float path is x's rounding, the int8
GEMV's trade (a relative error of at most 1/254 of a block's largest element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import (
    add_split_k_planes,
    k_split,
    plane_strides,
    split_k_planes,
    store_split_k_plane,
    tile_offsets,
)
from kernels.linear.int8_rows_triton import Int8Rows, as_int8_rows
from kernels.linear.quant import QK, QuantFormat
from kernels.linear.quant_gemv_int8_triton import INT8_X_FORMATS
from kernels.linear.quant_mma_triton import MIN_BLOCK_M
from kernels.pdl import pdl_launch, wait_for_producers


@triton.jit
def _quant_mma_int8_kernel(
    xq_ptr, xd_ptr, xs_ptr, out_ptr, p0, p1, p2, s0, s1, s2,
    M, N, K,
    stride_qm,  # xq: [M, K] int8
    stride_sm,  # xd, xs: [M, K / 32] float32
    stride_om,  # out: [M, N] (a plane of [SPLIT_K, M, N] when split), last stride 1
    stride_split,  # between the planes of the K splits
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A program: ``out^T[BLOCK_N, BLOCK_M]`` over its split of K, one int8 dot a block."""
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m, mask_m = tile_offsets(pid_m, BLOCK_M, M)
    offs_32 = tl.arange(0, 32)
    if FORMAT == 0:  # noqa: SIM108 (constexpr branches)  q8_0: elements in order
        order = offs_32
    else:  # 4-bit: element j beside element 16 + j, as the nibbles come out
        order = offs_32 // 2 + (offs_32 % 2) * 16
    num_blocks = K // 32
    first_block, blocks_per_split = k_split(pid_k, num_blocks, BLOCKS, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for b0 in range(first_block, first_block + blocks_per_split, BLOCKS):
        for i in tl.static_range(BLOCKS):
            blk = b0 + i
            # (a block past K: the masks as tensors, which the interpreter needs)
            valid_n = mask_n & (offs_n * 0 + blk < num_blocks)  # [BLOCK_N]
            valid_m = mask_m & (offs_m * 0 + blk < num_blocks)  # [BLOCK_M]
            if FORMAT == 0:
                w = tl.load(p1 + offs_n[:, None] * s1 + blk * 32 + offs_32[None, :],
                            mask=valid_n[:, None] & (offs_32 < 32)[None, :], other=0)  # fmt: skip
            else:
                offs_16 = tl.arange(0, 16)
                byte = tl.load(p1 + offs_n[:, None] * s1 + blk * 16 + offs_16[None, :],
                               mask=valid_n[:, None] & (offs_16 < 16)[None, :], other=0)  # fmt: skip
                lo = (byte & 0xF).to(tl.int8)
                hi = (byte >> 4).to(tl.int8)
                w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))
                if FORMAT == 1:  # q4_0: q - 8
                    w = w - 8
            x = tl.load(xq_ptr + offs_m[None, :] * stride_qm + blk * 32 + order[:, None],
                        mask=(order < 32)[:, None] & valid_m[None, :], other=0)  # fmt: skip
            dots = tl.dot(w, x, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_M], exact
            d = tl.load(p0 + offs_n * s0 + blk, mask=valid_n, other=0.0).to(tl.float32)
            dx = tl.load(xd_ptr + offs_m * stride_sm + blk, mask=valid_m, other=0.0)
            acc += dots.to(tl.float32) * (d[:, None] * dx[None, :])
            if FORMAT == 2:  # q4_1: the block's minimum times x's block sum
                mins = tl.load(p2 + offs_n * s2 + blk, mask=valid_n, other=0.0)
                xs = tl.load(xs_ptr + offs_m * stride_sm + blk, mask=valid_m, other=0.0)
                acc += mins.to(tl.float32)[:, None] * xs[None, :]
    store_split_k_plane(
        out_ptr, acc, pid_k, offs_n, mask_n, offs_m, mask_m, stride_om, stride_split
    )


def quant_mma_int8(
    x: torch.Tensor | Int8Rows,  # [M, K]: float rows, or rows already rounded
    out: torch.Tensor,  # [M, N]
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # three, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_m: int,
    block_n: int,
    blocks: int,  # 32-element blocks per K step
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out ~ x @ dequantize(w).T`` on int8 tensor cores, ``x`` rounded to int8 per block."""
    if fmt.name not in INT8_X_FORMATS or size_k % QK:
        raise ValueError(f"quant_mma_int8: {fmt.name} with K={size_k} has no int8 tensor-core path")
    if block_m < MIN_BLOCK_M:
        raise ValueError(f"quant_mma_int8: block_m {block_m} < {MIN_BLOCK_M}")
    rows = as_int8_rows(x, size_k, "quant_mma_int8")
    num_cols, num_rows = planes[0].shape[0], rows.shape[0]
    grid = (triton.cdiv(num_cols, block_n), triton.cdiv(num_rows, block_m), split_k)
    target = split_k_planes(out, split_k)
    _quant_mma_int8_kernel[grid](
        rows.xq, rows.xd, rows.xs, target, *planes, *(p.stride(0) for p in planes), num_rows,
        num_cols, size_k, rows.xq.stride(0), rows.xd.stride(0), *plane_strides(target),
        FORMAT=fmt.kernel_id, BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS=blocks, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(out),
    )  # fmt: skip
    add_split_k_planes(out, target)
