# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Activations to fp8 e4m3 with a scale per row (dynamic, per token), in one kernel.

``torch._scaled_mm`` multiplies fp8 operands; the W8A8 path (quant.py's
``fp8_scaled_mm``) first rounds each row of ``x`` to e4m3 under the scale ``amax / 448``.
In torch ops that is seven kernels and three fp32 copies of ``x`` per linear (abs, amax,
the scale, the fp32 copy, the division, the clamp, the cast); here one program reads its row,
finds its largest magnitude and writes the quantized row and its scale. The arithmetic is
``quantize_rows_fp8``'s: the scale ``amax * (1/448)``, an IEEE division by it, saturation at
+-448, then e4m3's round-to-nearest-even, so both give the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.quant import FP8_MAX, quantize_rows_fp8
from kernels.pdl import pdl_launch, wait_for_producers

E4M3_MAX = tl.constexpr(FP8_MAX)
INV_E4M3_MAX = tl.constexpr(1.0 / FP8_MAX)  # rounded to fp32 where it multiplies, as in torch
MAX_BLOCK_K = 4096  # elements a program holds at once; longer rows take two passes
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    K,
    stride_xm,  # x: [M, K], last stride 1
    stride_qm,  # q: [M, K] e4m3, last stride 1
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # K <= BLOCK_K: the row stays in registers
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    # 1. the row's largest magnitude
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax_parts = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax_parts = tl.maximum(amax_parts, tl.abs(part))
        amax = tl.max(amax_parts, axis=0)
    # 2. the scale (1 for a row of zeros), then the row divided by it, saturated and rounded
    scale = tl.where(amax == 0.0, 1.0, amax * INV_E4M3_MAX)
    tl.store(scale_ptr + row, scale)
    if ONE_PASS:
        q = tl.clamp(tl.math.div_rn(x, scale), -E4M3_MAX, E4M3_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            part = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(part, scale), -E4M3_MAX, E4M3_MAX)
            tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last stride 1) -> (e4m3 ``[M, K]``, float32 scales ``[M, 1]``), equal to
    quant.py's ``quantize_rows_fp8``."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"quantize_rows_fp8: x [M, K] in {SUPPORTED_DTYPES} with last stride 1, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    num_rows, size_k = x.shape
    q = torch.empty(num_rows, size_k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block_k = min(MAX_BLOCK_K, max(triton.next_power_of_2(size_k), 16))
    _quantize_rows_fp8_kernel[(num_rows,)](
        x, q, scale, size_k, x.stride(0), q.stride(0),
        BLOCK_K=block_k, ONE_PASS=size_k <= block_k,
        num_warps=max(1, min(8, block_k // 512)), **pdl_launch(x),
    )  # fmt: skip
    return q, scale


def fp8_scaled_mm(
    x: torch.Tensor,  # [M, K]
    planes: dict[str, torch.Tensor],
    out: torch.Tensor | None = None,  # [M, N] bf16, last stride 1
) -> torch.Tensor:  # [M, N] bf16: ``out`` where given
    """``x [M, K] @ w.T`` on fp8 tensor cores: x quantized per row, ``torch._scaled_mm`` with
    both row scales (W8A8; bf16 out). For prefill and decode batches beyond the GEMV, where
    the fp8 matmul's speed pays for the activations' rounding; the GEMV keeps x in its dtype
    (quant_gemv_blocked_triton.py). CPU tensors take the torch reference of the rounding."""
    if x.is_cuda:
        x_fp8, x_scale = quantize_rows_fp8_triton(x)
    else:
        x_fp8, x_scale = quantize_rows_fp8(x)
    w, w_scale = planes["w"], planes["scale"]  # [N, K] e4m3, [N, 1] f32
    return torch._scaled_mm(
        x_fp8, w.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16, out=out
    )
