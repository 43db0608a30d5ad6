# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Quantized weights dequantized element by element: the GEMM, and a GEMV for every format.

``weight_tile`` turns element coordinates ``(n, k)`` (any broadcastable shapes) into float32
weights for every format, from ggml's per-block layout (the planes of quant.py). Two kernels
here use it, and quant_dequant_triton.py writes its tiles out as a float weight:

* GEMV (``M <= MAX_GEMV_ROWS``, decode): a program owns ``BLOCK_N`` output columns for all
  rows of ``x`` and walks ``K`` (optionally split over programs that add fp32 partial sums
  atomically); memory-bound, it streams the planes once. q8_0, q4_0, q4_1 and fp8 take
  quant_gemv_blocked_triton.py instead, which applies each block's scale once to a block sum,
  and q4_k/q6_k quant_gemv_kquant_triton.py, which loads their super-blocks in contiguous
  groups (``QuantMatmulConfig.blocked``; off, every format dequantizes element by element
  here).
* GEMM (prefill): ``BLOCK_M x BLOCK_N`` output tiles; each ``K`` step dequantizes a
  ``[BLOCK_K, BLOCK_N]`` weight tile into the activation dtype and feeds ``tl.dot``. From
  ``DEQUANT_GEMM_MIN_ROWS`` rows up, engine/quant/linear.py dequantizes the whole weight once
  and calls cuBLAS instead (quant_dequant_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, store_split_k, tile_offsets
from kernels.linear.quant import QuantFormat
from kernels.linear.quant_gemv_kquant_triton import _q4_k_scale_min
from kernels.pdl import pdl_launch, wait_for_producers

# -- dequantizing a tile ----------------------------------------------------------------------


@triton.jit
def weight_tile(p0, p1, p2, p3, s0, s1, s2, s3, n, k, mask, FORMAT: tl.constexpr):
    """float32 weights at rows ``n``, columns ``k`` (broadcast together); planes in the order
    of quant.py's FORMATS, ``s*`` their row strides."""
    if FORMAT == 0:  # q8_0: d, qs
        d = tl.load(p0 + n * s0 + k // 32, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(p1 + n * s1 + k, mask=mask, other=0).to(tl.float32)
        w = q * d
    elif FORMAT <= 2:  # q4_0: d, qs / q4_1: d, qs, m
        block = k // 32
        d = tl.load(p0 + n * s0 + block, mask=mask, other=0.0).to(tl.float32)
        byte = tl.load(p1 + n * s1 + block * 16 + k % 16, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((k % 32) // 16 * 4)) & 0xF).to(tl.float32)
        if FORMAT == 1:
            w = (q - 8.0) * d
        else:
            w = q * d + tl.load(p2 + n * s2 + block, mask=mask, other=0.0).to(tl.float32)
    elif FORMAT == 3:  # q4_k: d, dmin, scales, qs
        w = _q4_k_tile(p0, p1, p2, p3, s0, s1, s2, s3, n, k, mask)
    elif FORMAT == 4:  # q6_k: d, scales, ql, qh
        w = _q6_k_tile(p0, p1, p2, p3, s0, s1, s2, s3, n, k, mask)
    else:  # fp8: w, scale
        q = tl.load(p0 + n * s0 + k, mask=mask, other=0.0).to(tl.float32)
        w = q * tl.load(p1 + n * s1 + k * 0, mask=mask, other=0.0)  # the row's scale
    return w


@triton.jit
def _q4_k_tile(p0, p1, p2, p3, s0, s1, s2, s3, n, k, mask):
    sblock = k // 256
    e = k % 256
    sub = e // 32  # 8 sub-blocks of 32, each with a 6-bit scale and min
    sc, mn = _q4_k_scale_min(p2 + n * s2 + sblock * 12, sub, mask)
    d = tl.load(p0 + n * s0 + sblock, mask=mask, other=0.0).to(tl.float32)
    dmin = tl.load(p1 + n * s1 + sblock, mask=mask, other=0.0).to(tl.float32)
    # each 64 elements are 32 bytes: element e's nibble is in byte 32 (e // 64) + e % 32
    byte = tl.load(p3 + n * s3 + sblock * 128 + (e // 64) * 32 + e % 32, mask=mask, other=0)
    q = ((byte.to(tl.int32) >> (sub % 2 * 4)) & 0xF).to(tl.float32)
    return d * sc * q - dmin * mn


@triton.jit
def _q6_k_tile(p0, p1, p2, p3, s0, s1, s2, s3, n, k, mask):
    sblock = k // 256
    e = k % 256
    half = e // 128  # e = 128 half + 32 quarter + lane
    quarter = (e % 128) // 32
    lane = e % 32
    low = tl.load(p2 + n * s2 + sblock * 128 + half * 64 + (quarter % 2) * 32 + lane, mask=mask,
                  other=0).to(tl.int32)  # fmt: skip
    high = tl.load(p3 + n * s3 + sblock * 64 + half * 32 + lane, mask=mask, other=0).to(tl.int32)
    q = ((low >> (quarter // 2 * 4)) & 0xF) | (((high >> (quarter * 2)) & 3) << 4)
    d = tl.load(p0 + n * s0 + sblock, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(p1 + n * s1 + k // 16, mask=mask, other=0).to(tl.float32)
    return d * scale * (q - 32).to(tl.float32)


# -- kernels ----------------------------------------------------------------------------------


@triton.jit
def _quant_gemv_kernel(
    x_ptr, out_ptr, p0, p1, p2, p3, s0, s1, s2, s3,
    M, N, K,
    stride_xm,  # x: [M, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    FORMAT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
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
        # 1. the dequantized weight tile [BLOCK_N, BLOCK_K]
        w_mask = mask_n[:, None] & mask_k[None, :]
        w = weight_tile(p0, p1, p2, p3, s0, s1, s2, s3, offs_n[:, None], offs_k[None, :],
                         w_mask, FORMAT)  # fmt: skip
        # 2. the activations [M_PAD, BLOCK_K]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        # 3. acc[m, n] += x[m, :] . w[n, :]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out_mask = mask_m[:, None] & mask_n[None, :]
    store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K)


@triton.jit
def _quant_gemm_kernel(
    x_ptr, out_ptr, p0, p1, p2, p3, s0, s1, s2, s3,
    M, N, K,
    stride_xm,  # x: [M, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, mask_m = tile_offsets(pid_m, BLOCK_M, M)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # the weight tile transposed, [BLOCK_K, BLOCK_N], rounded to x's dtype for the dot
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = weight_tile(p0, p1, p2, p3, s0, s1, s2, s3, offs_n[None, :], offs_k[:, None],
                         w_mask, FORMAT).to(x.dtype)  # fmt: skip
        if IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# -- launchers --------------------------------------------------------------------------------


def quant_gemv_elementwise(
    x: torch.Tensor,  # [M, K], M <= 8
    out: torch.Tensor,  # [M, N] (fp32 and zeroed when split_k > 1)
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # four, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = x @ dequantize(w).T`` for any format, every weight dequantized on its own."""
    num_cols = planes[0].shape[0]
    grid = (triton.cdiv(num_cols, block_n), split_k)
    _quant_gemv_kernel[grid](
        x, out, *planes, *(p.stride(0) for p in planes), x.shape[0], num_cols, size_k,
        x.stride(0), out.stride(0), FORMAT=fmt.kernel_id,
        M_PAD=rows_pad(x.shape[0]), BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x),
    )  # fmt: skip


def quant_gemm(
    x: torch.Tensor,  # [M, K]
    out: torch.Tensor,  # [M, N] in x's dtype
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # four, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = x @ dequantize(w).T`` in ``block_m x block_n`` tiles on ``tl.dot``."""
    num_rows, num_cols = x.shape[0], planes[0].shape[0]
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
    _quant_gemm_kernel[grid](
        x, out, *planes, *(p.stride(0) for p in planes), num_rows, num_cols, size_k,
        x.stride(0), out.stride(0), FORMAT=fmt.kernel_id, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, IEEE_FP32=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
