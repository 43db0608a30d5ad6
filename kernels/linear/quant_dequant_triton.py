# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""A packed weight dequantized into a float buffer, then a dense cuBLAS matmul.

The GEMM of quant_gemm_triton.py dequantizes each weight tile once per row tile,
inside the ``tl.dot`` loop; with many rows (large decode batches, prefill) that work and the
untuned tiles cost more than the packed bytes save. Here the weight is written out once as
``[N, K]`` in the activations' dtype and multiplied by cuBLAS: the dequantization (reading the
planes, writing 2 bytes a weight) is paid once per step and spread over all its rows.

The buffer holds exactly ``dequantize(fmt, planes).to(dtype)``: float32 products in the
reference's order, FMA contraction off, one rounding to the buffer's dtype. Two kernels:

* q8_0, q4_0 and q4_1 (``BLOCKED_FORMATS``) load a tile as ``[rows, blocks, 16]`` bytes, one
  scale per block, and store each block's two 16-element halves (a 4-bit block's low nibbles
  are its elements 0..15, its high nibbles 16..31): the bytes are read once, in 16-byte runs,
  and every store is a contiguous run of 16 elements;
* the other formats go element by element through ``weight_tile``, the helper the GEMV and
  GEMM share, which decodes every format's block fields (each 4-bit byte loaded twice, a
  scale per element).

The blocked kernel is what a large decode batch waits on. H100, llama3-8b's linears into bf16
(quant-kernels-dequant-llama3-8b-h100.json): gate_up (117 M weights, 301 MB moved) in q4_0
107 us, 0.94 of the copy bandwidth, where the element-wise kernel took 262
(quant-kernels-defaults-llama3-8b-h100.json); every weight 0.87-0.96 of it. A layer's four
linears in q4_0 202 us against 496 (q8_0 239 / 507, q4_1 207 / 913).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.linear.common import linear_out, tile_offsets
from kernels.linear.gemv_triton import SUPPORTED_DTYPES
from kernels.linear.quant import QuantFormat
from kernels.linear.quant_gemm_triton import weight_tile
from kernels.linear.quant_matmul_triton import plane_arguments

DEQUANT_BLOCK_N = 16  # output rows of the weight per program
DEQUANT_BLOCK_K = 256  # columns per program: a 512-byte bf16 store per row
BLOCKED_FORMATS = ("q8_0", "q4_0", "q4_1")
# the blocked kernel's launch shape: weight rows, 32-element blocks per row, warps. Long rows
# win: of bench.quant_kernels' DEQUANT_GRID (2x64 to 16x8 blocks) this was the fastest on 13
# of llama3-8b's 15 weights in the three formats, within 1% on the other two; 16x8 (the
# element-wise kernel's tile) 4-16% slower (quant-kernels-dequant-llama3-8b-h100.json)
BLOCKED_SHAPE = (2, 64, 4)


