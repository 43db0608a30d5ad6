# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Skinny matmul (GEMV) in Triton for decode at small batch: ``out = act(x) @ w.T``.

At batch 1 a decode step's linears read every weight once for one row of activations: the
time is the weight bytes over the memory bandwidth, and a kernel built for it streams ``w``
with wide coalesced loads, many rows in flight per SM, and no tensor-core tiling to pad.

A program owns ``BLOCK_N`` output columns (rows of ``w``) for all ``M <= MAX_ROWS`` rows of
``x``; it walks ``K`` in ``BLOCK_K`` steps:
  1. load ``w[n, k]`` ``[BLOCK_N, BLOCK_K]`` (contiguous along ``K``)
  2. load ``x[m, k]`` ``[M_PAD, BLOCK_K]``; with ``SILU_MUL`` the input is a gate_up row
     ``[M, 2K]`` and ``x = silu(gate) * up`` is formed here, in registers (the MLP's
     activation fused into the down projection's prologue: one kernel and one round trip less)
  3. ``acc[m, n] += sum_k x[m, k] * w[n, k]`` in fp32
and stores ``acc`` in the output dtype. ``SPLIT_K > 1`` splits ``K`` over programs that add
their fp32 partial sums atomically into a zeroed fp32 buffer (more programs for short ``N``).

With a ``RowNorm`` the layer's residual add and RMSNorm run in the prologue instead of a
kernel of their own (one launch, and one wait on it, less a norm): ``x`` is the block's
output, ``h = x + residual`` (rounded to the dtype) the new residual, and the product is
``rms_norm(h) @ w.T``. Each program first walks all of ``h`` for its rows' statistics (a
row, read from the caches), then its own run of K as above with each element normed as
``kernels/elementwise/norm_triton.py`` rounds it. Program ``(0, 0)`` writes ``h`` to the new
residual, never over the residual the other programs still read; where other kernels read
the normed rows too, the first column tile's programs keep them, each its run of K.

