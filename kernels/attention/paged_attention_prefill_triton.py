# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""The prefill / mixed phase of ``paged_attention`` (see paged_attention_triton.py).

Flash attention over the page pool for sequences with any number of new tokens. The new tokens
are a sequence's last ``query_len`` positions: causal among themselves, full over the cached
context, inside the sliding window if one is set. GQA packing: a program owns one kv head and
``TOKENS_PER_BLOCK`` new tokens; its ``BLOCK_M`` dot rows are (token, query head of the group)
pairs, row ``r`` = token ``r // GROUP``, head ``r % GROUP``, so K/V tiles serve the whole group.

A program's keys fall in three runs of ``BLOCK_N``-key tiles: the window's edge (only with a
sliding window), where some rows see a key and others do not; the bulk, which every row of the
block sees, so it runs with no mask at all; and the diagonal, the tiles at and after the
block's first query position. Tile shapes, warps and stages come from ``prefill_tuning``.

Two Hopper options of the config: with ``tma`` a tile is one page and the tensor memory
accelerator fetches its K and V rows (a descriptor over the pool seen as
``[NB * BS, Hkv * D]``), instead of the threads gathering them; with ``warp_specialize``
Triton splits the loop over the bulk tiles into warps that load and warps that compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; older releases run without the TMA option
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from kernels.attention.paged_attention_common import (
    E4M3_MAX,
    LOG2_E,
    NEG_BIG,
    dot_dtype,
    dot_precision,
    pow2_at_least,
)
from kernels.attention.prefill_tuning import PrefillConfig, config_for


