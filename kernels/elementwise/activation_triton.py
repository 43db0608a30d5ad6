# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""SiLU-and-mul in Triton, matching ``activation.silu_and_mul_ref``.

A program handles ``BLOCK_D`` columns of one row: ``silu(gate) * up``, fp32 math, with the
reference's rounding points (``silu(gate)`` is rounded to the input dtype before the product).
``silu_and_mul_int8`` rounds the product to int8 blocks for a quantized ``down_proj`` that
takes an int8 kernel, in the same program (norm_triton.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.int8_rows_triton import TL_FLOAT_DTYPES, Int8Rows, store_blocks_int8
from kernels.pdl import pdl_launch, wait_for_producers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_D = 1024  # columns per program
INT8_BLOCK_D = 256  # ... rounding them to int8 blocks: 8 blocks, as the rounding kernel


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,  # [T, D]; with ROUND_INT8 the int8 xq, beside xd and xs [T, D / 32]
    xd_ptr,
    xs_ptr,
    stride_gt,  # gate_up: [T, 2 * D], last stride 1
    stride_ot,  # out: [T, D], last stride 1
    stride_st,  # xd, xs
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_INT8: tl.constexpr,
    DTYPE: tl.constexpr,  # gate_up's
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    token = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs_d < D
    row_ptr = gate_up_ptr + token * stride_gt
    # 1. gate = first half, up = second half of the row
    gate = tl.load(row_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + D + offs_d, mask=mask, other=0.0).to(tl.float32)
    # 2. silu(gate) = gate * sigmoid(gate), rounded to the input dtype as the reference does
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    out = (silu * up).to(DTYPE)
    if ROUND_INT8:  # 3. rounded to int8 blocks (BLOCK_D holds whole ones), as round_rows_int8
        blk = tl.program_id(1) * (BLOCK_D // 32) + tl.arange(0, BLOCK_D // 32)
        store_blocks_int8(
            tl.reshape(out.to(tl.float32), (BLOCK_D // 32, 32)), blk, D // 32,
            out_ptr + token * stride_ot, xd_ptr + token * stride_st, xs_ptr + token * stride_st,
        )  # fmt: skip
    else:
        tl.store(out_ptr + token * stride_ot + offs_d, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * D]`` (gate then up) -> new ``[T, D]`` = ``silu(gate) * up``.

    ``gate_up`` needs last stride 1; leading dims beyond one are flattened (``[..., 2 * D]``).
    """
    rows = _check(gate_up)
    out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=rows.dtype, device=rows.device)
    _launch(rows, out)
    return out.view(*gate_up.shape[:-1], out.shape[1])


def silu_and_mul_int8(gate_up: torch.Tensor) -> Int8Rows:
    """``silu_and_mul(gate_up)`` rounded for the int8 kernels (``round_rows_int8`` of it, bit for
    bit) by the activation's own programs. ``gate_up: [T, 2 * D]``, D a multiple of 32."""
    rows = _check(gate_up)
    if gate_up.dim() != 2 or rows.shape[1] % 64:
        raise ValueError(f"int8 rows need gate_up [T, 2 * D], D a multiple of 32, got "
                         f"{tuple(gate_up.shape)}")  # fmt: skip
    out = Int8Rows.empty(rows.shape[0], rows.shape[1] // 2, rows.dtype, rows.device)
    _launch(rows, out)
    return out


def _check(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` as ``[T, 2 * D]`` rows, checked."""
    if gate_up.dim() < 2 or gate_up.shape[-1] % 2 or gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"gate_up must be [T, 2 * D] in {SUPPORTED_DTYPES}, got "
            f"{tuple(gate_up.shape)} {gate_up.dtype}"
        )
    if gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up's last dim must be contiguous, got strides {gate_up.stride()}")
    return gate_up.reshape(-1, gate_up.shape[-1])


def _launch(rows: torch.Tensor, out: torch.Tensor | Int8Rows) -> None:
    if rows.shape[0] == 0:
        return
    size = rows.shape[1] // 2
    block_d = max(32, min(MAX_BLOCK_D, triton.next_power_of_2(size)))
    if isinstance(out, Int8Rows):
        block_d = min(block_d, INT8_BLOCK_D)
        values, xd, xs, stride_s = out.xq, out.xd, out.xs, out.xd.stride(0)
    else:
        values, xd, xs, stride_s = out, out, out, 0  # xd, xs: never touched
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block_d))](
        rows, values, xd, xs, rows.stride(0), values.stride(0), stride_s,
        D=size, BLOCK_D=block_d, ROUND_INT8=isinstance(out, Int8Rows),
        DTYPE=TL_FLOAT_DTYPES[rows.dtype], num_warps=4, **pdl_launch(rows),
    )  # fmt: skip
