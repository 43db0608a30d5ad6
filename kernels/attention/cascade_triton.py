# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Cascade decode: decodes that share a prompt's leading pages attend them together.

``_prefix_kernel`` takes the queries of many decodes of one kv head as the rows of its
``tl.dot`` ((sequence, query head) pairs, BLOCK_M a program), so a tile of a shared prefix is
read once per row tile instead of once per sequence; each row stops at its own share. Its
partial outputs and log-sum-exps go beside the decode kernel's splits, which then attend
each sequence's keys after its share, and the split reduction folds both
(``paged_attention_triton``): one softmax over two disjoint key sets, exact.

Several prefixes (groups, e.g. the system prompts of a few tenants) go in one launch: each row
tile holds the decodes of one group (``prefix_tiles``) and reads that group's pages. The
shares, the tiles' rows and their groups are read on the device, so a CUDA graph captured
with room for some groups replays any step's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.paged_attention_common import attend_keys, num_sms, pow2_at_least
from kernels.pdl import pdl_launch, wait_for_producers

# Cascade decode's prefix kernel: BLOCK_M (sequence, query head) rows a program, BLOCK_N keys
# a tile, and at most this many splits of the prefix (enough programs to fill the SMs when the
# row tiles are few)
PREFIX_BLOCK_M = 64
PREFIX_BLOCK_N = 64
MAX_PREFIX_SPLITS = 16
PREFIX_PROGRAMS_PER_SM = 2  # as the decode kernel's splits: enough to hide gather latency
PREFIX_NUM_WARPS = 4
PREFIX_NUM_STAGES = 2


def prefix_block_m(group: int) -> int:
    """Rows of a prefix program: PREFIX_BLOCK_M, or one sequence's query heads if more."""
    return max(PREFIX_BLOCK_M, pow2_at_least(group, 1))


def prefix_seqs_per_tile(group: int) -> int:
    """Decodes in one row tile of the prefix kernel, for ``group`` query heads a kv head."""
    return prefix_block_m(group) // group


def max_prefix_tiles(num_decodes: int, num_groups: int, group: int) -> int:
    """The most row tiles ``prefix_tiles`` lays ``num_decodes`` out in over ``num_groups``."""
    return triton.cdiv(num_decodes, prefix_seqs_per_tile(group)) + num_groups - 1


def prefix_tiles(
    groups: list[list[int]], group: int, num_tiles: int | None = None
) -> tuple[list[int], list[int]]:
    """The prefix kernel's row tiles for decodes sharing ``groups[g]``'s prefix (decode
    indices, each in one group at most), ``group`` query heads a kv head: (``prefix_rows``,
    the decode of each tile's slots, -1 for none; ``prefix_tile_groups``, each tile's group,
    -1 for none). ``num_tiles`` pads both to that many tiles (a graph's fixed grid)."""
    per_tile = prefix_seqs_per_tile(group)
    rows: list[int] = []
    tile_groups: list[int] = []
    for index, members in enumerate(groups):
        tiles = triton.cdiv(len(members), per_tile)
        rows += [*members, *[-1] * (tiles * per_tile - len(members))]
        tile_groups += [index] * tiles
    if num_tiles is not None:
        if len(tile_groups) > num_tiles:
            raise ValueError(f"{len(tile_groups)} prefix tiles do not fit in {num_tiles}")
        rows += [-1] * ((num_tiles - len(tile_groups)) * per_tile)
        tile_groups += [-1] * (num_tiles - len(tile_groups))
    return rows, tile_groups


