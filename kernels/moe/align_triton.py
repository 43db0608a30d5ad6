# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""(token, slot) pairs sorted by expert and padded per expert to the GEMM's ``BLOCK_M``.

Pair ``p = t * top_k + j`` is token ``t``'s ``j``-th expert. The grouped GEMMs want each
expert's pairs side by side, in runs that are whole ``BLOCK_M`` blocks, so that a program
multiplies one block by one expert's weight. Three launches, no host sync:

1. ``_moe_count_kernel`` (a program per ``CHUNK`` pairs): how many pairs of each expert its
   chunk holds, ``counts [num_chunks, E]``;
2. ``_moe_offsets_kernel`` (one program): in place, the number of pairs of each expert in the
   chunks before (a running sum down the chunks); each expert's run padded to ``BLOCK_M``
   and laid end to end; the expert of every block (-1 past the end) and the padding slots'
   sentinel (``num_pairs``, a row the GEMMs skip; at most ``BLOCK_M - 1`` an expert, so one
   ``[E, BLOCK_M]`` tile writes them all);
3. ``_moe_scatter_kernel`` (a program per chunk): each pair to ``run start + pairs of its
   expert before it``: within an expert, pairs keep their order (a stable sort), so the
   layout depends on the routing only, never on timing.

Every buffer is sized for the worst case of ``num_pairs`` (``max_padded_pairs``), so a
decode step captured in a CUDA graph replays with any routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_producers

PAIRS_PER_TILE = 8192  # CHUNK * E_PAD: a chunk's one-hot tile, in registers
OFFSETS_BLOCK_C = 64  # chunks (blocks) per step of the running sum (the block experts)


@dataclass(frozen=True)
class MoeAlignment:
    """Where each pair sits in the expert-sorted, block-padded layout."""

    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids by expert; padding = num_pairs
    block_experts: torch.Tensor  # [max_padded / block_m] int32: expert of each block, -1 past
    num_padded: torch.Tensor  # [1] int32: slots in use (a multiple of block_m)
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots the layout may need: every expert with a pair may add a partial block."""
    return (triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)) * block_m


@triton.jit
def _moe_count_kernel(
    ids_ptr, counts_ptr, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_producers(PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    onehot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _moe_offsets_kernel(
    counts_ptr,  # [num_chunks, E_PAD]: counts in, pairs of the expert in earlier chunks out
    run_starts_ptr,  # [E_PAD] int32: first slot of each expert's run
    sorted_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_chunks,
    num_pairs,
    max_blocks,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    offs_e = tl.arange(0, E_PAD)
    # 1. running sum of the counts down the chunks (exclusive), a tile of chunks at a time
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for first in range(0, num_chunks, BLOCK_C):
        offs_c = first + tl.arange(0, BLOCK_C)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        mask = offs_c[:, None] < num_chunks
        tile = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + totals[None, :], mask=mask)
        totals += tl.sum(tile, axis=0)
    # 2. each expert's run, padded to whole blocks, end to end in expert order
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M
    run_ends = tl.cumsum(padded, axis=0)
    run_starts = run_ends - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(run_starts_ptr + offs_e, run_starts)
    tl.store(num_padded_ptr, num_padded)
    # 3. the expert of each block: the runs that end at or before its first slot (-1 past)
    for first in range(0, max_blocks, BLOCK_C):
        offs_b = first + tl.arange(0, BLOCK_C)
        slot = offs_b * BLOCK_M
        expert = tl.sum((run_ends[None, :] <= slot[:, None]).to(tl.int32), axis=1)
        expert = tl.where(slot < num_padded, expert, -1)
        tl.store(block_experts_ptr + offs_b, expert, mask=offs_b < max_blocks)
    # 4. the sentinel in the padding slots at the end of each run (fewer than BLOCK_M each)
    used_ends = run_starts + totals
    slot = used_ends[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [E_PAD, BLOCK_M]
    tl.store(sorted_ptr + slot, num_pairs, mask=slot < run_ends[:, None])


@triton.jit
def _moe_scatter_kernel(
    ids_ptr,
    counts_ptr,  # [num_chunks, E_PAD]: pairs of each expert in the chunks before
    run_starts_ptr,
    sorted_ptr,
    num_pairs,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    offs_e = tl.arange(0, E_PAD)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1)
    mask &= (ids >= 0) & (ids < E_PAD)  # an id no expert has gets no slot (never slot 0)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    before = tl.load(counts_ptr + chunk * E_PAD + offs_e) + tl.load(run_starts_ptr + offs_e)
    # this pair's slot: its run's start + its expert's pairs in earlier chunks + in this one
    rank = tl.cumsum(onehot, axis=0) - onehot
    slot = tl.sum(onehot * (rank + before[None, :]), axis=1)
    tl.store(sorted_ptr + slot, offs, mask=mask)


def align_pairs(
    topk_ids: torch.Tensor,  # [T, top_k] int32, contiguous
    num_experts: int,
    block_m: int,
) -> MoeAlignment:
    """Sort the pairs of ``topk_ids`` by expert into runs padded to ``block_m`` (a power of
    two, at least 16); see the module docstring."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    device, num_pairs = topk_ids.device, topk_ids.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, PAIRS_PER_TILE // e_pad)
    num_chunks = max(triton.cdiv(num_pairs, chunk), 1)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    run_starts = torch.empty(e_pad, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    pdl = pdl_launch(topk_ids)
    _moe_count_kernel[(num_chunks,)](topk_ids, counts, num_pairs, E_PAD=e_pad, CHUNK=chunk, **pdl)
    _moe_offsets_kernel[(1,)](
        counts, run_starts, sorted_pairs, block_experts, num_padded, num_chunks, num_pairs,
        block_experts.numel(), E_PAD=e_pad, BLOCK_M=block_m, BLOCK_C=OFFSETS_BLOCK_C, num_warps=8, **pdl,
    )  # fmt: skip
    _moe_scatter_kernel[(num_chunks,)](
        topk_ids, counts, run_starts, sorted_pairs, num_pairs, E_PAD=e_pad, CHUNK=chunk, **pdl
    )
    return MoeAlignment(sorted_pairs, block_experts, num_padded, block_m)