With a ``RouteTopK`` the GEMV is a mixture of experts' router, and its top-k runs in the
epilogue instead of ``route_topk`` after it: each program stores its logits and draws a
ticket, and the last one routes the rows (``kernels/moe/router_triton.route_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, split_k_target, store_split_k, tile_offsets
from kernels.moe.router_triton import MAX_EXPERTS, route_rows
from kernels.pdl import pdl_launch, wait_for_producers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # rows of x a GEMV program carries; larger batches use a GEMM


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one GEMV: output columns per program, K step, K split, warps, stages."""

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class RowNorm:
    """The residual add and RMSNorm a GEMV applies to its ``x`` first (``gemv``'s ``norm``):
    ``h = x + residual`` goes to ``residual_out`` (a tensor apart from both), and the GEMV
    multiplies ``rms_norm(h, weight, eps)``. Without a residual ``h`` is ``x``, and nothing
    is written. With ``normed_out`` the normed rows are kept there too, for other readers
    (a mixture of experts' experts, after its router)."""

    weight: torch.Tensor  # [K], the norm's, in x's dtype
    eps: float
    residual: torch.Tensor | None = None  # [M, K], last stride 1
    residual_out: torch.Tensor | None = None  # [M, K], last stride 1: h
    normed_out: torch.Tensor | None = None  # [M, K], last stride 1: the normed rows, kept


@dataclass(frozen=True)
class RouteTopK:
    """A router's top-k in its GEMV's epilogue (``gemv``'s ``route``): the program that
    finishes last softmaxes the logits, picks each row's ``top_k`` experts and stores them
    as ``route_topk`` does, one launch less than ``route_topk`` after the GEMV. ``ticket``
    counts the programs done: an int32 zero at rest (the last program sets it back), kept by
    the caller across calls."""

    top_k: int
    renormalize: bool
    weights: torch.Tensor  # [M, top_k] float32, contiguous
    ids: torch.Tensor  # [M, top_k] int32, contiguous
    ticket: torch.Tensor  # [1] int32


@triton.jit
def _mean_squares(x_ptr, res_ptr, h_ptr, offs_m, mask_m, K, stride_xm, stride_rm, stride_hm,
                  rows_h, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``mean(h^2)`` per row over all of K, in float32, ``h = x + residual`` rounded to x's
    dtype (stored for the rows below ``rows_h``: all of them in one program, else none)."""
    sum_sq = tl.zeros((offs_m.shape[0],), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask,
                          other=0.0)  # fmt: skip
            h = (h.to(tl.float32) + res.to(tl.float32)).to(h.dtype)
            store = (offs_m < rows_h)[:, None] & (offs_k < K)[None, :]
            tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], h, mask=store)
        h32 = h.to(tl.float32)
        sum_sq += tl.sum(h32 * h32, axis=1)
    return sum_sq / K


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    res_ptr,  # NORM and HAS_RESIDUAL: the residual [M, K], last stride 1
    g_ptr,  # NORM: the norm's weight [K]
    h_ptr,  # NORM and HAS_RESIDUAL: the new residual [M, K], last stride 1
    normed_ptr,  # NORM and STORE_NORMED: the normed rows [M, K], last stride 1
    topk_w_ptr,  # TOP_K: the rows' routing weights [M, TOP_K] float32
    topk_ids_ptr,  # TOP_K: their experts [M, TOP_K] int32
    ticket_ptr,  # TOP_K: the programs done, int32, zero at rest
    M,
    N,
    K,
    eps,
    stride_xm,  # x: [M, K] (or [M, 2K] with SILU_MUL), last stride 1
    stride_wn,  # w: [N, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    stride_rm,
    stride_hm,
    stride_nm,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr = False,  # x is a block's output: the residual add and RMSNorm first
    HAS_RESIDUAL: tl.constexpr = False,
    STORE_NORMED: tl.constexpr = False,
    TOP_K: tl.constexpr = 0,  # > 0: out is a router's logits, routed by the last program
    E_PAD: tl.constexpr = 1,
    K_PAD: tl.constexpr = 1,
    RENORMALIZE: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    k_start, k_per_split = k_split(pid_k, K, BLOCK_K, SPLIT_K)
    if NORM:  # the rows' statistics over all of K, as the norm kernel takes them
        rows_h = tl.where((pid_n == 0) & (pid_k == 0), M, 0)  # the first program writes h
        mean_sq = _mean_squares(x_ptr, res_ptr, h_ptr, offs_m, mask_m, K, stride_xm, stride_rm,
                                stride_hm, rows_h, HAS_RESIDUAL, BLOCK_K)  # fmt: skip
        rstd = tl.rsqrt(mean_sq + eps)[:, None]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        # 1. the weight tile [BLOCK_N, BLOCK_K]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        # 2. the activations [M_PAD, BLOCK_K]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x_mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        if NORM:  # h, normed and cast back, times the norm's weight: norm_triton's roundings
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :],
                              mask=x_mask, other=0.0)  # fmt: skip
                x = (x + res.to(tl.float32)).to(w_ptr.dtype.element_ty).to(tl.float32)
            normed = (x * rstd).to(w_ptr.dtype.element_ty).to(tl.float32)
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            x = (g * normed).to(w_ptr.dtype.element_ty).to(tl.float32)
            if STORE_NORMED:  # by the programs of the first column tile: each its run of K
                store = (offs_m < tl.where(pid_n == 0, M, 0))[:, None] & mask_k[None, :]
                tl.store(normed_ptr + offs_m[:, None] * stride_nm + offs_k[None, :],
                         x.to(normed_ptr.dtype.element_ty), mask=store)  # fmt: skip
        if SILU_MUL:  # x held the gate; the up half follows at +K, as silu_and_mul rounds
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            silu = (x / (1.0 + tl.exp(-x))).to(w_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(w_ptr.dtype.element_ty).to(tl.float32)
        # 3. acc[m, n] += x[m, :] . w[n, :]
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_mask = mask_m[:, None] & mask_n[None, :]
    store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K)
    if TOP_K > 0:  # SPLIT_K 1: the last program to finish routes the rows
        # every thread's store issued before the one thread's release (as the direct MoE
        # path's split-slot kernel); the acquire orders the last program's loads after all
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            tl.debug_barrier()
            offs_e = tl.arange(0, E_PAD)
            logits = tl.load(out_ptr + offs_m[:, None] * stride_om + offs_e[None, :],
                             mask=mask_m[:, None] & (offs_e < N)[None, :], other=-float("inf"),
                             cache_modifier=".cg")  # fmt: skip
            route_rows(logits.to(tl.float32), offs_m, mask_m, topk_w_ptr, topk_ids_ptr, N,
                       E_PAD, TOP_K, K_PAD, RENORMALIZE)  # fmt: skip
            tl.store(ticket_ptr, 0)  # for the next call: every ticket of this one is drawn


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] gate then up with silu_mul
    weight: torch.Tensor,  # [N, K]
    *,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
    norm: RowNorm | None = None,  # the residual add and RMSNorm of x first
    route: RouteTopK | None = None,  # a router's: its top-k after
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T`` (``silu(gate) * up`` first when ``silu_mul``; ``rms_norm(x +
    residual)`` first with ``norm``; the rows routed after with ``route``) for
    ``M <= MAX_ROWS``."""
    num_rows, width = x.shape
    num_cols, size_k = weight.shape
    _check(x, weight, silu_mul, width, size_k)
    if norm is not None:
        _check_norm(x, norm, silu_mul)
    cfg = config or default_config(num_cols, size_k)
    if route is not None:
        _check_route(num_rows, num_cols, route, cfg)
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    target = split_k_target(out, cfg.split_k)
    grid = (triton.cdiv(num_cols, cfg.block_n), cfg.split_k)
    residual = norm.residual if norm is not None and norm.residual is not None else x
    residual_out = norm.residual_out if norm is not None and norm.residual_out is not None else x
    normed_out = norm.normed_out if norm is not None and norm.normed_out is not None else x
    topk_w, topk_ids, ticket = (x, x, x) if route is None else (route.weights, route.ids,
                                                                 route.ticket)  # fmt: skip
    _gemv_kernel[grid](
        x, weight, target, residual, x if norm is None else norm.weight, residual_out,
        normed_out, topk_w, topk_ids, ticket, num_rows, num_cols, size_k,
        0.0 if norm is None else norm.eps,
        x.stride(0), weight.stride(0), target.stride(0), residual.stride(0),
        residual_out.stride(0), normed_out.stride(0),
        M_PAD=rows_pad(num_rows), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, SILU_MUL=silu_mul,
        EVEN_K=size_k % (cfg.block_k * cfg.split_k) == 0, NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm.residual is not None,
        STORE_NORMED=norm is not None and norm.normed_out is not None,
        TOP_K=0 if route is None else route.top_k,
        E_PAD=1 if route is None else triton.next_power_of_2(num_cols),
        K_PAD=1 if route is None else triton.next_power_of_2(route.top_k),
        RENORMALIZE=route is not None and route.renormalize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x),
    )  # fmt: skip
    if target is not out:
        out.copy_(target)
    return out


def default_config(num_cols: int, size_k: int) -> GemvConfig:
    """A launch shape with enough programs to fill an H100/H200 (132 SMs) several times."""
    block_n = 16 if num_cols >= 2048 else 8
    split_k = 1
    while triton.cdiv(num_cols, block_n) * split_k < 512 and size_k // (split_k * 2) >= 1024:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=min(512, triton.next_power_of_2(size_k)),
                      split_k=split_k)  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, width: int, size_k: int) -> None:
    expected = 2 * size_k if silu_mul else size_k
    if x.dim() != 2 or weight.dim() != 2 or width != expected:
        raise ValueError(
            f"gemv: x [M, {expected}] and weight [N, {size_k}] expected, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv: 1..{MAX_ROWS} rows, got {x.shape[0]} (use a GEMM)")
    if x.dtype != weight.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gemv: x and weight in one of {SUPPORTED_DTYPES}, got {x.dtype}, "
                         f"{weight.dtype}")  # fmt: skip
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv: x and weight need a contiguous last dimension")