@triton.jit
def _dequantize_blocked_kernel(
    out_ptr, p0, p1, p2, s0, s1, s2,
    N, K,
    stride_on,  # out: [N, K], last stride 1
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """A program: ``BLOCK_N`` rows by ``BLOCKS`` 32-element blocks of q8_0 (0), q4_0 (1) or
    q4_1 (2), written as two ``[BLOCK_N, BLOCKS, 16]`` halves."""
    offs_n, mask_n = tile_offsets(tl.program_id(0), BLOCK_N, N)
    blk, mask_b = tile_offsets(tl.program_id(1), BLOCKS, K // 32)
    mask_nb = mask_n[:, None] & mask_b[None, :]  # [BLOCK_N, BLOCKS]
    mask = mask_nb[:, :, None]
    rows = offs_n[:, None, None]
    offs_16 = tl.arange(0, 16)[None, None, :]
    d = tl.load(p0 + offs_n[:, None] * s0 + blk[None, :], mask=mask_nb, other=0.0)
    d = d.to(tl.float32)[:, :, None]
    if FORMAT == 0:  # q8_0: d, qs
        q_ptrs = p1 + rows * s1 + blk[None, :, None] * 32 + offs_16
        lo = tl.load(q_ptrs, mask=mask, other=0).to(tl.float32) * d
        hi = tl.load(q_ptrs + 16, mask=mask, other=0).to(tl.float32) * d
    else:  # q4_0: d, qs / q4_1: d, qs, m
        byte = tl.load(p1 + rows * s1 + blk[None, :, None] * 16 + offs_16, mask=mask, other=0)
        byte = byte.to(tl.int32)
        q_lo = (byte & 0xF).to(tl.float32)
        q_hi = (byte >> 4).to(tl.float32)
        if FORMAT == 1:
            lo = (q_lo - 8.0) * d
            hi = (q_hi - 8.0) * d
        else:
            m = tl.load(p2 + offs_n[:, None] * s2 + blk[None, :], mask=mask_nb, other=0.0)
            m = m.to(tl.float32)[:, :, None]
            lo = q_lo * d + m
            hi = q_hi * d + m
    out_ptrs = out_ptr + rows * stride_on + blk[None, :, None] * 32 + offs_16
    tl.store(out_ptrs, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + 16, hi.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    out_ptr, p0, p1, p2, p3, s0, s1, s2, s3,
    N, K,
    stride_on,  # out: [N, K], last stride 1
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n, mask_n = tile_offsets(tl.program_id(0), BLOCK_N, N)
    offs_k, mask_k = tile_offsets(tl.program_id(1), BLOCK_K, K)
    mask = mask_n[:, None] & mask_k[None, :]
    w = weight_tile(p0, p1, p2, p3, s0, s1, s2, s3, offs_n[:, None], offs_k[None, :], mask,
                    FORMAT)  # fmt: skip
    out_ptrs = out_ptr + offs_n[:, None] * stride_on + offs_k[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_into(
    fmt: QuantFormat,
    planes: dict[str, torch.Tensor],  # the weight's planes, each [N, ...]
    out: torch.Tensor,  # [N, K] float16/bfloat16/float32, last stride 1
    *,
    shape: tuple[int, int, int] = BLOCKED_SHAPE,  # the blocked kernel's (rows, blocks, warps)
) -> torch.Tensor:  # out
    """Write ``dequantize(fmt, planes).to(out.dtype)`` into ``out``, bit for bit."""
    pointers = plane_arguments(fmt, planes)
    num_cols, size_k = out.shape
    if pointers[0].shape[0] != num_cols or out.stride(-1) != 1:
        raise ValueError(
            f"dequantize_into: out [{pointers[0].shape[0]}, K] with a contiguous last "
            f"dimension expected, got {tuple(out.shape)} strides {out.stride()}"
        )
    if out.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dequantize_into: out in one of {SUPPORTED_DTYPES}, got {out.dtype}")
    if fmt.name in BLOCKED_FORMATS:
        block_n, blocks, warps = shape
        grid = (triton.cdiv(num_cols, block_n), triton.cdiv(size_k // 32, blocks))
        _dequantize_blocked_kernel[grid](
            out, *pointers[:3], *(p.stride(0) for p in pointers[:3]), num_cols, size_k,
            out.stride(0), FORMAT=fmt.kernel_id, BLOCK_N=block_n, BLOCKS=blocks,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
        return out
    grid = (triton.cdiv(num_cols, DEQUANT_BLOCK_N), triton.cdiv(size_k, DEQUANT_BLOCK_K))
    _dequantize_kernel[grid](
        out, *pointers, *(p.stride(0) for p in pointers), num_cols, size_k, out.stride(0),
        FORMAT=fmt.kernel_id, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K,
        enable_fp_fusion=False,  # d * q + m rounded twice, as the torch reference does
    )  # fmt: skip
    return out


def dequant_matmul(
    x: torch.Tensor,  # [M, K]
    fmt: QuantFormat,
    planes: dict[str, torch.Tensor],  # the weight's planes, each [N, ...]
    scratch: torch.Tensor,  # flat, x's dtype: room for the weight (or a slice of its rows)
    *,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, last stride 1
) -> torch.Tensor:  # [M, N]
    """``F.linear(x, dequantize(fmt, planes), bias)`` through ``scratch`` and cuBLAS.

    A weight larger than ``scratch`` (an LM head beside the decoder's linears) is taken in
    slices of whole output rows, each multiplied into its columns of ``out``.
    """
    num_rows, size_k = x.shape
    num_cols = next(iter(planes.values())).shape[0]
    chunk_rows = min(scratch.numel() // size_k, num_cols)
    if chunk_rows == 0 or scratch.dtype != x.dtype:
        raise ValueError(
            f"dequant_matmul: scratch of {scratch.numel()} {scratch.dtype} cannot hold a row "
            f"of {size_k} {x.dtype}"
        )
    if chunk_rows == num_cols:  # the usual case: one slice, bias fused into cuBLAS
        weight = dequantize_into(fmt, planes, scratch[: num_cols * size_k].view(num_cols, -1))
        return F.linear(x, weight, bias) if out is None else linear_out(x, weight, bias, out)
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    for start in range(0, num_cols, chunk_rows):
        end = min(start + chunk_rows, num_cols)
        part = {name: plane[start:end] for name, plane in planes.items()}
        weight = dequantize_into(fmt, part, scratch[: (end - start) * size_k].view(end - start, -1))
        torch.mm(x, weight.t(), out=out[:, start:end])  # row stride N: cuBLAS's leading dim
    return out if bias is None else out.add_(bias)