@triton.jit(do_not_specialize=["stride_pg"])
def _prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    pages_ptr,  # [G, max_blocks]: each group's prefix pages
    part_out_ptr, part_lse_ptr,
    prefix_lens_ptr,  # [B]: each decode's share of its group's prefix, in tokens (0: none)
    rows_ptr,  # [tiles * SEQS_PER_TILE]: the decode in each slot of each tile (-1: none)
    tile_groups_ptr,  # [tiles]: each tile's group (-1: none)
    qk_scale,
    stride_pg,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_ss, stride_sh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEQS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
    SPLIT_BASE: tl.constexpr,  # the prefix's partials follow the decode kernel's NUM_SPLITS
    PART_STRIDE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The decodes' queries of one kv head over their group's prefix, each row over its own
    share: a program owns one row tile (up to SEQS_PER_TILE decodes of one group, their
    query heads of the kv head as BLOCK_M rows) and one split of the tiles of the longest
    share among them."""
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    slot = offs_m // GROUP
    in_tile = slot < SEQS_PER_TILE
    seqs = tl.load(rows_ptr + tile * SEQS_PER_TILE + slot, mask=in_tile, other=-1)
    mask_m = in_tile & (seqs >= 0)
    seqs = tl.where(mask_m, seqs, 0)
    heads = kv_head * GROUP + offs_m % GROUP
    table_ptr = pages_ptr + tl.maximum(tl.load(tile_groups_ptr + tile), 0) * stride_pg
    mask_q = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + seqs[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=mask_q, other=0.0).to(DOT_DTYPE)

    row_lens = tl.load(prefix_lens_ptr + seqs, mask=mask_m, other=0)
    prefix_len = tl.max(row_lens, axis=0)
    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, PREFIX_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    result, lse = attend_keys(
        q, tile_begin, tile_end, 0, prefix_len, row_lens, table_ptr,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, offs_d, kv_head, qk_scale,
        stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
        BLOCK_M, BLOCK_D, BLOCK_N, HEAD_DIM, BLOCK_SIZE, IS_FP8, DOT_DTYPE, DOT_PRECISION,
        True,
    )  # fmt: skip
    num_heads = GROUP * tl.num_programs(1)
    rows = (seqs * num_heads + heads) * PART_STRIDE + SPLIT_BASE + split
    tl.store(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], result, mask=mask_q)
    tl.store(part_lse_ptr + rows, lse, mask=mask_m)


def check_cascade(
    tensors: tuple[torch.Tensor | None, ...],
    group: int,
    device: torch.device,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``paged_attention``'s (prefix_lens, prefix_pages, prefix_rows, prefix_tile_groups),
    checked for ``group`` query heads a kv head: all four, or None for none."""
    if all(tensor is None for tensor in tensors):
        return None
    lens, pages, rows, tile_groups = tensors
    if lens is None or pages is None or rows is None or tile_groups is None:
        raise ValueError(
            "prefix_lens, prefix_pages, prefix_rows and prefix_tile_groups go together"
        )
    named = (
        ("prefix_lens", lens, 1), ("prefix_pages", pages, 2), ("prefix_rows", rows, 1),
        ("prefix_tile_groups", tile_groups, 1),
    )  # fmt: skip
    for name, tensor, dims in named:
        if tensor.dim() != dims or tensor.dtype != torch.int32:
            raise ValueError(
                f"{name} must be {dims}-d int32, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        if tensor.device != device:
            raise ValueError(f"{name} must be on {device}, not {tensor.device}")
    if rows.numel() != tile_groups.numel() * prefix_seqs_per_tile(group):
        raise ValueError(
            f"prefix_rows must hold {prefix_seqs_per_tile(group)} slots for each of the "
            f"{tile_groups.numel()} tiles at {group} query heads a kv head "
            f"(prefix_tiles), got {rows.numel()}"
        )
    if sliding_window is not None:
        raise ValueError("a shared prefix does not go with a sliding window")
    return lens, pages, rows, tile_groups


def prefix_num_splits(
    num_decodes: int, group: int, num_kv_heads: int, max_seq_len: int | None,
    device: torch.device,
) -> int:  # fmt: skip
    """Splits of a cascade decode's prefix: up to PREFIX_PROGRAMS_PER_SM programs per SM over
    the (row tile, kv head) programs, a power of two (a compiled-in constant), at most
    MAX_PREFIX_SPLITS, and no more than a prefix below ``max_seq_len`` (a bound, if known) has
    tiles. Splits past the prefix's tiles end at once.

    Counted over the tiles of ``num_decodes`` decodes in one group, whatever the launch's
    grid: a graph's spare tiles (room for more groups) hold no rows, and counting them halved
    the splits of a one-group step (and its speed, on an H200)."""
    busy_tiles = triton.cdiv(num_decodes, prefix_seqs_per_tile(group))
    wanted = triton.cdiv(PREFIX_PROGRAMS_PER_SM * num_sms(device), busy_tiles * num_kv_heads)
    wanted = min(wanted, MAX_PREFIX_SPLITS)
    if max_seq_len is not None:
        wanted = min(wanted, triton.cdiv(max_seq_len, PREFIX_BLOCK_N))
    return 1 << (max(wanted, 1).bit_length() - 1)


def launch_prefix(
    q: torch.Tensor,  # [T, Hq, D]; rows 0..num_decodes-1 are the decodes
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    scale_args: tuple[torch.Tensor | None, ...],  # k_scale, v_scale (placeholders if not fp8)
    scale_strides: tuple[int, ...],
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # check_cascade's
    part_out: torch.Tensor,  # [num_decodes, Hq, part_stride, BLOCK_D] float32
    part_lse: torch.Tensor,  # [num_decodes, Hq, part_stride] float32
    *,
    qk_scale: float,  # softmax scale * log2(e)
    prefix_splits: int,
    split_base: int,  # the decode kernel's splits: the prefix's partials follow them
    dot_args: dict[str, object],
) -> None:
    """The prefix kernel over ``prefix``'s row tiles, ``prefix_splits`` splits each."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    prefix_lens, prefix_pages, prefix_rows, prefix_tile_groups = prefix
    _prefix_kernel[(prefix_tile_groups.shape[0], num_kv_heads, prefix_splits)](
        q, k_cache, v_cache, *scale_args, prefix_pages, part_out, part_lse, prefix_lens,
        prefix_rows, prefix_tile_groups, qk_scale, prefix_pages.stride(0),
        *q.stride(), *k_cache.stride(), *scale_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=pow2_at_least(head_dim, 16),
        BLOCK_M=prefix_block_m(group),
        SEQS_PER_TILE=prefix_seqs_per_tile(group),
        BLOCK_N=PREFIX_BLOCK_N,
        BLOCK_SIZE=k_cache.shape[1],
        PREFIX_SPLITS=prefix_splits,
        SPLIT_BASE=split_base,
        PART_STRIDE=part_out.shape[2],
        **dot_args,
        num_warps=PREFIX_NUM_WARPS,
        num_stages=PREFIX_NUM_STAGES,
        **pdl_launch(q),
    )  # fmt: skip
