# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Decode GEMV for q8_0, q4_0 and q4_1 with the activations rounded to int8: integer dot products.

At one row the 4-bit GEMV of quant_gemv_blocked_triton.py is bound by instruction issue, not
by bytes (H100, llama3-8b's gate_up: 82% of issue slots taken, 42% of DRAM bandwidth): every
weight costs a nibble extraction, a conversion to float and an FMA. Here, as in llama.cpp's
``mmvq`` kernels, ``x`` is first rounded to int8 in 32-element blocks, each with its own scale
and sum (ggml's q8_1: ``x ~ dx * xq``, int8_rows_triton.py), and a 32-bit word of packed weights meets a word of
``xq`` in one ``dp4a`` (four int8 products added into an int32):

    word & 0x0F0F0F0F          the low nibbles of 4 bytes: elements j..j+3 of the block
    (word >> 4) & 0x0F0F0F0F   the high nibbles: elements 16+j..16+j+3

so eight weights cost three logic operations and two ``dp4a``, and a block's integer sum
``sum q xq`` is scaled once:

    q4_0: sum (q - 8) d x  ~ d (dx sum q xq - 8 s)     s = dx sum xq (x's block sum)
    q4_1: sum (d q + m) x  ~ d dx sum q xq + m s

q8_0's quants are int8 already: a word of them meets a word of ``xq`` in one ``dp4a``, and the
block's sum is scaled by ``d dx``.

The products are exact integers; what differs from the float GEMV is ``x``'s rounding to
int8, a relative error of at most 1/254 of its block's largest element, llama.cpp's own
trade. ``dp4a`` is inline PTX on CUDA; the interpreter (CPU tests) takes four byte products
in integer arithmetic, the same sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, store_split_k, tile_offsets
from kernels.linear.int8_rows_triton import Int8Rows, as_int8_rows
from kernels.linear.quant import QK, QuantFormat
from kernels.pdl import pdl_launch, wait_for_producers

INT8_X_FORMATS = ("q8_0", "q4_0", "q4_1")


@triton.jit
def _dot4(a, b, acc, ASM: tl.constexpr):
    """``acc + sum_i a_i b_i`` over the four signed bytes of int32 words ``a`` and ``b``."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    total = acc
    for i in tl.static_range(4):
        total += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return total


@triton.jit
def _quant_gemv_int8_kernel(
    xq_ptr, xd_ptr, xs_ptr, out_ptr, p0, p1, p2, s0, s1, s2,
    M, N, K,
    stride_qm,  # xq: [M, K / 4] int32 words
    stride_sm,  # xd, xs: [M, K / 32]
    stride_om,  # out: [M, N], last stride 1
    FORMAT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A program: ``BLOCK_N`` output columns for all rows, ``BLOCKS`` blocks a K step; the
    weight's quants ``p1`` as int32 words, eight a block for q8_0 (0), four for q4_0 (1) and
    q4_1 (2) (``s1`` in words)."""
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m = tl.arange(0, M_PAD)
    offs_4 = tl.arange(0, 4)
    offs_8 = tl.arange(0, 8)
    num_blocks = K // 32
    first_block, blocks_per_split = k_split(pid_k, num_blocks, BLOCKS, SPLIT_K)
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCKS), dtype=tl.float32)  # per block, added at the end
    for b0 in range(first_block, first_block + blocks_per_split, BLOCKS):
        blk = b0 + tl.arange(0, BLOCKS)
        mask_b = blk < num_blocks
        mask_nb = mask_n[:, None] & mask_b[None, :]  # [BLOCK_N, BLOCKS]
        if FORMAT == 0:  # q8_0: 8 words of int8 quants a block
            words = tl.load(p1 + offs_n[:, None, None] * s1 + blk[None, :, None] * 8 + offs_8,
                            mask=mask_nb[:, :, None], other=0)  # fmt: skip
        else:  # q4_0/q4_1: 4 words of nibbles a block
            words = tl.load(p1 + offs_n[:, None, None] * s1 + blk[None, :, None] * 4 + offs_4,
                            mask=mask_nb[:, :, None], other=0)  # fmt: skip
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
        d = tl.load(p0 + offs_n[:, None] * s0 + blk[None, :], mask=mask_nb, other=0.0)
        d = d.to(tl.float32)
        if FORMAT == 2:
            mins = tl.load(p2 + offs_n[:, None] * s2 + blk[None, :], mask=mask_nb, other=0.0)
            mins = mins.to(tl.float32)
        for m in tl.static_range(M_PAD):
            row_mask = mask_b & (blk * 0 + m < M)  # padding rows of x read nothing
            x_row = xq_ptr + m * stride_qm + blk[:, None] * 8
            if FORMAT == 0:
                x_all = tl.load(x_row + offs_8[None, :], mask=row_mask[:, None], other=0)
                x_all = tl.broadcast_to(x_all[None, :, :], (BLOCK_N, BLOCKS, 8))
                zero = tl.zeros((BLOCK_N, BLOCKS, 8), dtype=tl.int32)
                dots = tl.sum(_dot4(words, x_all, zero, ASM), axis=2)
            else:
                x_lo = tl.load(x_row + offs_4[None, :], mask=row_mask[:, None], other=0)
                x_hi = tl.load(x_row + 4 + offs_4[None, :], mask=row_mask[:, None], other=0)
                x_lo = tl.broadcast_to(x_lo[None, :, :], (BLOCK_N, BLOCKS, 4))
                x_hi = tl.broadcast_to(x_hi[None, :, :], (BLOCK_N, BLOCKS, 4))
                zero = tl.zeros((BLOCK_N, BLOCKS, 4), dtype=tl.int32)
                dots = tl.sum(_dot4(hi, x_hi, _dot4(lo, x_lo, zero, ASM), ASM), axis=2)
            dx = tl.load(xd_ptr + m * stride_sm + blk, mask=row_mask, other=0.0)[None, :]
            xs = tl.load(xs_ptr + m * stride_sm + blk, mask=row_mask, other=0.0)[None, :]
            if FORMAT == 0:  # q8_0
                block = d * dx * dots.to(tl.float32)
            elif FORMAT == 1:  # q4_0
                block = d * (dx * dots.to(tl.float32) - 8.0 * xs)
            else:  # q4_1
                block = d * dx * dots.to(tl.float32) + mins * xs
            acc += tl.where(offs_m[:, None, None] == m, block[None, :, :], 0.0)
    out_mask = (offs_m[:, None] < M) & mask_n[None, :]
    store_split_k(out_ptr, tl.sum(acc, axis=2), offs_m, offs_n, out_mask, stride_om, SPLIT_K)


def quant_gemv_int8(
    x: torch.Tensor | Int8Rows,  # [M, K], M <= 8: float rows, or rows already rounded
    out: torch.Tensor,  # [M, N] (fp32 and zeroed when split_k > 1)
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # three, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_n: int,
    blocks: int,  # 32-element blocks per K step
    split_k: int,
    num_warps: int = 1,
    num_stages: int = 3,
) -> None:
    """``out ~ x @ dequantize(w).T`` for q8_0/q4_0/q4_1 with ``x`` rounded to int8 per block
    (here, unless it comes rounded)."""
    if fmt.name not in INT8_X_FORMATS or size_k % QK:
        raise ValueError(f"quant_gemv_int8: {fmt.name} with K={size_k} has no int8 GEMV")
    if planes[1].stride(0) % 4 or planes[1].storage_offset() % 4:
        raise ValueError("quant_gemv_int8: the quants' rows must start on 4-byte boundaries")
    rows = as_int8_rows(x, size_k, "quant_gemv_int8")
    words = planes[1].view(torch.int32)  # [N, K / 4] (q8_0) or [N, K / 8] (4-bit)
    num_cols = planes[0].shape[0]
    grid = (triton.cdiv(num_cols, block_n), split_k)
    _quant_gemv_int8_kernel[grid](
        rows.xq.view(torch.int32), rows.xd, rows.xs, out, planes[0], words, planes[2],
        planes[0].stride(0), words.stride(0), planes[2].stride(0), rows.shape[0], num_cols,
        size_k, rows.xq.stride(0) // 4, rows.xd.stride(0), out.stride(0), FORMAT=fmt.kernel_id,
        M_PAD=rows_pad(rows.shape[0]), BLOCK_N=block_n, BLOCKS=blocks,
        SPLIT_K=split_k, ASM=rows.device.type == "cuda",
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(out),
    )  # fmt: skip