# Ints that change from step to step are not specialized (see _decode_kernel).
@triton.jit(do_not_specialize=["first_seq", "num_seqs", "num_token_blocks", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e), > 0
    window,  # keys with pos > q_pos - window are kept (if HAS_WINDOW)
    first_seq,  # sequences before it are decodes, handled elsewhere
    num_seqs,  # the prefill sequences: first_seq .. first_seq + num_seqs - 1
    num_token_blocks,  # cdiv(max_query_len, TOKENS_PER_BLOCK)
    stride_qt, stride_qh, stride_qd,  # q, out: [T, Hq, D]
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache, v_cache: [NB, BS, Hkv, D]
    stride_sb, stride_ss, stride_sh,  # k_scale, v_scale: [NB, BS, Hkv]
    stride_bt,  # block_tables: [B, max_blocks]
    GROUP: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,  # BLOCK_M // GROUP
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    HAS_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dot operand dtype
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,  # K/V tiles from k_desc/v_desc (BLOCK_N == BLOCK_SIZE)
    WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    # 0. program -> (kv head, sequence, token block): kv heads vary fastest, then sequences;
    # token blocks last and in reverse, so the blocks with the most keys start first and the
    # short ones fill the tail of the launch
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    seq = first_seq + (pid // NUM_KV_HEADS) % num_seqs
    token_block = num_token_blocks - 1 - pid // (NUM_KV_HEADS * num_seqs)
    # 1. where this block's new tokens sit: positions context_len + token
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    token0 = token_block * TOKENS_PER_BLOCK
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
        # 3.-4. online softmax over the three runs of key tiles
        acc, l_i = _attend_runs(
            q, q_pos, context_len + token0, seq_len, window,
            k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
            k_desc, v_desc, kv_head * HEAD_DIM,
            k_scale_ptr + kv_head * stride_sh, v_scale_ptr + kv_head * stride_sh,
            block_tables_ptr + seq * stride_bt, offs_d, qk_scale,
            stride_cb, stride_cs, stride_cd, stride_sb, stride_ss,
            TOKENS_PER_BLOCK, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE, HAS_WINDOW,
            IS_FP8, DOT_DTYPE, DOT_PRECISION, USE_TMA, WARP_SPECIALIZE,
        )  # fmt: skip
        # 5. normalize and store
        if IS_FP8:
            acc = acc / E4M3_MAX  # undo the fold of v scales into p
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = (q_start + tokens) * stride_ot + heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


@triton.jit
def _attend_runs(
    q, q_pos, first_pos, seq_len, window,
    k_base, v_base, k_desc, v_desc, desc_col, k_scale_base, v_scale_base, table_ptr, offs_d,
    qk_scale, stride_cb, stride_cs, stride_cd, stride_sb, stride_ss,
    TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """The block's key tiles: returns (unnormalized acc [BLOCK_M, BLOCK_D], row sums [BLOCK_M]).

    ``first_pos``: the block's first query position; its rows see keys ``< hi``. Keys below
    ``first_pos + 1`` are causally visible to every row, so the tiles before ``diag`` need no
    causal mask; with a window, tiles from ``full_lo`` on are inside every row's window too.
    """
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(seq_len, first_pos + TOKENS_PER_BLOCK)
    diag = (first_pos + 1) // BLOCK_N * BLOCK_N
    full_lo = 0
    if HAS_WINDOW:
        # -- the window's edge: the first row's first key up to where the last row's begins
        edge_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        last_lo = tl.maximum(first_pos + TOKENS_PER_BLOCK - window, 0)
        full_lo = tl.minimum(tl.cdiv(last_lo, BLOCK_N) * BLOCK_N, diag)
        for start_n in range(edge_lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, q_pos, start_n, hi, window,
                k_base, v_base, k_desc, v_desc, desc_col, k_scale_base, v_scale_base,
                table_ptr, offs_d, qk_scale, stride_cb, stride_cs, stride_cd, stride_sb,
                stride_ss, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW,
                IS_FP8, DOT_DTYPE, DOT_PRECISION, USE_TMA,
            )  # fmt: skip
    # -- the bulk: whole tiles every row sees, no masks
    for start_n in tl.range(full_lo, diag, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, start_n, hi, window,
            k_base, v_base, k_desc, v_desc, desc_col, k_scale_base, v_scale_base,
            table_ptr, offs_d, qk_scale, stride_cb, stride_cs, stride_cd, stride_sb,
            stride_ss, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, False, HAS_WINDOW,
            IS_FP8, DOT_DTYPE, DOT_PRECISION, USE_TMA,
        )  # fmt: skip
    # -- the diagonal: causal per row, and the sequence's end
    for start_n in range(diag, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, start_n, hi, window,
            k_base, v_base, k_desc, v_desc, desc_col, k_scale_base, v_scale_base,
            table_ptr, offs_d, qk_scale, stride_cb, stride_cs, stride_cd, stride_sb,
            stride_ss, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW,
            IS_FP8, DOT_DTYPE, DOT_PRECISION, USE_TMA,
        )  # fmt: skip
    return acc, l_i


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, q_pos, start_n, hi, window,
    k_base, v_base, k_desc, v_desc, desc_col, k_scale_base, v_scale_base, table_ptr, offs_d,
    qk_scale, stride_cb, stride_cs, stride_cd, stride_sb, stride_ss,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """One tile of keys ``start_n .. start_n + BLOCK_N`` folded into the online softmax (base
    2, fp8 v scales folded into p). ``MASKED``: keys may lie past ``hi`` or outside a row's
    causal window; unmasked tiles exist whole and every row sees every key."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    # -- gather K, V [BLOCK_N, BLOCK_D]
    if USE_TMA:
        # the tile is one page (BLOCK_N == BLOCK_SIZE): its rows, whole, then finite zeros
        # past the sequence's end (the page's unwritten rows may hold anything, NaN too)
        page = tl.load(table_ptr + start_n // BLOCK_SIZE)
        k = k_desc.load([page * BLOCK_SIZE, desc_col])
        v = v_desc.load([page * BLOCK_SIZE, desc_col])
        if MASKED:
            v = tl.where(mask_n[:, None], v, tl.zeros_like(v))
        pages = tl.zeros([BLOCK_N], dtype=tl.int64) + page.to(tl.int64)  # for fp8 scales
        rows = offs_n % BLOCK_SIZE
    else:
        pages, rows = _tile_pages(
            table_ptr, start_n, hi, offs_n, mask_n, BLOCK_N, BLOCK_SIZE, MASKED
        )
        kv_offs = pages * stride_cb + rows * stride_cs
        k = _load_rows(k_base, kv_offs, offs_d, mask_n, stride_cd, HEAD_DIM, BLOCK_D, MASKED)
        v = _load_rows(v_base, kv_offs, offs_d, mask_n, stride_cd, HEAD_DIM, BLOCK_D, MASKED)
    # -- scores [BLOCK_M, BLOCK_N], unscaled; fp8 scales are per key, so per column
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if IS_FP8:
        scale_offs = pages * stride_sb + rows * stride_ss
        s = s * tl.load(k_scale_base + scale_offs, mask=mask_n, other=0.0)[None, :]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # -- update m_i and l_i (fp32, base 2): the scale is folded into one multiply-add
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # -- update the output accumulator, in place in the dot
    if IS_FP8:
        v_scale = tl.load(v_scale_base + scale_offs, mask=mask_n, other=0.0)
        p = p * (v_scale * E4M3_MAX)[None, :]  # O(1): no fp16 underflow
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tile_pages(
    table_ptr, start_n, hi, offs_n, mask_n,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Key positions [BLOCK_N] -> (page [BLOCK_N] int64, row in page [BLOCK_N]), loading
    the block table once per page where the tile and the page size allow it."""
    rows = offs_n % BLOCK_SIZE
    if BLOCK_SIZE % BLOCK_N == 0:
        # the tile lies in one page (tiles start at multiples of BLOCK_N, and start_n < hi)
        page = tl.load(table_ptr + start_n // BLOCK_SIZE).to(tl.int64)
        pages = tl.zeros([BLOCK_N], dtype=tl.int64) + page
    elif BLOCK_N % BLOCK_SIZE == 0:
        # whole pages: one table entry each, broadcast over the page's rows
        page_idx = start_n // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        if MASKED:
            page_ids = tl.load(table_ptr + page_idx, mask=page_idx * BLOCK_SIZE < hi, other=0)
        else:
            page_ids = tl.load(table_ptr + page_idx)
        per_row = tl.broadcast_to(
            page_ids.to(tl.int64)[:, None], (BLOCK_N // BLOCK_SIZE, BLOCK_SIZE)
        )
        pages = tl.reshape(per_row, (BLOCK_N,))
    else:
        # any other page size: one table entry per key
        if MASKED:
            pages = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        else:
            pages = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    return pages, rows


@triton.jit
def _load_rows(
    base, row_offs, offs_d, mask_n, stride_cd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One kv head's rows [BLOCK_N, BLOCK_D] of the gathered keys; zero where masked (a
    masked-out V row must be finite: p = 0 times NaN is NaN)."""
    ptrs = base + row_offs[:, None] + offs_d[None, :] * stride_cd
    if MASKED:
        return tl.load(ptrs, mask=mask_n[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


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
    end_seq: int,
    max_query_len: int,
    sliding_window: int | None,
    config: PrefillConfig | None = None,
) -> None:
    """Attention of sequences ``first_seq:end_seq`` (arguments already checked by the
    launcher).

    ``config``: the tile and launch shape; by default ``prefill_tuning.config_for``'s.
    """
    config = config or config_for(q, k_cache)
    num_seqs = end_seq - first_seq
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = pow2_at_least(group, config.block_m)
    tokens_per_block = block_m // group
    num_token_blocks = triton.cdiv(max_query_len, tokens_per_block)
    is_fp8 = k_scale is not None
    scales = k_scale if k_scale is not None else k_cache  # placeholder pointer when not fp8
    k_desc, v_desc = _page_descriptors(k_cache, v_cache, config) if config.tma else (None, None)
    grid = (num_token_blocks * num_seqs * num_kv_heads,)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, scales, v_scale if v_scale is not None else k_cache,
        block_tables, seq_lens, query_start_loc, out,
        scale * LOG2_E, sliding_window or 0, first_seq, num_seqs, num_token_blocks,
        *q.stride(), *out.stride(), *k_cache.stride(),
        *(scales.stride() if is_fp8 else (0, 0, 0)), block_tables.stride(0),
        GROUP=group,
        TOKENS_PER_BLOCK=tokens_per_block,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=pow2_at_least(head_dim, 16),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_WINDOW=sliding_window is not None,
        IS_FP8=is_fp8,
        DOT_DTYPE=dot_dtype(q, k_cache),
        DOT_PRECISION=dot_precision(q.dtype),
        USE_TMA=config.tma,
        WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def _page_descriptors(
    k_cache: torch.Tensor, v_cache: torch.Tensor, config: PrefillConfig
) -> tuple[object, object]:
    """TMA descriptors over the K and V pools seen as ``[NB * BS, Hkv * D]`` rows, a box of
    one page of one kv head. Raises ValueError where a ``tma`` config cannot run."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if TensorDescriptor is None:
        raise ValueError("tma configs need Triton >= 3.4 (triton.tools.tensor_descriptor)")
    if config.block_n != block_size:
        raise ValueError(f"a tma config's block_n must be the page size, {block_size}")
    if head_dim != pow2_at_least(head_dim, 16):
        raise ValueError(f"a tma config needs a power-of-two head dim, got {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("a tma config needs contiguous K/V pools")
    rows, width = num_blocks * block_size, num_kv_heads * head_dim
    k_desc, v_desc = (
        TensorDescriptor(cache.view(rows, width), [rows, width], [width, 1], [block_size, head_dim])
        for cache in (k_cache, v_cache)
    )
    return k_desc, v_desc
