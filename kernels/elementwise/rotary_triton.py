# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Rotary position embedding (neox, rotate-half) in Triton, matching ``rotary_ref``.

One program rotates one token: all its query heads, then all its key heads, IN PLACE. The
reference works in the input dtype (cos/sin cast to it, each product and the sum rounded);
the kernel computes in fp32 and rounds at the same points, so bf16 results agree bit for bit
up to the last-ulp effects of fused multiply-adds. The engine launches the fused
``rotary_kv_write_triton`` instead, built from this file's helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE and back: where the reference's dtype arithmetic rounds."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _load_halves(
    x_ptr,  # this token's [H, D]
    stride_xh,
    offs_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_HALF]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
):
    """The heads' halves ``(x1, x2)`` [BLOCK_H, BLOCK_HALF] in fp32; masked lanes are 0."""
    lo_ptrs = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate_halves(
    x1,  # [BLOCK_H, BLOCK_HALF] fp32, values of DTYPE
    x2,
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
    offs_d,  # [BLOCK_HALF]
    HALF: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``[x1, x2]`` rotated, in fp32, each value rounded to DTYPE as the reference's is."""
    mask_d = offs_d < HALF
    # 1. cos/sin of each half, in the input dtype as the reference casts them
    cos_lo = _rounded(tl.load(cos_ptr + offs_d, mask=mask_d, other=0.0), DTYPE)[None, :]
    cos_hi = _rounded(tl.load(cos_ptr + HALF + offs_d, mask=mask_d, other=0.0), DTYPE)[None, :]
    sin_lo = _rounded(tl.load(sin_ptr + offs_d, mask=mask_d, other=0.0), DTYPE)[None, :]
    sin_hi = _rounded(tl.load(sin_ptr + HALF + offs_d, mask=mask_d, other=0.0), DTYPE)[None, :]
    # 2. x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], rounding each product and sum
    lo = _rounded(x1 * cos_lo, DTYPE) + _rounded(-x2 * sin_lo, DTYPE)
    hi = _rounded(x2 * cos_hi, DTYPE) + _rounded(x1 * sin_hi, DTYPE)
    return _rounded(lo, DTYPE), _rounded(hi, DTYPE)


@triton.jit
def _rotated_halves(
    x_ptr,  # this token's [H, D]
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
    stride_xh,
    offs_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_HALF]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
):
    """The heads' rotated halves ``(lo, hi)`` [BLOCK_H, BLOCK_HALF] in fp32, each value
    rounded to x's dtype as the reference's result is; masked lanes are 0."""
    x1, x2 = _load_halves(x_ptr, stride_xh, offs_h, offs_d, mask, HALF)
    return _rotate_halves(x1, x2, cos_ptr, sin_ptr, offs_d, HALF, x_ptr.dtype.element_ty)


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's [H, D]
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
    stride_xh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the token's heads IN PLACE: each lane stores only what it loaded."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    lo, hi = _rotated_halves(x_ptr, cos_ptr, sin_ptr, stride_xh, offs_h, offs_d, mask, HALF)
    lo_ptrs = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    tl.store(lo_ptrs, lo.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptrs + HALF, hi.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _position_rows(positions_ptr, cos_ptr, sin_ptr, token, stride_cp):
    """The cos and sin table rows [D] of ``token``'s position."""
    position = tl.load(positions_ptr + token)
    return cos_ptr + position * stride_cp, sin_ptr + position * stride_cp


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh,  # q: [T, Hq, D], last stride 1
    stride_kt, stride_kh,  # k: [T, Hkv, D], last stride 1
    stride_cp,  # cos, sin: [max_pos, D]
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    cos_row, sin_row = _position_rows(positions_ptr, cos_ptr, sin_ptr, token, stride_cp)
    _rotate_heads(
        q_ptr + token * stride_qt, cos_row, sin_row, stride_qh,
        NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_kt, cos_row, sin_row, stride_kh,
        NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF,
    )  # fmt: skip


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k IN PLACE; returns ``(q, k)``, equal to ``rotary_ref`` of each.

    Shapes: ``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` (same dtype; last stride 1, other strides
    free, e.g. views into a fused qkv output); ``positions: [T]`` int32/int64;
    ``cos_cache, sin_cache: [max_pos, D]`` float32 (``rope_cos_sin_cache``), last stride 1.
    """
    check_rotary_args(q, k, positions, cos_cache, sin_cache)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        **rotary_shape(q, k),
    )  # fmt: skip
    return q, k


def rotary_shape(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    """The rotary kernels' head counts and half head dim, and their power-of-two blocks."""
    num_q_heads, num_kv_heads, half = q.shape[1], k.shape[1], q.shape[2] // 2
    return {"NUM_Q_HEADS": num_q_heads, "NUM_KV_HEADS": num_kv_heads, "HALF": half,
            "BLOCK_HQ": triton.next_power_of_2(num_q_heads),
            "BLOCK_HKV": triton.next_power_of_2(num_kv_heads),
            "BLOCK_HALF": triton.next_power_of_2(half)}  # fmt: skip


def check_rotary_args(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """q [T, Hq, D], k [T, Hkv, D] of one float dtype (last stride 1, even D), int positions
    [T], float32 cos/sin tables [max_pos, D]; all on one device."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be [T, Hq, D] and [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"q and k must share a dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.shape[2] % 2:
        raise ValueError("q and k need an even head dim with last stride 1")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be [T={q.shape[0]}] int, got {tuple(positions.shape)} {positions.dtype}"
        )
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if cache.dim() != 2 or cache.shape[1] != q.shape[2] or cache.dtype != torch.float32:
            raise ValueError(
                f"{name} must be [max_pos, D={q.shape[2]}] float32, got {tuple(cache.shape)} {cache.dtype}"
            )
    if cos_cache.stride() != sin_cache.stride() or cos_cache.stride(-1) != 1:
        raise ValueError("cos_cache and sin_cache need equal strides and last stride 1")
    devices = {t.device for t in (q, k, positions, cos_cache, sin_cache)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
