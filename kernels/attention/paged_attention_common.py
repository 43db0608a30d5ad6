# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Pieces shared by the decode, cascade and prefill paged-attention kernels: page gathers,
the online softmax over a run of key tiles, checks."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.attention.kv_write_triton import check_pool, check_scales
from kernels.attention.paged_attention import FP8_DTYPE

LOG2_E = 1.4426950408889634  # the kernels use exp2: scores are scaled by log2(e)
E4M3_MAX = tl.constexpr(448.0)  # v scales are folded into p as v_scale * 448 (= the amax)
NOMINAL_CPU_SMS = 4  # the interpreter has no SMs; any small count exercises the split path
NEG_BIG = tl.constexpr(-1.0e30)  # a finite "minus infinity": no (-inf) - (-inf)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def page_rows(table_ptr, offs_n, mask_n, BLOCK_SIZE: tl.constexpr):
    """Token positions [BLOCK_N] -> (page [BLOCK_N] int64, row in page [BLOCK_N])."""
    pages = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    return pages, offs_n % BLOCK_SIZE


@triton.jit
def load_kv_tile(
    cache_ptr, pages, rows, offs_d, mask_n, kv_head,
    stride_cb, stride_cs, stride_ch, stride_cd,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One kv head's rows of the gathered tokens: [BLOCK_N, BLOCK_D], zero where masked."""
    ptrs = (
        cache_ptr
        + pages[:, None] * stride_cb
        + rows[:, None] * stride_cs
        + kv_head * stride_ch
        + offs_d[None, :] * stride_cd
    )
    return tl.load(ptrs, mask=mask_n[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def load_kv_scale(
    scale_ptr, pages, rows, mask_n, kv_head, stride_sb, stride_ss, stride_sh
):  # fmt: skip
    """The fp8 scales [BLOCK_N] of one kv head's gathered tokens."""
    ptrs = scale_ptr + pages * stride_sb + rows * stride_ss + kv_head * stride_sh
    return tl.load(ptrs, mask=mask_n, other=0.0)


@triton.jit
def attend_tile(
    q, acc, m_i, l_i, offs_n, mask_n, visible,
    table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head, qk_scale,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax, for the decode and the prefill kernel alike.

    ``q``: [M, BLOCK_D] dot rows; ``offs_n``: the tile's [BLOCK_N] positions, ``mask_n``
    which of them exist; ``visible``: [M or 1, BLOCK_N] which scores count (causality,
    windows). Returns the updated (acc [M, BLOCK_D], m_i [M], l_i [M]), base 2, with fp8 v
    scales folded into p (the caller divides acc by E4M3_MAX at the end).
    """
    # -- gather K, V: [BLOCK_N, BLOCK_D] across pages
    pages, rows = page_rows(table_ptr, offs_n, mask_n, BLOCK_SIZE)
    k = load_kv_tile(
        k_cache_ptr, pages, rows, offs_d, mask_n, kv_head,
        stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM,
    )  # fmt: skip
    v = load_kv_tile(
        v_cache_ptr, pages, rows, offs_d, mask_n, kv_head,
        stride_cb, stride_cs, stride_ch, stride_cd, HEAD_DIM,
    )  # fmt: skip
    # -- scores [M, BLOCK_N] in base 2; fp8 scales are per key, so per column
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if IS_FP8:
        k_scale = load_kv_scale(
            k_scale_ptr, pages, rows, mask_n, kv_head, stride_sb, stride_ss, stride_sh
        )
        s = s * k_scale[None, :]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    # -- update m_i and l_i (fp32)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # -- update the output accumulator
    if IS_FP8:
        v_scale = load_kv_scale(
            v_scale_ptr, pages, rows, mask_n, kv_head, stride_sb, stride_ss, stride_sh
        )
        p = p * (v_scale * E4M3_MAX)[None, :]  # O(1): no fp16 underflow
    pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv, m_new, l_i


def dot_dtype(q: torch.Tensor, cache: torch.Tensor) -> tl.dtype:
    """The dot operands' dtype: q's, with two exceptions.

    - CPU tensors (the interpreter): fp32, since the interpreter's bf16 ``tl.dot`` multiplies
      raw bits (Triton 3.9).
    - fp8 pools with a 16-bit q: fp16, which e4m3 converts to in one instruction per pair (bf16 takes a long
      software sequence on Hopper, and made the fp8 decode slower than bf16). q is cast to
      fp16 too: |q| must stay under 65504.
    """
    if q.device.type == "cpu":
        return tl.float32
    if cache.dtype == FP8_DTYPE and q.dtype != torch.float32:
        return tl.float16
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(q.dtype, tl.float32)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision in tl.dot (tf32 would miss the reference by ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the first argument of ``paged_attention`` that is wrong."""
    _check_q_and_pool(q, k_cache, v_cache)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, tensor, shape in (
        ("seq_lens", seq_lens, (num_seqs,)),
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
    ):
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int32:
            raise ValueError(
                f"{name} must be {shape} int32 (B = len(seq_lens)), got "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if k_cache.dtype == FP8_DTYPE:
        check_scales(k_cache, k_scale, v_scale)


def _check_q_and_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q must be [T, Hq, D] in {SUPPORTED_DTYPES}, got {tuple(q.shape)} {q.dtype}"
        )
    check_pool(k_cache, v_cache)
    if k_cache.dtype not in (q.dtype, FP8_DTYPE) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the pool's dtype must be q's ({q.dtype}) or fp8, got {k_cache.dtype}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q [T, Hq, D] = {tuple(q.shape)} does not fit a pool of Hkv={num_kv_heads}, "
            f"D={head_dim}: D must match and Hq must be a multiple of Hkv"
        )


def check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be like q {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )


def pow2_at_least(n: int, minimum: int) -> int:
    return max(triton.next_power_of_2(n), minimum)


@triton.jit
def attend_keys(
    q, tile_begin, tile_end, lo, hi, row_hi,
    table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head, qk_scale,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROW_LIMITS: tl.constexpr,
):  # fmt: skip
    """The query rows ``q`` [ROWS, BLOCK_D] over keys ``lo <= pos < hi`` of tiles
    ``tile_begin..tile_end`` (pages from ``table_ptr``), and with ``ROW_LIMITS`` each row
    only below its own ``row_hi`` [ROWS]: the normalized output [ROWS, BLOCK_D] and its base-2
    log-sum-exp [ROWS] (NEG_BIG where no key was seen)."""
    m_i = tl.full([ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_begin, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < hi) & (offs_n >= lo)
        visible = mask_n[None, :]
        if ROW_LIMITS:
            visible = visible & (offs_n[None, :] < row_hi[:, None])
        # gather the tile's K, V and fold it into the online softmax
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, offs_n, mask_n, visible,
            table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss,
            stride_sh, HEAD_DIM, BLOCK_SIZE, IS_FP8, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if IS_FP8:
        acc = acc / E4M3_MAX  # undo the fold of v scales into p
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), NEG_BIG)
    return acc / l_safe[:, None], lse


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """The device's SMs: how many programs a launch needs to fill it."""
    if device.type != "cuda":
        return NOMINAL_CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
