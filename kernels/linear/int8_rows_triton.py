# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Activation rows rounded to int8 in 32-element blocks, for the int8 matmuls.

As ggml's q8_1 does, each block of 32 elements of a row ``x`` is rounded to ``x ~ dx * xq``:
``xq`` int8, ``dx = amax / 127`` its float32 scale, and ``xs = dx * sum xq`` its sum (the
4-bit formats' offsets multiply it). The int8 GEMV (quant_gemv_int8_triton.py) and the int8
tensor-core kernel (quant_mma_int8_triton.py) multiply such rows (``Int8Rows``). They come
from the rounding kernel here (``round_rows_int8``) or from the kernel that produced the
activations (the norms and SiLU of kernels/elementwise/, through ``store_blocks_int8``),
which then skips writing them in float; both round with ``round_blocks_int8``, bit for bit
the torch reference ``quantize_x_int8_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear.common import tile_offsets
from kernels.linear.quant import QK
from kernels.pdl import pdl_launch, wait_for_producers

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
    kernels (quant_gemv_int8_triton.py, quant_mma_int8_triton.py): from the rounding kernel
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
