# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""The prefill / mixed phase of ``paged_attention`` (see paged_attention_triton.py).

Flash attention over the page pool for sequences with any number of new tokens. The new tokens
are a sequence's last ``query_len`` positions: causal among themselves, full over the cached
context, inside the sliding window if one is set. GQA packing: a program owns one kv head and
``TOKENS_PER_BLOCK`` new tokens; its ``BLOCK_M`` dot rows are (token, query head of the group)
pairs, row ``r`` = token ``r // GROUP``, head ``r % GROUP``, so K/V tiles serve the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.paged_attention_common import (
    E4M3_MAX,
    LOG2_E,
    NEG_BIG,
    attend_tile,
    dot_dtype,
    dot_precision,
    pow2_at_least,
)

PREFILL_BLOCK_M = 64  # dot rows: tokens x heads of the group
PREFILL_BLOCK_N = 64  # keys per tile
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2


# Ints that change from step to step are not specialized (see _decode_kernel).
@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # keys with pos > q_pos - window are kept (if HAS_WINDOW)
    first_seq,  # sequences before it are decodes, handled elsewhere
    stride_qt, stride_qh, stride_qd,  # q, out: [T, Hq, D]
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache, v_cache: [NB, BS, Hkv, D]
    stride_sb, stride_ss, stride_sh,  # k_scale, v_scale: [NB, BS, Hkv]
    stride_bt,  # block_tables: [B, max_blocks]
    GROUP: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,  # BLOCK_M // GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    HAS_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dot operand dtype
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = first_seq + tl.program_id(1)
    kv_head = tl.program_id(2)
    # 1. where this block's new tokens sit: positions context_len + token
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    token0 = tl.program_id(0) * TOKENS_PER_BLOCK
    if token0 < query_len:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        tokens = token0 + offs_m // GROUP
        heads = kv_head * GROUP + offs_m % GROUP
        mask_m = (offs_m < TOKENS_PER_BLOCK * GROUP) & (tokens < query_len)
        mask_md = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
        q_pos = context_len + tokens
        # 2. queries [BLOCK_M, BLOCK_D]
        q_rows = (q_start + tokens) * stride_qt + heads * stride_qh
        q_ptrs = q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=mask_md, other=0.0).to(DOT_DTYPE)
        # 3. keys this block can see: [lo, hi)
        hi = tl.minimum(seq_len, context_len + token0 + TOKENS_PER_BLOCK)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(context_len + token0 - window + 1, 0)
        acc, l_i = _attend_tiles(
            q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr + seq * stride_bt, offs_d, kv_head, lo, hi, qk_scale, window,
            stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
            HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE, HAS_WINDOW, IS_FP8, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        # 5. normalize and store
        if IS_FP8:
            acc = acc / E4M3_MAX  # undo the fold of v scales into p
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = (q_start + tokens) * stride_ot + heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


@triton.jit
def _attend_tiles(
    q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    table_ptr, offs_d, kv_head, lo, hi, qk_scale, window,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """4. online softmax over key tiles [lo, hi): returns (unnormalized acc, row sums)."""
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        # -- causal (and windowed) per row
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, offs_n, mask_n, visible,
            table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss,
            stride_sh, HEAD_DIM, BLOCK_SIZE, IS_FP8, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    return acc, l_i


def launch_prefill(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [NB, BS, Hkv] float32 with an fp8 pool
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out: torch.Tensor,  # [T, Hq, D]
    *,
    scale: float,
    first_seq: int,
    max_query_len: int,
    sliding_window: int | None,
) -> None:
    """Attention of sequences ``first_seq:B`` (arguments already checked by the launcher)."""
    num_seqs = seq_lens.shape[0] - first_seq
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = pow2_at_least(group, PREFILL_BLOCK_M)
    tokens_per_block = block_m // group
    is_fp8 = k_scale is not None
    scales = k_scale if k_scale is not None else k_cache  # placeholder pointer when not fp8
    grid = (triton.cdiv(max_query_len, tokens_per_block), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, scales, v_scale if v_scale is not None else k_cache,
        block_tables, seq_lens, query_start_loc, out,
        scale * LOG2_E, sliding_window or 0, first_seq,
        *q.stride(), *out.stride(), *k_cache.stride(),
        *(scales.stride() if is_fp8 else (0, 0, 0)), block_tables.stride(0),
        GROUP=group,
        TOKENS_PER_BLOCK=tokens_per_block,
        HEAD_DIM=head_dim,
        BLOCK_D=pow2_at_least(head_dim, 16),
        BLOCK_M=block_m,
        BLOCK_N=PREFILL_BLOCK_N,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_WINDOW=sliding_window is not None,
        IS_FP8=is_fp8,
        DOT_DTYPE=dot_dtype(q, k_cache),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=PREFILL_NUM_WARPS,
        num_stages=PREFILL_NUM_STAGES,
    )  # fmt: skip
