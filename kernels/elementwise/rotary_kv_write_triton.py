# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Rotary embedding fused with the KV write: one launch per layer in place of two.

One program takes one new token: it rotates all its query heads IN PLACE (attention reads q
from there), rotates its key heads and stores them straight into the token's slot of the
page pool, and stores its value heads beside them. The rotated keys never go back to ``k``:
both attention kernels read K/V from the pages only. A negative slot (padding rows of a CUDA
graph) still rotates q but stores nothing.

The math is ``rotary_triton``'s and ``kv_write_triton``'s, through their helpers: the pool
receives bit for bit what ``rotary`` followed by ``write_kv`` stores (fp8 scales included),
and the reference is ``rotary_ref`` then ``write_kv_ref`` (``rotary_write_kv_ref``).
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
from kernels.elementwise.rotary_triton import (
    _position_rows,
    _rotate_heads,
    _rotated_halves,
    check_rotary_args,
    rotary_shape,
)
from kernels.pdl import pdl_launch, wait_for_producers


@triton.jit
def _store_rotated_heads(
    x_ptr,  # this token's [H, D], last stride 1
    cos_ptr,  # this position's cos/sin rows [D]
    sin_ptr,
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
    IS_FP8: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < NUM_HEADS
    mask = mask_h[:, None] & (offs_d < HALF)[None, :]
    # 1. both halves rotated, as rotary would leave them in x
    lo, hi = _rotated_halves(x_ptr, cos_ptr, sin_ptr, stride_xh, offs_h, offs_d, mask, HALF)
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
    IS_FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    token = tl.program_id(0)
    cos_row, sin_row = _position_rows(positions_ptr, cos_ptr, sin_ptr, token, stride_cp)
    # 1. q in place, padding rows included: attention reads it from there
    _rotate_heads(
        q_ptr + token * stride_qt, cos_row, sin_row, stride_qh,
        NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    # 2. the token's slot; a negative one is padding and stores nothing
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        cache_offset, scale_offset = _slot_offsets(
            slot, BLOCK_SIZE, stride_cb, stride_cs, stride_sb, stride_ss
        )
        # 3. K rotated on its way into the pool, then V as it is
        _store_rotated_heads(
            k_ptr + token * stride_kt, cos_row, sin_row,
            k_cache_ptr + cache_offset, k_scale_ptr + scale_offset,
            stride_kh, stride_ch, stride_cd, stride_sh,
            NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, IS_FP8,
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
) -> torch.Tensor:
    """Rotate q IN PLACE and store rotated k and v in the pool; returns q.

    Equal to ``rotary(q, k, ...)`` then ``write_kv(k, v, ...)``, except that k itself is left
    as it was. Shapes: ``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` (same dtype, last stride 1,
    other strides free: views into a fused qkv output); ``v: [T, Hkv, D]`` (any strides);
    ``positions: [T]`` int; ``cos_cache, sin_cache: [max_pos, D]`` float32;
    ``k_cache, v_cache: [NB, BS, Hkv, D]`` of k's dtype or fp8, then with
    ``k_scale, v_scale: [NB, BS, Hkv]`` float32; ``slot_mapping: [T]`` int64, negative = store
    nothing for that token. No host sync: safe to capture in a CUDA graph.
    """
    check_rotary_args(q, k, positions, cos_cache, sin_cache)
    check_write_args(k, v, k_cache, v_cache, slot_mapping)
    scales = PoolScales.of(k_cache, k_scale, v_scale)
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if num_tokens == 0:
        return q
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_cache, sin_cache,
        k_cache, v_cache, scales.k, scales.v, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v.stride(), cos_cache.stride(0),
        *k_cache.stride(), *scales.strides,
        **rotary_shape(q, k),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=scales.is_fp8,
        **pdl_launch(q),
    )  # fmt: skip
    return q
