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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, split_k_target, store_split_k, tile_offsets
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


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,  # x: [M, K] (or [M, 2K] with SILU_MUL), last stride 1
    stride_wn,  # w: [N, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    k_start, k_per_split = k_split(pid_k, K, BLOCK_K, SPLIT_K)
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
        if SILU_MUL:  # x held the gate; the up half follows at +K, as silu_and_mul rounds
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            silu = (x / (1.0 + tl.exp(-x))).to(w_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(w_ptr.dtype.element_ty).to(tl.float32)
        # 3. acc[m, n] += x[m, :] . w[n, :]
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_mask = mask_m[:, None] & mask_n[None, :]
    store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K)


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] gate then up with silu_mul
    weight: torch.Tensor,  # [N, K]
    *,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T`` (``silu(gate) * up`` first when ``silu_mul``) for ``M <= MAX_ROWS``."""
    num_rows, width = x.shape
    num_cols, size_k = weight.shape
    _check(x, weight, silu_mul, width, size_k)
    cfg = config or default_config(num_cols, size_k)
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    target = split_k_target(out, cfg.split_k)
    grid = (triton.cdiv(num_cols, cfg.block_n), cfg.split_k)
    _gemv_kernel[grid](
        x, weight, target, num_rows, num_cols, size_k,
        x.stride(0), weight.stride(0), target.stride(0),
        M_PAD=rows_pad(num_rows), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, SILU_MUL=silu_mul,
        EVEN_K=size_k % (cfg.block_k * cfg.split_k) == 0,
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
