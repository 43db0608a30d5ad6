# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""The experts' GEMMs for a handful of pairs: one (token, slot) pair per program, no sort.

At batch 1-2 a step routes a few pairs to as many experts: each expert sees one row, and the
aligned path pads it to a 16-row ``tl.dot`` after three launches that sort the pairs. Here a
program reads its pair's expert id itself and streams ``BLOCK_N`` rows of that expert's
weight as a GEMV does (``[BLOCK_N, BLOCK_K]`` tiles, contiguous along K, products summed in
float32), with the epilogue of ``grouped_gemm_triton.py``'s gate/up (SiLU-and-mul). Down
takes a program per token instead, walking the token's experts in slot order, so the
routing weights and the top-k sum land in its epilogue: no terms buffer, no sum launch, and
the same rounding points. ``MoeConfig.block_m == DIRECT_BLOCK_M`` selects the path.

At batch 1 that down kernel has only ``H / BLOCK_N`` programs, each reading ``top_k``
experts' rows one after another: too few to keep a large GPU's memory busy. A down tile
with ``split_slots`` runs a program per pair instead (``top_k`` times the programs); each
parks its product in a kept buffer and takes a ticket from an atomic counter, and the
token's last program weighs and sums the products in slot order, so the output is the same
bit for bit (buffers and their ownership: ``split_slot_buffers.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import tile_offsets
from kernels.linear.int8_rows_triton import TL_FLOAT_DTYPES
from kernels.moe.config import GemmTile
from kernels.moe.split_slot_buffers import SlotTerms, SplitSlotBuffers
from kernels.pdl import pdl_launch, wait_for_producers


@triton.jit
def _moe_gate_up_silu_direct_kernel(
    x_ptr,  # [T, K], last stride 1
    w_ptr,  # [E, 2 * N, K], last stride 1
    w_scale_ptr,  # [E, 2 * N] float32 with W_SCALED
    act_ptr,  # [P, N], last stride 1
    ids_ptr,  # [P] int32: each pair's expert
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_ap,
    TOP_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K) * stride_xt + offs_k
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows of the same columns
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # 1. gate and up rows against the pair's x, in float32, a K step at a time
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        w_mask = mask_n[:, None] & mask_k[None, :]
        gate += tl.sum(tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x, axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_SCALED:
        scale_ptrs = w_scale_ptr + expert * stride_se + offs_n
        gate *= tl.load(scale_ptrs, mask=mask_n, other=0.0)
        up *= tl.load(scale_ptrs + N, mask=mask_n, other=0.0)
    # 2. silu(gate) * up at the reference's rounding points
    gate = gate.to(DTYPE).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    act = (silu * up.to(DTYPE).to(tl.float32)).to(DTYPE)
    tl.store(act_ptr + pair * stride_ap + offs_n, act, mask=mask_n)


@triton.jit
def _down_dot(
    act_ptr,
    w_ptr,
    w_scale_ptr,
    ids_ptr,
    pair,
    offs_n,
    mask_n,
    K,
    stride_ap,
    stride_we,
    stride_wn,
    stride_se,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``pair``'s down output at columns ``offs_n`` before its routing weight: its expert's
    rows against its activation row in float32."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair * stride_ap + offs_k
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        out += tl.sum(w.to(tl.float32) * a, axis=1)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALED:
        out *= tl.load(w_scale_ptr + expert * stride_se + offs_n, mask=mask_n, other=0.0)
    return out


@triton.jit
def _weighted_term(dot, weight, DTYPE: tl.constexpr):
    """A pair's term as the sorted path rounds it, in float32 for the sum. Both down kernels
    add it to their total in the same expression, so where DTYPE is float32 and the compiler
    fuses the product into the add, it does so in both."""
    return (dot.to(DTYPE).to(tl.float32) * weight).to(DTYPE).to(tl.float32)


@triton.jit
def _moe_down_sum_direct_kernel(
    act_ptr,  # [T * TOP_K, K], last stride 1
    w_ptr,  # [E, N, K], last stride 1
    w_scale_ptr,  # [E, N] float32 with W_SCALED
    weights_ptr,  # [T * TOP_K] float32: each pair's routing weight
    out_ptr,  # [T, N], last stride 1
    ids_ptr,  # [T * TOP_K] int32
    N,
    K,
    stride_ap,
    stride_we,
    stride_wn,
    stride_se,
    stride_ot,
    TOP_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    token, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # the token's experts in slot order: a fixed sum
        pair = token * TOP_K + slot
        dot = _down_dot(
            act_ptr, w_ptr, w_scale_ptr, ids_ptr, pair, offs_n, mask_n, K, stride_ap, stride_we,
            stride_wn, stride_se, W_SCALED, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        total += _weighted_term(dot, tl.load(weights_ptr + pair), DTYPE)  # rounded once
    tl.store(out_ptr + token * stride_ot + offs_n, total.to(DTYPE), mask=mask_n)


@triton.jit
def _moe_down_sum_split_slots_kernel(
    act_ptr,  # [T * TOP_K, K], last stride 1
    w_ptr,  # [E, N, K], last stride 1
    w_scale_ptr,  # [E, N] float32 with W_SCALED
    weights_ptr,  # [T * TOP_K] float32: each pair's routing weight
    out_ptr,  # [T, N], last stride 1
    ids_ptr,  # [T * TOP_K] int32
    terms_ptr,  # [T * TOP_K, N] float32, contiguous: each pair's product, for the last program
    tickets_ptr,  # [T, N] int32, contiguous, zero between calls: (token, tile) arrivals
    N,
    K,
    stride_ap,
    stride_we,
    stride_wn,
    stride_se,
    stride_ot,
    TOP_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    token, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    pair = token * TOP_K + slot
    # 1. this pair's product before its weight, parked for the token's last program, which
    # weighs and adds it as _moe_down_sum_direct_kernel does (the weight applied here and the
    # product stored would keep a float32 product from fusing into the add, as it does there)
    dot = _down_dot(
        act_ptr, w_ptr, w_scale_ptr, ids_ptr, pair, offs_n, mask_n, K, stride_ap, stride_we,
        stride_wn, stride_se, W_SCALED, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    terms_row = terms_ptr + token * TOP_K * N + offs_n  # the token's slot-0 product
    tl.store(terms_row + slot * N, dot, mask=mask_n)
    # 2. a ticket. The barrier has every thread's store issued before the one thread that
    # does a scalar atomic releases them (older Tritons put no barrier there themselves); the
    # acquire, and the barrier after it, order the last program's loads after every release.
    tl.debug_barrier()
    ticket_ptr = tickets_ptr + token * N + pid_n
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == TOP_K - 1:
        # 3. the token's last program: the products weighed and summed in slot order
        tl.debug_barrier()
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in tl.static_range(TOP_K):  # .cg: from L2, where the other SMs' stores are
            dot = tl.load(terms_row + s * N, mask=mask_n, other=0.0, cache_modifier=".cg")
            total += _weighted_term(dot, tl.load(weights_ptr + token * TOP_K + s), DTYPE)
        tl.store(out_ptr + token * stride_ot + offs_n, total.to(DTYPE), mask=mask_n)
        # zero for the next call: every ticket of this tile is drawn, and the next kernel to
        # use the counters runs after this one on the stream
        tl.store(ticket_ptr, 0)


def gate_up_silu_direct(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    topk_ids: torch.Tensor,  # [T, top_k] int32, contiguous
    tile: GemmTile,
    w13_scale: torch.Tensor | None = None,  # [E, 2 * I] float32
) -> torch.Tensor:  # [T * top_k, I]
    """``grouped_gemm_triton.gate_up_silu`` without the sort: a program per pair."""
    num_pairs, inter = topk_ids.numel(), w13.shape[1] // 2
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    scale, stride_se = (w13, 0) if w13_scale is None else (w13_scale, w13_scale.stride(0))
    _moe_gate_up_silu_direct_kernel[(num_pairs, triton.cdiv(inter, tile.block_n))](
        x, w13, scale, act, topk_ids, inter, x.shape[1], x.stride(0), w13.stride(0),
        w13.stride(1), stride_se, act.stride(0), TOP_K=topk_ids.shape[1],
        W_SCALED=w13_scale is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        DTYPE=TL_FLOAT_DTYPES[x.dtype], num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_launch(x),
    )  # fmt: skip
    return act


def down_sum_direct(
    act: torch.Tensor,  # [T * top_k, I]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32, contiguous
    topk_ids: torch.Tensor,  # [T, top_k] int32, contiguous
    tile: GemmTile,
    out: torch.Tensor,  # [T, H], act's dtype
    w2_scale: torch.Tensor | None = None,  # [E, H] float32
    buffers: SplitSlotBuffers | None = None,  # tile.split_slots: kept scratch, else per call
) -> torch.Tensor:  # out
    """``down_weighted`` and ``sum_topk`` in one, the same output bit for bit either way: a
    program per token and ``block_n`` columns walks the token's experts in slot order (no
    terms buffer, no atomics), or with ``tile.split_slots`` a program per pair and
    ``block_n`` columns, the token's last to finish weighing and summing the products in
    slot order."""
    num_tokens, top_k = topk_ids.shape
    hidden = w2.shape[1]
    scale, stride_se = (w2, 0) if w2_scale is None else (w2_scale, w2_scale.stride(0))
    grid: tuple[int, ...] = (num_tokens, triton.cdiv(hidden, tile.block_n))
    scratch: tuple[torch.Tensor, ...] = ()  # split_slots: the products and ticket counters
    kernel = _moe_down_sum_direct_kernel
    if tile.split_slots:
        shape = (num_tokens, top_k, hidden, act.device)
        slot_terms = SlotTerms.allocate(*shape) if buffers is None else buffers.take(*shape)
        grid, kernel = (*grid, top_k), _moe_down_sum_split_slots_kernel
        scratch = (slot_terms.terms, slot_terms.tickets)
    kernel[grid](
        act, w2, scale, topk_weights, out, topk_ids, *scratch, hidden, act.shape[1],
        act.stride(0), w2.stride(0), w2.stride(1), stride_se, out.stride(0), TOP_K=top_k,
        W_SCALED=w2_scale is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        DTYPE=TL_FLOAT_DTYPES[act.dtype], num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_launch(act),
    )  # fmt: skip
    return out
