# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Rotary embedding fused with the KV write: one launch per layer in place of two (four
with Qwen3's per-head q and k norms, which it folds in as well).

One program takes one new token: it rotates all its query heads IN PLACE (attention reads q
from there), rotates its key heads and stores them straight into the token's slot of the
page pool, and stores its value heads beside them. The rotated keys never go back to ``k``:
both attention kernels read K/V from the pages only. A negative slot (padding rows of a CUDA
graph) still rotates q but stores nothing.

With ``head_norms`` (Qwen3) each q and k head is RMS-normed first, from the same load: the
statistics in fp32 over the whole head, the normed row cast to the input dtype, then times
the weight and cast again, as ``rms_norm_ref`` (HF's Qwen3RMSNorm) does. The unfused norm
kernel sums the squares in another order, so its output may differ from this one's by the
last bit of a value; both stay within the tests' tolerance of the reference.

The math is ``rotary_triton``'s and ``kv_write_triton``'s, through their helpers: without
norms the pool receives bit for bit what ``rotary`` followed by ``write_kv`` stores (fp8
scales included), and the reference is (``rms_norm_ref``,) ``rotary_ref`` then
``write_kv_ref`` (``rotary_write_kv_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_write_triton import (
    PoolScales,
    _fp8_scale,
    _slot_offsets,
    _store_fp8,
    _store_token,
    check_write_args,
)
from kernels.elementwise.norm import HeadNorms
from kernels.elementwise.rotary_triton import (
    _load_halves,
    _position_rows,
    _rotate_halves,
    _rounded,
    check_rotary_args,
    rotary_shape,
)
from kernels.pdl import pdl_launch, wait_for_producers


@triton.jit
def _normed_rotated_halves(
    x_ptr,  # this token's [H, D], last stride 1
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
    weight_ptr,  # the norm's weight [D] (HAS_NORM only)
    eps,
    stride_xh,
    offs_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_HALF]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """The heads' halves ``(lo, hi)`` [BLOCK_H, BLOCK_HALF] in fp32, RMS-normed (HAS_NORM)
    then rotated, each step rounded to x's dtype where the references round."""
    dtype = x_ptr.dtype.element_ty
    x1, x2 = _load_halves(x_ptr, stride_xh, offs_h, offs_d, mask, HALF)
    if HAS_NORM:
        # 1. fp32 statistics over the whole head: x * rsqrt(mean(x^2) + eps), cast to dtype
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(variance + eps)[:, None]  # [BLOCK_H, 1]
        # 2. times the weight, rounded again (the weight has x's dtype)
        mask_d = offs_d < HALF
        w1 = tl.load(weight_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        x1 = _rounded(w1 * _rounded(x1 * rstd, dtype), dtype)
        x2 = _rounded(w2 * _rounded(x2 * rstd, dtype), dtype)
    # 3. rotated as rotary_ref does
    return _rotate_halves(x1, x2, cos_ptr, sin_ptr, offs_d, HALF, dtype)


@triton.jit
def _rotate_q_heads(
    q_ptr,  # this token's [Hq, D], last stride 1
    cos_ptr,
    sin_ptr,
    weight_ptr,
    eps,
    stride_qh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Norm (HAS_NORM) and rotate the token's query heads IN PLACE: each lane stores only what
    it loaded."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    lo, hi = _normed_rotated_halves(
        q_ptr, cos_ptr, sin_ptr, weight_ptr, eps, stride_qh, offs_h, offs_d, mask,
        HALF, HAS_NORM,
    )  # fmt: skip
    lo_ptrs = q_ptr + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(lo_ptrs, lo.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptrs + HALF, hi.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_rotated_heads(
    x_ptr,  # this token's [H, D], last stride 1
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
    weight_ptr,  # the norm's weight [D] (HAS_NORM only)
    eps,
    cache_ptr,  # the slot's [H, D] rows in the pool
    scale_ptr,  # the slot's [H] scales (fp8 only)
    stride_xh,
    stride_ch,
    stride_cd,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < NUM_HEADS
    mask = mask_h[:, None] & (offs_d < HALF)[None, :]
    # 1. both halves normed (HAS_NORM) and rotated, as norm and rotary would leave them in x
    lo, hi = _normed_rotated_halves(
        x_ptr, cos_ptr, sin_ptr, weight_ptr, eps, stride_xh, offs_h, offs_d, mask,
        HALF, HAS_NORM,
    )  # fmt: skip
    lo_ptrs = cache_ptr + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    hi_ptrs = lo_ptrs + HALF * stride_cd
    # 2. into the pool, quantized per head over the whole D (both halves) when it is fp8
    if IS_FP8:
        amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
        scale = _fp8_scale(amax)  # [BLOCK_H]
        _store_fp8(lo, lo_ptrs, mask, scale)
        _store_fp8(hi, hi_ptrs, mask, scale)
        tl.store(scale_ptr + offs_h * stride_sh, scale, mask=mask_h)
    else:
        tl.store(lo_ptrs, lo.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(hi_ptrs, hi.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    q_weight_ptr, k_weight_ptr,  # the head norms' weights [D] (HAS_NORM only)
    eps,
    stride_qt, stride_qh,  # q: [T, Hq, D], last stride 1
    stride_kt, stride_kh,  # k: [T, Hkv, D], last stride 1
    stride_vt, stride_vh, stride_vd,  # v: [T, Hkv, D]
    stride_cp,  # cos, sin: [max_pos, D]
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache and v_cache: [NB, BS, Hkv, D]
    stride_sb, stride_ss, stride_sh,  # k_scale and v_scale: [NB, BS, Hkv]
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    BLOCK_SIZE: tl.constexpr,  # rows per page
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,  # RMSNorm each q and k head before rotary (Qwen3)
    IS_FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    token = tl.program_id(0)
    cos_row, sin_row = _position_rows(positions_ptr, cos_ptr, sin_ptr, token, stride_cp)
    # 1. q normed and rotated in place, padding rows included: attention reads it from there
    _rotate_q_heads(
        q_ptr + token * stride_qt, cos_row, sin_row, q_weight_ptr, eps, stride_qh,
        NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, HAS_NORM,
    )  # fmt: skip
    # 2. the token's slot; a negative one is padding and stores nothing
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        cache_offset, scale_offset = _slot_offsets(
            slot, BLOCK_SIZE, stride_cb, stride_cs, stride_sb, stride_ss
        )
        # 3. K normed and rotated on its way into the pool, then V as it is
        _store_rotated_heads(
            k_ptr + token * stride_kt, cos_row, sin_row, k_weight_ptr, eps,
            k_cache_ptr + cache_offset, k_scale_ptr + scale_offset,
            stride_kh, stride_ch, stride_cd, stride_sh,
            NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, HAS_NORM, IS_FP8,
        )  # fmt: skip
        offs_h = tl.arange(0, BLOCK_HKV)
        offs_d = tl.arange(0, BLOCK_D)
        _store_token(
            v_ptr + token * stride_vt, v_cache_ptr + cache_offset, v_scale_ptr + scale_offset,
            offs_h, offs_d, offs_h < NUM_KV_HEADS, offs_d < 2 * HALF,
            stride_vh, stride_vd, stride_ch, stride_cd, stride_sh, IS_FP8,
        )  # fmt: skip


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    head_norms: HeadNorms | None = None,
) -> torch.Tensor:
    """Rotate q IN PLACE and store rotated k and v in the pool; returns q.

    Equal to ``rotary(q, k, ...)`` then ``write_kv(k, v, ...)``, except that k itself is left
    as it was. With ``head_norms`` (Qwen3's q and k norms; weights ``[D]`` of q's dtype), q
    and k are RMS-normed per head first, as ``rms_norm`` of each would (q in place too).

    Shapes: ``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` (same dtype, last stride 1,
    other strides free: views into a fused qkv output); ``v: [T, Hkv, D]`` (any strides);
    ``positions: [T]`` int; ``cos_cache, sin_cache: [max_pos, D]`` float32;
    ``k_cache, v_cache: [NB, BS, Hkv, D]`` of k's dtype or fp8, then with
    ``k_scale, v_scale: [NB, BS, Hkv]`` float32; ``slot_mapping: [T]`` int64, negative = store
    nothing for that token. No host sync: safe to capture in a CUDA graph.
    """
    check_rotary_args(q, k, positions, cos_cache, sin_cache)
    check_write_args(k, v, k_cache, v_cache, slot_mapping)
    scales = PoolScales.of(k_cache, k_scale, v_scale)
    if head_norms is not None:
        check_head_norms(q, head_norms)
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if num_tokens == 0:
        return q
    # without norms, q stands in for the weights: the kernel never reads them
    norms = head_norms or HeadNorms(q, q, 0.0)
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_cache, sin_cache,
        k_cache, v_cache, scales.k, scales.v, slot_mapping,
        norms.q_weight, norms.k_weight, norms.eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v.stride(), cos_cache.stride(0),
        *k_cache.stride(), *scales.strides,
        **rotary_shape(q, k),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_NORM=head_norms is not None,
        IS_FP8=scales.is_fp8,
        **pdl_launch(q),
    )  # fmt: skip
    return q


def check_head_norms(q: torch.Tensor, head_norms: HeadNorms) -> None:
    """Norm weights: contiguous [D] vectors of q's dtype on q's device, a positive eps."""
    head_dim = q.shape[2]
    for name, weight in (("q_weight", head_norms.q_weight), ("k_weight", head_norms.k_weight)):
        if weight.shape != (head_dim,) or not weight.is_contiguous():
            raise ValueError(
                f"head_norms.{name} must be a contiguous [D={head_dim}] vector, got "
                f"{tuple(weight.shape)} with strides {weight.stride()}"
            )
        if weight.dtype != q.dtype or weight.device != q.device:
            raise ValueError(
                f"head_norms.{name} must be {q.dtype} on {q.device} like q (cast the model's "
                f"norm weights with it), got {weight.dtype} on {weight.device}"
            )
    if not head_norms.eps > 0:
        raise ValueError(f"head_norms.eps must be positive, got {head_norms.eps}")
