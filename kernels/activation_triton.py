# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""SiLU-and-mul in Triton, matching ``kernels.activation.silu_and_mul_ref``.

A program handles ``BLOCK_D`` columns of one row: ``silu(gate) * up``, fp32 math, with the
reference's rounding points (``silu(gate)`` is rounded to the input dtype before the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_producers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_D = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gt,  # gate_up: [T, 2 * D], last stride 1
    stride_ot,  # out: [T, D], last stride 1
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_d, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * D]`` (gate then up) -> new ``[T, D]`` = ``silu(gate) * up``.

    ``gate_up`` needs last stride 1; leading dims beyond one are flattened (``[..., 2 * D]``).
    """
    if gate_up.dim() < 2 or gate_up.shape[-1] % 2 or gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"gate_up must be [T, 2 * D] in {SUPPORTED_DTYPES}, got "
            f"{tuple(gate_up.shape)} {gate_up.dtype}"
        )
    if gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up's last dim must be contiguous, got strides {gate_up.stride()}")
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # [T, 2 * D]
    size = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], size, dtype=rows.dtype, device=rows.device)
    if rows.shape[0] > 0:
        block_d = min(MAX_BLOCK_D, triton.next_power_of_2(size))
        grid = (rows.shape[0], triton.cdiv(size, block_d))
        _silu_and_mul_kernel[grid](
            rows,
            out,
            rows.stride(0),
            out.stride(0),
            D=size,
            BLOCK_D=block_d,
            num_warps=4,
            **pdl_launch(rows),
        )
    return out.view(*gate_up.shape[:-1], size)
