# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Small-batch W8A8 matmul for fp8 weights on fp8 tensor cores: ``out = x @ w.T``.

Decode batches of a few dozen rows are memory-bound: the weight's bytes are the step's cost.
``torch._scaled_mm`` multiplies the same operands but its kernels are tuned for large M; at
3-16 rows it ran at 0.35-0.43 of the weight's streaming limit on llama3-8b's qkv and o (H100)
and slower than bf16 cuBLAS on down_proj (K = 14,336). Here, as in quant_mma_triton.py,
the tile is transposed (``out^T = w @ x^T``: the weight the dot's tall side, the batch its
narrow one, padded to 16); a K split (possible, not the default: long K steps filled the
GPU better) stores a plane per split that the launcher adds in a fixed order.

The activations are rounded as ``torch._scaled_mm``'s path rounds them
(fp8_rows_triton.py: e4m3 with a scale per row); the dot multiplies e4m3 by e4m3
into fp32 and the epilogue applies both scales, so the product is the same W8A8 one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import (
    add_split_k_planes,
    k_split,
    plane_strides,
    split_k_planes,
    store_split_k_plane,
    tile_offsets,
)
from kernels.linear.fp8_rows_triton import quantize_rows_fp8_triton
from kernels.linear.quant_mma_triton import MIN_BLOCK_M
from kernels.pdl import pdl_launch, wait_for_producers


@triton.jit
def _fp8_mma_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
    M, N, K,
    stride_xm,  # x: [M, K] e4m3, last stride 1
    stride_wn,  # w: [N, K] e4m3, last stride 1
    stride_om,  # out: [M, N] (a plane of [SPLIT_K, M, N] when split), last stride 1
    stride_split,  # between the planes of the K splits
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A program: ``out^T[BLOCK_N, BLOCK_M]`` over its split of K."""
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m, mask_m = tile_offsets(pid_m, BLOCK_M, M)
    offs_k = tl.arange(0, BLOCK_K)
    k_start, k_per_split = k_split(pid_k, K, BLOCK_K, SPLIT_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    # 1. the split's K steps: e4m3 weight [BLOCK_N, BLOCK_K] times e4m3 x^T [BLOCK_K, BLOCK_M]
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if DOT_FP32:  # the interpreter: the same products in fp32
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    # 2. both scales: the weight's per output channel, x's per row
    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    store_split_k_plane(
        out_ptr, acc, pid_k, offs_n, mask_n, offs_m, mask_m, stride_om, stride_split
    )


def fp8_mma(
    x: torch.Tensor,  # [M, K] in bf16, fp16 or fp32
    out: torch.Tensor,  # [M, N]
    planes: dict[str, torch.Tensor],  # fp8's: w [N, K] e4m3, scale [N, 1] float32
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = round_e4m3(x) @ w.T``, both scales applied (the W8A8 product)."""
    if block_m < MIN_BLOCK_M:
        raise ValueError(f"fp8_mma: block_m {block_m} < {MIN_BLOCK_M}")
    w, w_scale = planes["w"], planes["scale"]
    num_rows, num_cols = x.shape[0], w.shape[0]
    x_fp8, x_scale = quantize_rows_fp8_triton(x)
    grid = (triton.cdiv(num_cols, block_n), triton.cdiv(num_rows, block_m), split_k)
    target = split_k_planes(out, split_k)
    _fp8_mma_kernel[grid](
        x_fp8, x_scale, w, w_scale, target, num_rows, num_cols, x.shape[1],
        x_fp8.stride(0), w.stride(0), *plane_strides(target),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_FP32=x.device.type == "cpu", num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x),
    )  # fmt: skip
    add_split_k_planes(out, target)
