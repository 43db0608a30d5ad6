# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Paged attention in Triton, matching ``paged_attention.paged_attention_ref``.

A batch is split in two phases, each one launch (two for split decode):
- decode (the first ``num_decodes`` sequences, one new token each): flash-decoding. A program
  owns one (sequence, kv head, split): the query heads of that kv head are packed as the rows
  of one ``tl.dot`` (padded to 16), so each K/V tile is loaded once for the whole group. Tiles
  of ``BLOCK_N`` tokens are gathered across pages. Split ``s`` of ``num_splits`` covers a
  contiguous run of tiles computed in the kernel from the device ``seq_len``; partial outputs
  and log-sum-exps go to a scratch buffer that ``_reduce_splits_kernel`` folds.
- cascade decode (``prefix_*``): decodes that read the same leading pages (a shared system
  prompt; up to a few such groups) attend them together in ``cascade_triton.py``'s prefix
  kernel, the decode kernel then attends each sequence's keys after its share, and the
  reduction folds both kinds of partials (the prefix's as extra splits).
- prefill (the other sequences, any query length): flash attention, GQA packed as well, in
  ``paged_attention_prefill_triton.py``.
The grids depend only on tensor shapes and host ints: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from kernels.attention.cascade_triton import (
    check_cascade,
    launch_prefix,
    prefix_num_splits,
)
from kernels.attention.paged_attention import FP8_DTYPE
from kernels.attention.paged_attention_common import (
    LOG2_E,
    NEG_BIG,
    attend_keys,
    check_attention_args,
    check_out,
    dot_dtype,
    dot_precision,
    num_sms,
    pow2_at_least,
)
from kernels.attention.paged_attention_prefill_triton import launch_prefill
from kernels.attention.prefill_tuning import PrefillConfig
from kernels.pdl import pdl_launch, wait_for_producers

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: the head group is padded to this
MAX_KV_SPLITS = 64
TARGET_PROGRAMS_PER_SM = 2  # default split count: enough programs to hide gather latency
# Overrides TARGET_PROGRAMS_PER_SM, for measuring another split rule end to end without an
# edit: on an H200, one layer of qwen3-0.6b's decode over 100-2,047-token contexts took 3-25%
# less with more splits than this rule gives (bench/results/decode-splits-h200.json), while 64
# sequences of 1,000 tokens took 9% more at two splits than at one.
PROGRAMS_PER_SM_ENV = "PAGESTREAM_DECODE_PROGRAMS_PER_SM"
MAX_PROGRAMS_PER_SM = 256
# How a sequence's context is cut into its splits: "even" (each split 1/NUM_SPLITS of its own
# context) or "balanced" (each split the batch's longest context over NUM_SPLITS, so a short
# sequence takes fewer busy programs); mixed contexts are where they differ. Measured end to
# end before it becomes the default (bench/gpu_suite.sh decode_splits).
SPLITS_ENV = "PAGESTREAM_DECODE_SPLITS"
SPLIT_MODES = ("even", "balanced")
LENS_BLOCK = tl.constexpr(128)  # seq_lens a balanced split reads at once, for the longest
# Decodes whose contexts all fit in this many tokens run unsplit: at batch 1 on an H100 a 1k
# context took 8.6 us a layer unsplit against 9.1 split (the reduction's launch and the
# partial sums cost more than the parallel gather saves); at 8k splitting wins (22 vs 25 us).
UNSPLIT_MAX_CONTEXT = 1024
DECODE_TILE_BYTES = 16384  # bytes of one K (or V) tile: 64 tokens of bf16 D=128, 128 of fp8
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3


# Ints that change from step to step are not specialized (Triton would compile a variant for
# each value that is 1 or a multiple of 16, at the first step that meets it).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    prefix_lens_ptr,  # [B]: keys below a sequence's are the prefix kernel's (if CASCADE)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # keys with pos > q_pos - window are kept (if HAS_WINDOW)
    stride_qt, stride_qh, stride_qd,  # q, out: [T, Hq, D]
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache, v_cache: [NB, BS, Hkv, D]
    stride_sb, stride_ss, stride_sh,  # k_scale, v_scale: [NB, BS, Hkv]
    stride_bt,  # block_tables: [B, max_blocks]
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    NUM_SPLITS: tl.constexpr,
    PART_STRIDE: tl.constexpr,  # partials per (sequence, head): NUM_SPLITS, + the prefix's
    BALANCED: tl.constexpr,  # splits of one length for the whole batch (see below)
    CASCADE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dot operand dtype
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # 1. this split's run of tiles, from the device seq_len (the query is at seq_len - 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if CASCADE:
        lo = tl.load(prefix_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, lo)
    first_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    if BALANCED and NUM_SPLITS > 1:
        # Every sequence's splits are as long as the batch's longest context over NUM_SPLITS:
        # a short sequence fills only its first splits (the others exit at once), so no
        # program holds more than that and the SMs finish together. Even splits (below) give
        # each program 1/NUM_SPLITS of its own sequence, as uneven as the contexts are.
        longest = tl.full((), 0, tl.int32)
        for start in range(0, tl.num_programs(0), LENS_BLOCK):  # the batch's decodes
            offs = start + tl.arange(0, LENS_BLOCK)
            lens = tl.load(seq_lens_ptr + offs, mask=offs < tl.num_programs(0), other=0)
            longest = tl.maximum(longest, tl.max(lens, axis=0))
        tiles_per_split = tl.cdiv(tl.cdiv(longest, BLOCK_N), NUM_SPLITS)
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)

    # 2. the group's queries as the rows of one dot: [GROUP_PAD, BLOCK_D]
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_q = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_q, other=0.0).to(DOT_DTYPE)

    # 3. the split's tiles of the sequence's own pages
    result, lse = attend_keys(
        q, tile_begin, tile_end, lo, seq_len, seq_len, block_tables_ptr + seq * stride_bt,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head, qk_scale,
        stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
        GROUP_PAD, BLOCK_D, BLOCK_N, HEAD_DIM, BLOCK_SIZE, IS_FP8, DOT_DTYPE, DOT_PRECISION,
        False,
    )  # fmt: skip

    # 4. straight to `out`, or a partial plus its log-sum-exp
    if PART_STRIDE == 1:
        out_ptrs = (
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        )
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_q)
    else:
        # part_out: [B, Hq, PART_STRIDE, BLOCK_D]; part_lse: [B, Hq, PART_STRIDE] (contiguous)
        rows = (seq * GROUP * tl.num_programs(1) + heads) * PART_STRIDE + split
        tl.store(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], result, mask=mask_q)
        tl.store(part_lse_ptr + rows, lse, mask=offs_g < GROUP)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # [B, Hq, NUM_SPLITS, BLOCK_D] float32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32, base 2
    out_ptr,
    prefix_lens_ptr,  # [B] (if CASCADE): a decode without a share has no prefix partials
    stride_ot, stride_oh, stride_od,  # out: [T, Hq, D]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    DECODE_SPLITS: tl.constexpr,  # the decode kernel's; the prefix kernel's follow (CASCADE)
    CASCADE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    if CASCADE:  # the prefix kernel wrote the partials of the decodes in its tiles only
        share = tl.load(prefix_lens_ptr + seq)
        mask_s = offs_s < tl.where(share > 0, NUM_SPLITS, DECODE_SPLITS)
    # 1. weight of each split: 2^(lse_s - max lse); empty splits carry NEG_BIG, weight 0
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=mask_s, other=NEG_BIG)
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    weights = tl.where(mask_s, weights, 0.0)
    # 2. weighted mean of the partial outputs (columns past HEAD_DIM were never written)
    parts = tl.load(
        part_out_ptr + (row0 + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    result = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    out_ptrs = out_ptr + seq * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    num_decodes: int = 0,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    prefill_config: PrefillConfig | None = None,
    first_seq: int = 0,
    end_seq: int | None = None,
    prefix_lens: torch.Tensor | None = None,
    prefix_pages: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_tile_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed batch over the page pool; matches ``paged_attention_ref``.

    Shapes: ``q, out: [T, Hq, D]`` (the new tokens of every sequence, packed); ``k_cache,
    v_cache: [NB, BS, Hkv, D]`` (any strides, equal for both, e.g. a layer's slice of a
    ``[L, 2, NB, BS, Hkv, D]`` pool); ``block_tables: [B, max_blocks]``, ``seq_lens: [B]``
    (context incl. the new tokens), ``query_start_loc: [B + 1]``, all int32 on q's device;
    ``k_scale, v_scale: [NB, BS, Hkv]`` float32 when the pool is ``float8_e4m3fn``.
    Host ints: ``max_query_len`` (1 = decode only), ``num_decodes`` (the leading sequences
    with exactly one new token), ``num_kv_splits`` (decode split-KV; default from B, Hkv, the
    SM count and ``max_seq_len``, a bound on ``seq_lens`` if known). ``prefill_config``: the
    prefill kernel's tile and launch shape (default: ``prefill_tuning.config_for``, the measured
    table or the GPU's default); the bench and the tests set it. Nothing syncs with the
    host; grids follow shapes and host ints only, so a fixed-shape call can be captured in a
    CUDA graph (the split scratch is allocated inside).

    ``first_seq``, ``end_seq``: attend only sequences ``first_seq:end_seq`` (default: all),
    writing their rows of ``out`` and no other; ``max_query_len`` then bounds theirs. A range
    starts at 0 or after the leading decodes. A caller that attends a step in parts passes
    the step's own tensors with a range rather than slices of them: a slice at sequence ``s``
    moves the int32 pointers by ``4 * s`` bytes, and Triton compiles another kernel for a
    pointer off 16-byte alignment (1.6-1.8 s on an H100, inside whatever step first meets it).

    ``prefix_lens``, ``prefix_pages``, ``prefix_rows``, ``prefix_tile_groups``: a cascade
    decode (the module docstring), all four or none, int32. ``prefix_pages: [G, max_blocks]``
    are the pages of the prefixes that groups of decodes share; ``prefix_lens: [>=
    num_decodes]`` gives each decode's share of its group's, in tokens: whole pages that its
    own block table names as its group's row does, none of them holding its last token (below
    its ``seq_len``), or 0; ``prefix_rows``, ``prefix_tile_groups``: the groups' decodes laid
    out in row tiles (``cascade_triton.prefix_tiles``). The decodes attend their shares
    together, then the rest of their keys alone. The kernels read all four on the device: a
    graph captured with them replays whatever they hold. Not with a sliding window.
    """
    check_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale
    )
    batch, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    end_seq = batch if end_seq is None else end_seq
    if not 0 <= first_seq < end_seq <= batch:
        raise ValueError(
            f"need 0 <= first_seq < end_seq <= B={batch}, got {first_seq} and {end_seq}"
        )
    if max_query_len == 1 and first_seq == 0:
        num_decodes = end_seq  # a decode-only batch
    if max_query_len < 1 or not 0 <= num_decodes <= batch:
        raise ValueError(
            f"need max_query_len >= 1 and 0 <= num_decodes <= B={batch}, got "
            f"{max_query_len} and {num_decodes}"
        )
    if 0 < first_seq < num_decodes:
        raise ValueError(
            f"a range starts at 0 or after the {num_decodes} leading decodes, got {first_seq}"
        )
    num_decodes = min(num_decodes, end_seq) if first_seq == 0 else 0  # the range's
    first_prefill = max(first_seq, num_decodes)
    if not scale > 0:
        raise ValueError(f"scale must be positive (it multiplies q.k), got {scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive token count, got {sliding_window}")
    cascade = (prefix_lens, prefix_pages, prefix_rows, prefix_tile_groups)
    shared = check_cascade(cascade, q.shape[1] // num_kv_heads, q.device, sliding_window)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_decodes, num_kv_heads, q.device, max_seq_len)
    if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
    if out is None:
        out = torch.empty_like(q)
    check_out(out, q)
    is_fp8 = k_cache.dtype == FP8_DTYPE
    scales = (k_scale, v_scale) if is_fp8 else (None, None)
    if num_decodes > 0:  # decode
        _launch_decode(
            q, k_cache, v_cache, *scales, block_tables, seq_lens, out,
            scale=scale, num_decodes=num_decodes, sliding_window=sliding_window,
            num_splits=num_kv_splits, prefix=shared, max_seq_len=max_seq_len,
        )  # fmt: skip
    if first_prefill < end_seq:  # prefill / mixed
        launch_prefill(
            q, k_cache, v_cache, *scales, block_tables, seq_lens, query_start_loc, out,
            scale=scale, first_seq=first_prefill, end_seq=end_seq, max_query_len=max_query_len,
            sliding_window=sliding_window, config=prefill_config,
        )  # fmt: skip
    return out


def default_num_kv_splits(
    num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None = None
) -> int:
    """Splits per (sequence, kv head): up to ``target_programs_per_sm()`` programs per SM, and
    none when every context is known to fit in UNSPLIT_MAX_CONTEXT tokens.

    Depends on shapes, the device and the bound ``max_seq_len`` only, never on the lengths
    themselves: a CUDA graph captured for a batch size and a bound stays valid for any
    contexts within it.
    """
    if max_seq_len is not None and max_seq_len <= UNSPLIT_MAX_CONTEXT:
        return 1
    num_programs = max(num_seqs * num_kv_heads, 1)
    target = target_programs_per_sm() * num_sms(device)
    if num_programs >= target:
        return 1  # already as many programs as wanted: splitting only adds the reduction
    wanted = triton.cdiv(target, num_programs)
    # A power of two: NUM_SPLITS is compiled in, and a mixed step's decode count is anything
    # from 1 up: seven variants to compile instead of one per count.
    return min(MAX_KV_SPLITS, 1 << (wanted.bit_length() - 1))


@functools.cache
def target_programs_per_sm() -> int:
    """How many decode programs per SM the split count aims at: ``TARGET_PROGRAMS_PER_SM``, or
    ``PAGESTREAM_DECODE_PROGRAMS_PER_SM`` where set. Read once per process (not at each of
    an eager step's launches): its CUDA graphs were captured with the split counts it gave."""
    value = os.environ.get(PROGRAMS_PER_SM_ENV, "").strip()
    if not value:
        return TARGET_PROGRAMS_PER_SM
    if not value.isdigit() or not 1 <= int(value) <= MAX_PROGRAMS_PER_SM:
        raise ValueError(
            f"{PROGRAMS_PER_SM_ENV}={value!r}: give the decode programs per SM that the split "
            f"count aims at, a whole number 1..{MAX_PROGRAMS_PER_SM} (default "
            f"{TARGET_PROGRAMS_PER_SM})"
        )
    return int(value)


@functools.cache
def balanced_splits() -> bool:
    """Whether ``PAGESTREAM_DECODE_SPLITS`` asks for balanced splits (default: even). Read
    once per process, as ``target_programs_per_sm``."""
    mode = os.environ.get(SPLITS_ENV, "").strip() or SPLIT_MODES[0]
    if mode not in SPLIT_MODES:
        raise ValueError(f"{SPLITS_ENV}={mode!r}: give one of {', '.join(SPLIT_MODES)}")
    return mode == "balanced"


def decode_scratch_bytes(
    num_decodes: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    max_seq_len: int, cascade: bool = False,
) -> int:  # fmt: skip
    """Bytes of the split partials that a decode of ``num_decodes`` rows at the default split
    count for the bound ``max_seq_len`` allocates (with ``cascade``, its prefix's splits
    too). They live for one layer's attention; what a captured decode graph holds at its peak
    beyond a one-token step's temporaries, which never split."""
    num_splits = default_num_kv_splits(num_decodes, num_kv_heads, device, max_seq_len)
    if cascade:
        group = num_heads // num_kv_heads
        num_splits += prefix_num_splits(num_decodes, group, num_kv_heads, max_seq_len, device)
    if num_splits <= 1:
        return 0  # the decode writes its output directly
    shapes = _partial_shapes(num_decodes, num_heads, num_splits, pow2_at_least(head_dim, 16))
    return sum(math.prod(shape) for shape in shapes) * 4  # float32


def _partial_shapes(
    num_decodes: int, num_heads: int, part_stride: int, block_d: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each split's output and log-sum-exp, float32: what the reduction folds."""
    return (num_decodes, num_heads, part_stride, block_d), (num_decodes, num_heads, part_stride)


def _allocate_partials(
    num_decodes: int, num_heads: int, part_stride: int, block_d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    out_shape, lse_shape = _partial_shapes(num_decodes, num_heads, part_stride, block_d)
    return (
        torch.empty(out_shape, dtype=torch.float32, device=device),
        torch.empty(lse_shape, dtype=torch.float32, device=device),
    )


def _decode_block_n(block_d: int, element_size: int) -> int:
    """Tokens per tile: DECODE_TILE_BYTES of one head's K (fp8 pools get twice the tokens)."""
    return max(16, min(128, DECODE_TILE_BYTES // (block_d * element_size)))


def _launch_decode(
    q: torch.Tensor,  # [T, Hq, D]; rows 0..num_decodes-1 are the decodes
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [NB, BS, Hkv] float32 with an fp8 pool
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [T, Hq, D]
    *,
    scale: float,
    num_decodes: int,
    sliding_window: int | None,
    num_splits: int,
    # a cascade decode's (prefix_lens, prefix_pages [G, max_blocks], prefix_rows,
    # prefix_tile_groups), as ``paged_attention`` takes them
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    max_seq_len: int | None = None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = pow2_at_least(head_dim, 16)
    is_fp8 = k_scale is not None
    scale_args = (k_scale if is_fp8 else k_cache, v_scale if is_fp8 else k_cache)
    scale_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    dot_args = dict(
        IS_FP8=is_fp8, DOT_DTYPE=dot_dtype(q, k_cache), DOT_PRECISION=dot_precision(q.dtype)
    )
    prefix_splits = 0  # the prefix kernel's, for a cascade
    if prefix is not None:
        prefix_splits = prefix_num_splits(num_decodes, group, num_kv_heads, max_seq_len, q.device)
    part_stride = num_splits + prefix_splits
    part_out = part_lse = out  # placeholders when the decode writes `out` directly
    if part_stride > 1:
        part_out, part_lse = _allocate_partials(
            num_decodes, num_heads, part_stride, block_d, q.device
        )
    if prefix is not None:
        launch_prefix(
            q, k_cache, v_cache, scale_args, scale_strides, prefix, part_out, part_lse,
            qk_scale=scale * LOG2_E, prefix_splits=prefix_splits, split_base=num_splits,
            dot_args=dot_args,
        )  # fmt: skip
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        q, k_cache, v_cache, *scale_args,
        block_tables, seq_lens, out, part_out, part_lse,
        seq_lens if prefix is None else prefix[0],  # read only with CASCADE
        scale * LOG2_E, sliding_window or 0,
        *q.stride(), *out.stride(), *k_cache.stride(), *scale_strides, block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=pow2_at_least(group, MIN_DOT_ROWS),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=_decode_block_n(block_d, k_cache.element_size()),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=num_splits,
        PART_STRIDE=part_stride,
        BALANCED=balanced_splits(),
        CASCADE=prefix is not None,
        HAS_WINDOW=sliding_window is not None,
        **dot_args,
        num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
        **pdl_launch(q),
    )  # fmt: skip
    if part_stride > 1:
        _reduce_splits_kernel[(num_decodes, num_heads)](
            part_out, part_lse, out, seq_lens if prefix is None else prefix[0], *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=part_stride,
            SPLITS_PAD=triton.next_power_of_2(part_stride),
            DECODE_SPLITS=num_splits,
            CASCADE=prefix is not None,
            **pdl_launch(q),
        )  # fmt: skip


def decode_graph_contexts(
    num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int
) -> list[int]:
    """The context bounds a decode of ``num_seqs`` rows is worth capturing at, ascending and
    ending at ``max_seq_len``: where its split count changes below that."""
    if (
        max_seq_len > UNSPLIT_MAX_CONTEXT
        and default_num_kv_splits(num_seqs, num_kv_heads, device) > 1
    ):
        return [UNSPLIT_MAX_CONTEXT, max_seq_len]
    return [max_seq_len]
