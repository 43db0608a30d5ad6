# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Decode GEMV for q8_0, q4_0 and q4_1 with the activations rounded to int8: integer dot products.

At one row the 4-bit GEMV of quant_gemv_blocked_triton.py is bound by instruction issue, not
by bytes (H100, llama3-8b's gate_up: 82% of issue slots taken, 42% of DRAM bandwidth): every
weight costs a nibble extraction, a conversion to float and an FMA. Here, as in llama.cpp's
``mmvq`` kernels, ``x`` is first rounded to int8 in 32-element blocks, each with its own scale
and sum (ggml's q8_1: ``x ~ dx * xq``), and a 32-bit word of packed weights meets a word of
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, store_split_k, tile_offsets
from kernels.linear.quant import QK, QuantFormat
from kernels.pdl import pdl_launch, wait_for_producers

INT8_X_FORMATS = ("q8_0", "q4_0", "q4_1")
X_BLOCKS = 8  # 32-element blocks of x per program of the rounding kernel
# the float dtypes as kernels take them for a constexpr (the kernels that round their output)
TL_FLOAT_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


@triton.jit
def _round_half_away(v):
    r = tl.floor(tl.abs(v) + 0.5)
    return tl.where(v < 0, -r, r)


@triton.jit
def round_blocks_int8(x):
    """``x`` float32 ``[B, 32]`` -> ``(xq, dx, xs)``: each row a 32-element block rounded to
    ``xq = round(x / dx)`` with ``dx = amax / 127`` (halves away from zero), and ``xs = dx *
    sum xq``. The norms and SiLU that round their own output (kernels/elementwise/norm_triton.py,
    kernels/elementwise/activation_triton.py) call it too, through ``store_blocks_int8``, so
    that their blocks are the rounding kernel's bits."""
    amax = tl.max(tl.abs(x), axis=1)
    dx = amax * (1.0 / 127.0)  # a product, as torch computes amax / 127.0 on CUDA
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(safe.shape, 127.0, tl.float32), safe), 0.0)
    q = _round_half_away(x * inv[:, None])
    return q.to(tl.int8), dx, dx * tl.sum(q, axis=1)


@triton.jit
def store_blocks_int8(x, blk, num_blocks, xq_row, xd_row, xs_row):
    """Round ``x`` (float32 ``[B, 32]``: blocks ``blk`` of one row) with ``round_blocks_int8``
    and store the quants, scales and sums at that row's pointers; blocks from ``num_blocks``
    on are not stored. The rounding kernel and the kernels that round their own output share
    it."""
    q, dx, xs = round_blocks_int8(x)
    mask_b = blk < num_blocks
    tl.store(xq_row + blk[:, None] * 32 + tl.arange(0, 32)[None, :], q, mask=mask_b[:, None])
    tl.store(xd_row + blk, dx, mask=mask_b)
    tl.store(xs_row + blk, xs, mask=mask_b)


@triton.jit
def _quantize_x_kernel(
    x_ptr, xq_ptr, xd_ptr, xs_ptr,
    K,
    stride_xm,  # x: [M, K], last stride 1
    stride_qm,  # xq: [M, K] int8
    stride_sm,  # xd, xs: [M, K / 32] float32
    BLOCKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``, ``BLOCKS`` blocks from ``program_id(1) * BLOCKS``."""
    wait_for_producers(PDL)
    row = tl.program_id(0)
    blk, mask_b = tile_offsets(tl.program_id(1), BLOCKS, K // 32)
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask_b[:, None], other=0.0).to(tl.float32)
    store_blocks_int8(x, blk, K // 32, xq_ptr + row * stride_qm, xd_ptr + row * stride_sm,
                      xs_ptr + row * stride_sm)  # fmt: skip


@dataclass(frozen=True)
class Int8Rows:
    """Activation rows already rounded to int8 in 32-element blocks, ready for the int8
    kernels (this GEMV, quant_mma_int8_triton.py): from the rounding kernel
    (``round_rows_int8``) or from the kernel that produced the activations (a norm, SiLU),
    which then skips writing them in float. ``dtype``: the float dtype the rows had, which the
    output takes."""

    xq: torch.Tensor  # [M, K] int8
    xd: torch.Tensor  # [M, K / 32] float32: each block's scale
    xs: torch.Tensor  # [M, K / 32] float32: dx * sum(xq)
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape

    @property
    def device(self) -> torch.device:
        return self.xq.device

    @classmethod
    def empty(
        cls, num_rows: int, size_k: int, dtype: torch.dtype, device: torch.device
    ) -> Int8Rows:
        if size_k % QK:
            raise ValueError(f"int8 rows need whole {QK}-element blocks, got K={size_k}")
        xq = torch.empty(num_rows, size_k, dtype=torch.int8, device=device)
        xd = torch.empty(num_rows, size_k // QK, dtype=torch.float32, device=device)
        return cls(xq, xd, torch.empty_like(xd), dtype)


def round_rows_int8(x: torch.Tensor) -> Int8Rows:
    """``x [M, K]`` (K a multiple of 32) rounded for the int8 kernels by a kernel of its own:
    ``xq`` int8 [M, K], ``xd`` and ``xs`` float32 [M, K / 32]."""
    num_rows, size_k = x.shape
    rows = Int8Rows.empty(num_rows, size_k, x.dtype, x.device)
    grid = (num_rows, triton.cdiv(size_k // QK, X_BLOCKS))
    _quantize_x_kernel[grid](
        x, rows.xq, rows.xd, rows.xs, size_k, x.stride(0), rows.xq.stride(0), rows.xd.stride(0),
        BLOCKS=X_BLOCKS, **pdl_launch(x),
    )  # fmt: skip
    return rows


def quantize_x_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of ``round_rows_int8`` (the same operations in float32)."""
    blocks = x.float().view(x.shape[0], -1, QK)
    amax = blocks.abs().amax(dim=-1)
    dx = amax * (1.0 / 127.0)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    scaled = blocks * inv[..., None]
    q = torch.where(scaled < 0, -torch.floor(scaled.abs() + 0.5), torch.floor(scaled.abs() + 0.5))
    return q.to(torch.int8).view(x.shape), dx, dx * q.sum(dim=-1)


def as_int8_rows(x: torch.Tensor | Int8Rows, size_k: int, caller: str) -> Int8Rows:
    """What an int8 kernel multiplies: ``x`` itself when its producer rounded it, else ``x``
    rounded by the rounding kernel; its rows must be the weight's ``size_k`` long."""
    rows = x if isinstance(x, Int8Rows) else round_rows_int8(x)
    if rows.shape[1] != size_k:
        raise ValueError(f"{caller}: rows of {rows.shape[1]} elements, the weight's K={size_k}")
    return rows


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
