# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""KV write into the page pool: the Triton kernel, matching ``write_kv_ref``.

One program stores one new token: all its KV heads, K and V. A negative slot skips the token
(padded rows of a CUDA graph). With an fp8 pool the program quantizes each (token, kv head)
vector with its own float32 scale, exactly as ``paged_attention.quantize_fp8`` does.
The engine launches the fused ``rotary_kv_write_triton``, built from this file's helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.paged_attention import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
E4M3_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexpr
E4M3_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _round_to_e4m3_grid(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, still in fp32.

    The cast that follows is then exact on every backend; Triton's interpreter rounds fp8
    casts half-up without carrying into the exponent, which this sidesteps.
    """
    # -- the e4m3 spacing at x: 2^(e - 3) for normals, 2^-9 for subnormals (e < -6)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3
    # -- (x + c) - c rounds x to a multiple of the spacing: c = 1.5 * 2^23 * spacing
    c = ((ulp_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    return (x + c) - c


@triton.jit
def _fp8_scale(amax):
    """Per-head scales from per-head amax [BLOCK_H]: amax / 448, kept off zero."""
    return tl.maximum(amax / E4M3_MAX, E4M3_MIN_SCALE)


@triton.jit
def _store_fp8(x32, cache_ptrs, mask, scale):
    """fp32 rows [BLOCK_H, BLOCK_D] divided by their head's scale [BLOCK_H], stored as e4m3."""
    stored = _round_to_e4m3_grid(x32 / scale[:, None])
    tl.store(cache_ptrs, stored.to(cache_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _slot_offsets(slot, BLOCK_SIZE: tl.constexpr, stride_cb, stride_cs, stride_sb, stride_ss):
    """Slot ``page * BLOCK_SIZE + row``'s offsets: of its rows in the pool, of its scales."""
    page = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    return page * stride_cb + row * stride_cs, page * stride_sb + row * stride_ss


@triton.jit
def _store_token(
    x_ptr,  # this token's [Hkv, D], at its strides
    cache_ptr,  # the slot's [Hkv, D] rows in the pool
    scale_ptr,  # the slot's [Hkv] scales (fp8 only)
    offs_h,
    offs_d,
    mask_h,
    mask_d,
    stride_xh,
    stride_xd,
    stride_ch,
    stride_cd,
    stride_sh,
    IS_FP8: tl.constexpr,
):
    mask = mask_h[:, None] & mask_d[None, :]
    x = tl.load(
        x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd, mask=mask, other=0.0
    )
    cache_ptrs = cache_ptr + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    if IS_FP8:
        # -- one scale per kv head: amax over D / 448, kept off zero
        x32 = x.to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(x32), axis=1))  # [BLOCK_H]
        _store_fp8(x32, cache_ptrs, mask, scale)
        tl.store(scale_ptr + offs_h * stride_sh, scale, mask=mask_h)
    else:
        tl.store(cache_ptrs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kt,  # k: [T, Hkv, D]
    stride_kh,
    stride_kd,
    stride_vt,  # v: [T, Hkv, D] (its own strides: k may be normed per head, v a view)
    stride_vh,
    stride_vd,
    stride_cb,  # k_cache and v_cache: [NB, BS, Hkv, D]
    stride_cs,
    stride_ch,
    stride_cd,
    stride_sb,  # k_scale and v_scale: [NB, BS, Hkv]
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # rows per page
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    # 1. the token's slot; a negative one is padding and writes nothing
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        cache_offset, scale_offset = _slot_offsets(
            slot, BLOCK_SIZE, stride_cb, stride_cs, stride_sb, stride_ss
        )
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < NUM_KV_HEADS
        mask_d = offs_d < HEAD_DIM
        # 2. K then V: [Hkv, D] each, quantized per head when the pool is fp8
        _store_token(
            k_ptr + token * stride_kt, k_cache_ptr + cache_offset, k_scale_ptr + scale_offset,
            offs_h, offs_d, mask_h, mask_d,
            stride_kh, stride_kd, stride_ch, stride_cd, stride_sh, IS_FP8,
        )  # fmt: skip
        _store_token(
            v_ptr + token * stride_vt, v_cache_ptr + cache_offset, v_scale_ptr + scale_offset,
            offs_h, offs_d, mask_h, mask_d,
            stride_vh, stride_vd, stride_ch, stride_cd, stride_sh, IS_FP8,
        )  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store new K and V rows in the pool; matches ``paged_attention.write_kv_ref``.

    Shapes: ``k, v: [T, Hkv, D]`` (any strides, each its own); ``k_cache, v_cache: [NB, BS,
    Hkv, D]`` (any strides, e.g. a layer's slice of a bigger pool, same for both);
    ``slot_mapping: [T]`` int64, ``page * BS + row``, negative = skip. With an fp8 pool
    (``torch.float8_e4m3fn``) ``k_scale, v_scale: [NB, BS, Hkv]`` float32 receive the scales.
    No host sync: safe to capture in a CUDA graph.
    """
    check_write_args(k, v, k_cache, v_cache, slot_mapping)
    scales = PoolScales.of(k_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, scales.k, scales.v, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *scales.strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=scales.is_fp8,
    )  # fmt: skip


@dataclass(frozen=True)
class PoolScales:
    """What a kernel that writes the pool gets for the scales: the real ones with an fp8
    pool, else placeholders it never touches (and zero strides)."""

    is_fp8: bool
    k: torch.Tensor  # [NB, BS, Hkv] float32, or a placeholder
    v: torch.Tensor
    strides: tuple[int, ...]  # k's and v's (equal) strides

    @classmethod
    def of(
        cls, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
    ) -> PoolScales:
        if k_cache.dtype != FP8_DTYPE:
            return cls(False, k_cache, k_cache, (0, 0, 0))
        check_scales(k_cache, k_scale, v_scale)
        assert k_scale is not None and v_scale is not None
        return cls(True, k_scale, v_scale, k_scale.stride())


def check_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] of a float dtype, a pool of their dtype or fp8, int64 slots [T]."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must be [T, Hkv, D] of equal shapes, got {tuple(k.shape)} / {tuple(v.shape)}"
        )
    check_pool(k_cache, v_cache)
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"the pool's [Hkv, D] {tuple(k_cache.shape[2:])} differs from k's {tuple(k.shape[1:])}"
        )
    if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a dtype among {SUPPORTED_DTYPES}, got {k.dtype}")
    if k_cache.dtype not in (k.dtype, FP8_DTYPE) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the pool's dtype must be k's ({k.dtype}) or fp8, got {k_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be [T={k.shape[0]}] int64, got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The page pool's two halves: [NB, BS, Hkv, D] each, equal shapes and strides."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must be [NB, BS, Hkv, D] with equal shapes and strides, got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )


def check_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """fp8 pools carry float32 scales [NB, BS, Hkv], one per (token, kv head)."""
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs k_scale and v_scale tensors [NB, BS, Hkv]")
    for scale in (k_scale, v_scale):
        if scale.shape != cache.shape[:3] or scale.dtype != torch.float32:
            raise ValueError(
                f"k_scale and v_scale must be {tuple(cache.shape[:3])} float32, got "
                f"{tuple(scale.shape)} {scale.dtype}"
            )
        if scale.device != cache.device:
            raise ValueError(f"scales on {scale.device}, the pool on {cache.device}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError(
            f"k_scale and v_scale strides differ: {k_scale.stride()} / {v_scale.stride()}"
        )