def _check_norm(x: torch.Tensor, norm: RowNorm, silu_mul: bool) -> None:
    """A ``RowNorm`` fits ``x [M, K]``: a weight of K in x's dtype, a residual and a new
    residual of x's shape together or neither, what it writes apart from what it reads."""
    if silu_mul:
        raise ValueError("gemv: a norm and silu_mul do not combine")
    if norm.weight.shape != (x.shape[1],) or norm.weight.dtype != x.dtype:
        raise ValueError(f"gemv: a norm weight [{x.shape[1]}] in {x.dtype} expected, got "
                         f"{tuple(norm.weight.shape)} in {norm.weight.dtype}")  # fmt: skip
    if (norm.residual is None) != (norm.residual_out is None):
        raise ValueError("gemv: a norm's residual and residual_out come together")
    for name in ("residual", "residual_out", "normed_out"):
        rows = getattr(norm, name)
        if rows is not None and (rows.shape != x.shape or rows.dtype != x.dtype
                                 or rows.stride(-1) != 1):  # fmt: skip
            raise ValueError(f"gemv: the norm's {name} must be like x {tuple(x.shape)} "
                             f"{x.dtype} with last stride 1, got {tuple(rows.shape)}")  # fmt: skip
    read = {x.data_ptr()} | ({norm.residual.data_ptr()} if norm.residual is not None else set())
    for rows in (norm.residual_out, norm.normed_out):
        if rows is not None and rows.data_ptr() in read:
            raise ValueError("gemv: the new residual and the normed rows cannot overwrite x "
                             "or the residual (other programs still read them)")  # fmt: skip


def _check_route(num_rows: int, num_cols: int, route: RouteTopK, config: GemvConfig) -> None:
    """A router's top-k fits: logits of at most ``MAX_EXPERTS`` experts, whole in each row's
    program set (no K split), and outputs of ``[M, top_k]``."""
    if config.split_k != 1:
        raise ValueError(f"gemv: a router's top-k needs whole sums (split_k 1), got {config}")
    if not 1 <= route.top_k <= num_cols <= MAX_EXPERTS:
        raise ValueError(f"gemv: need 1 <= top_k {route.top_k} <= experts {num_cols} <= "
                         f"{MAX_EXPERTS}")  # fmt: skip
    shape = (num_rows, route.top_k)
    if (route.weights.shape, route.weights.dtype, route.ids.shape, route.ids.dtype) != (
        shape,
        torch.float32,
        shape,
        torch.int32,
    ) or not (route.weights.is_contiguous() and route.ids.is_contiguous()):
        raise ValueError(f"gemv: routing outputs of {shape} (float32 weights, int32 ids), "
                         "contiguous")  # fmt: skip
    if route.ticket.numel() != 1 or route.ticket.dtype != torch.int32:
        raise ValueError("gemv: a router's ticket is one int32")
