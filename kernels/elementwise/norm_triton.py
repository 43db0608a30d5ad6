# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""RMSNorm and fused residual-add + RMSNorm in Triton, matching ``norm``.

One program normalizes one row. The math follows ``rms_norm_ref`` step by step, roundings
included: the sum ``x + residual`` is rounded to the input dtype, the statistics are fp32,
the normalized row is cast back to the input dtype, and only then multiplied by the weight.

``rms_norm_int8`` and ``fused_add_rms_norm_int8`` feed a quantized linear that takes the int8
GEMV (kernels/linear/quant_gemv_int8_triton.py): the normalized row, rounded to its float
dtype as above, is rounded to int8 blocks (kernels/linear/int8_rows_triton.py) by the norm's
own programs and never written in float. That saves the rounding kernel's launch, two of the
four a decoder layer has (H100, q4_0 llama3-8b at one row: 128 launches of 1.4 us, 7% of the
step). One program rounding a whole row made the step slower than the two launches (2.56
against 2.44 ms): a row is split into chunks, each program recomputing the row's statistics,
so that the rounding spreads over SMs as the rounding kernel's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.int8_rows_triton import TL_FLOAT_DTYPES, Int8Rows, store_blocks_int8
from kernels.pdl import pdl_launch, wait_for_producers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements a program rounds to int8 (8 blocks, as the rounding kernel's programs): a row's
# programs each read the whole row for its statistics, and round their own chunk.
INT8_CHUNK = 256


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, xq_ptr, xd_ptr, xs_ptr,
    eps,
    stride_xt, stride_xh,  # x: [T, H, N] (H = 1 for a [T, N] input); last stride 1
    stride_rt,  # residual: [T, N]
    stride_ot, stride_oh,  # out: like x
    stride_ut,  # sum: [T, N] (ROUND_INT8 with a residual)
    stride_qt, stride_st,  # xq [T, N] int8, xd and xs [T, N / 32] (ROUND_INT8, H = 1)
    NUM_HEADS: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_INT8: tl.constexpr,  # store CHUNK elements as int8 blocks (xq, xd, xs), not out
    CHUNK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program ``(row, 0)`` normalizes the row; with ROUND_INT8, program ``(row, c)`` takes
    the row's statistics and rounds elements ``[c * CHUNK, (c + 1) * CHUNK)``, and the sum
    with the residual goes to ``sum`` (other programs still read the residual)."""
    wait_for_producers(PDL)
    row = tl.program_id(0)
    token = row // NUM_HEADS
    head = row % NUM_HEADS
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    # 1. the row, summed with the residual (rounded to the input dtype, stored back)
    x_row = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(x_row + offs_n, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + token * stride_rt + offs_n
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        if not ROUND_INT8:
            tl.store(residual_ptrs, x, mask=mask)
    # 2. fp32 statistics: x * rsqrt(mean(x^2) + eps), cast back to the input dtype
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / N
    rstd = tl.rsqrt(variance + eps)
    if ROUND_INT8:  # 3. this program's chunk: the same steps, then int8 blocks
        offs_c = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask_c = offs_c < N
        xc = tl.load(x_row + offs_c, mask=mask_c, other=0.0)
        if HAS_RESIDUAL:
            rc = tl.load(residual_ptr + token * stride_rt + offs_c, mask=mask_c, other=0.0)
            xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
            tl.store(sum_ptr + token * stride_ut + offs_c, xc, mask=mask_c)
        normed = (xc.to(tl.float32) * rstd).to(xc.dtype)
        weight = tl.load(weight_ptr + offs_c, mask=mask_c, other=0.0)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(OUT_DTYPE)
        blk = tl.program_id(1) * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
        store_blocks_int8(
            tl.reshape(out.to(tl.float32), (CHUNK // 32, 32)), blk, N // 32,
            xq_ptr + token * stride_qt, xd_ptr + token * stride_st, xs_ptr + token * stride_st,
        )  # fmt: skip
    else:  # 3. times the weight, in the output (promoted) dtype
        normed = (x32 * rstd).to(x.dtype)
        weight = tl.load(weight_ptr + offs_n, mask=mask, other=0.0)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(OUT_DTYPE)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_n, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; matches ``norm.rms_norm_ref``.

    Shapes: ``x: [T, N]`` or ``[T, H, N]`` (per-head norms, e.g. Qwen3's q/k norm), last
    stride 1, other strides free; ``weight: [N]`` contiguous. Returns a new contiguous tensor
    of shape ``x.shape`` in ``promote_types(x.dtype, weight.dtype)``.
    """
    _check_norm_args(x, weight)
    x3 = x if x.dim() == 3 else x[:, None, :]  # [T, H, N]
    out = torch.empty(x3.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x3, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x``, then RMSNorm of the sum; matches ``fused_add_rms_norm_ref``.

    Shapes: ``x, residual: [T, N]``, same dtype, last stride 1; ``weight: [N]``. Works IN PLACE
    on ``residual``: it is overwritten with the sum and returned as the new residual.
    Returns ``(normed, residual)``.
    """
    _check_norm_args(x, weight)
    _check_residual(x, residual)
    x3 = x[:, None, :]
    out = torch.empty(x3.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x3, residual, weight, out, eps)
    return out.view(x.shape), residual


def rms_norm_int8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Int8Rows:
    """``rms_norm(x, weight, eps)`` rounded for the int8 kernels (``round_rows_int8`` of it, bit
    for bit) by the norm's own program. ``x: [T, N]``, N a multiple of 32."""
    _check_norm_args(x, weight)
    _check_int8_rows(x)
    rows = Int8Rows.empty(
        x.shape[0], x.shape[1], torch.promote_types(x.dtype, weight.dtype), x.device
    )
    _launch(x[:, None, :], None, weight, rows, eps)
    return rows


def fused_add_rms_norm_int8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Int8Rows, torch.Tensor]:
    """``fused_add_rms_norm`` with the normed rows rounded for the int8 kernels, as
    ``rms_norm_int8``. The sum comes back in a new tensor: ``residual`` is left as it was,
    since the row's programs all read it."""
    _check_norm_args(x, weight)
    _check_int8_rows(x)
    _check_residual(x, residual)
    rows = Int8Rows.empty(
        x.shape[0], x.shape[1], torch.promote_types(x.dtype, weight.dtype), x.device
    )
    total = torch.empty_like(residual)
    _launch(x[:, None, :], residual, weight, rows, eps, total)
    return rows, total


def _launch(
    x: torch.Tensor,  # [T, H, N]
    residual: torch.Tensor | None,  # [T, N]
    weight: torch.Tensor,  # [N]
    out: torch.Tensor | Int8Rows,  # [T, H, N], or int8 blocks of [T, N] (H = 1)
    eps: float,
    total: torch.Tensor | None = None,  # [T, N]: x + residual, when out is Int8Rows
) -> None:
    num_tokens, num_heads, size = x.shape
    if num_tokens * num_heads == 0:
        return
    chunks = 1
    if isinstance(out, Int8Rows):
        floats, (xq, xd, xs) = x, (out.xq, out.xd, out.xs)  # floats: never written
        total = total if total is not None else x  # never written without a residual
        strides = (0, 0, total.stride(0), xq.stride(0), xd.stride(0))
        chunks = triton.cdiv(size, INT8_CHUNK)
    else:
        floats, total, xq, xd, xs = out, out, out, out, out  # the int8 side: never touched
        strides = (out.stride(0), out.stride(1), 0, 0, 0)
    _rms_norm_kernel[(num_tokens * num_heads, chunks)](
        x, residual if residual is not None else x, weight, floats, total, xq, xd, xs,
        eps,
        x.stride(0), x.stride(1),
        residual.stride(0) if residual is not None else 0,
        *strides,
        NUM_HEADS=num_heads,
        N=size,
        BLOCK_N=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
        ROUND_INT8=isinstance(out, Int8Rows),
        CHUNK=INT8_CHUNK,
        OUT_DTYPE=TL_FLOAT_DTYPES[out.dtype],
        num_warps=_num_warps(size),
        **pdl_launch(x),
    )  # fmt: skip


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"x and residual must be [T, N] of one dtype, got {tuple(x.shape)} {x.dtype} and "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    if residual.stride(-1) != 1 or residual.device != x.device:
        raise ValueError("residual must have last stride 1 and sit on x's device")


def _check_int8_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[-1] % 32:
        raise ValueError(f"int8 rows are [T, N] with N a multiple of 32, got {tuple(x.shape)}")


def _num_warps(size: int) -> int:
    """About 256 elements per warp, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(size) // 256))


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() not in (2, 3) or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be [T, N] or [T, H, N] in {SUPPORTED_DTYPES}, got {tuple(x.shape)} {x.dtype}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"x's last dim must be contiguous (stride 1), got strides {x.stride()}")
    if weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous [{x.shape[-1]}] vector, got {tuple(weight.shape)}"
        )
    if weight.dtype not in SUPPORTED_DTYPES or weight.device != x.device:
        raise ValueError(
            f"weight must be a float tensor on {x.device}, got {weight.dtype} on {weight.device}"
        )
