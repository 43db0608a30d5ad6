# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Small-batch matmul for q4_0, q4_1 and q8_0 weights on tensor cores, the weights kept packed.

Decode batches of a few to a few hundred rows stream the packed bytes, but a GEMV on CUDA
cores spends an FMA per weight *per row*: at 8 rows q4_0 ran 2.6x slower than bf16 cuBLAS.
Here the tile is transposed (``out^T = w @ x^T``: the weight is the dot's tall side, the
batch its narrow one, padded to 16), and two facts keep the weight's conversion cheap:

* a 4-bit quant ``q`` becomes a 16-bit float with integer logic only: ``q | 0x4300`` is the
  bfloat16 ``128 + q`` (fp16: ``q | 0x6400`` is ``1024 + q``), exact, with no ``I2F``
  (a quarter of the FMA rate on Hopper);
* a block's 16 bytes hold elements 0..15 in their low nibbles and 16..31 in their high ones
  (ggml's order), so the low nibbles meet ``x[0:16]`` of each block and the high nibbles
  ``x[16:32]``: two dots, no shuffle of the quants.

Each weight ``d * (q - 8)`` (q4_0), ``d * q + m`` (q4_1) or ``d * q`` (q8_0) is formed in
fp32 and rounded once to the activations' dtype, the bits quant_dequant_triton.py
writes for cuBLAS, and one dot per nibble half spans the K step's blocks. (A variant that ran
one dot per block on the bare ``magic + q`` and scaled its fp32 result was exact, 1.1-2.3x
slower for q4_0 from 16 to 144 rows and 1-9% faster for q8_0, and its
weights were not the dequantize path's bits: the sweep,
quant-kernels-mma-sweep-llama3-8b-h100.json, has its timings; its note says which keys.)

``SPLIT_K > 1`` stores each split's fp32 partial sums in a plane of its own, which the
launcher adds in a fixed order: narrow weights (o_proj, down) need the split to fill the GPU
(down 1.2-1.9x faster at 16-96 rows), and a step's tokens must not depend on the order in
which atomic additions land.
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
from kernels.linear.quant import QK, QuantFormat
from kernels.pdl import pdl_launch, wait_for_producers

MMA_FORMATS = ("q8_0", "q4_0", "q4_1")
MMA_DTYPES = (torch.bfloat16, torch.float16)
MIN_BLOCK_M = 16  # the dot's narrow side
MAX_BLOCK_M = 128
# 16-bit float bits whose low mantissa bits take a 4-bit q: (bits, the float at q = 0)
MAGIC_FLOATS = {torch.bfloat16: (0x4300, 128), torch.float16: (0x6400, 1024)}


def mma_block_m(num_rows: int) -> int:
    """The row tile that holds a batch of ``num_rows``: a power of two, 16 to 128."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(num_rows)))


@triton.jit
def _quant_mma_kernel(
    x_ptr, out_ptr, p0, p1, p2, s0, s1, s2,
    M, N, K,
    stride_xm,  # x: [M, K], last stride 1
    stride_om,  # out: [M, N] (a plane of [SPLIT_K, M, N] when split), last stride 1
    stride_split,  # between the planes of the K splits
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """A program: ``out^T[BLOCK_N, BLOCK_M]`` over its split of K, BLOCKS blocks a step,
    each step one dot of the low nibbles and one of the high ones into ``acc``."""
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m, mask_m = tile_offsets(pid_m, BLOCK_M, M)
    offs_16 = tl.arange(0, 16)
    # the K step's elements in dot order: block b's first (or second) 16 elements
    half_k = (tl.arange(0, BLOCKS * 16) // 16) * 32 + tl.arange(0, BLOCKS * 16) % 16
    num_blocks = K // 32
    first_block, blocks_per_split = k_split(pid_k, num_blocks, BLOCKS, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for b0 in range(first_block, first_block + blocks_per_split, BLOCKS):
        blk = b0 + tl.arange(0, BLOCKS)
        mask_nb = mask_n[:, None] & (blk < num_blocks)[None, :]  # [BLOCK_N, BLOCKS]
        mask_k = (b0 * 32 + half_k) < K
        x_base = x_ptr + offs_m[None, :] * stride_xm + b0 * 32 + half_k[:, None]
        x_mask = mask_k[:, None] & mask_m[None, :]
        x_lo = tl.load(x_base, mask=x_mask, other=0.0)  # [BLOCKS * 16, BLOCK_M]
        x_hi = tl.load(x_base + 16, mask=x_mask, other=0.0)
        d = tl.load(p0 + offs_n[:, None] * s0 + blk[None, :], mask=mask_nb, other=0.0)
        d = d.to(tl.float32)[:, :, None]  # [BLOCK_N, BLOCKS, 1]
        mask_3d = mask_nb[:, :, None]
        if FORMAT == 0:  # q8_0
            q_base = p1 + offs_n[:, None, None] * s1 + blk[None, :, None] * 32 + offs_16
            w_lo = tl.load(q_base, mask=mask_3d, other=0).to(tl.float32) * d
            w_hi = tl.load(q_base + 16, mask=mask_3d, other=0).to(tl.float32) * d
        else:
            q_base = p1 + offs_n[:, None, None] * s1 + blk[None, :, None] * 16 + offs_16
            byte = tl.load(q_base, mask=mask_3d, other=0).to(tl.int16)
            lo = ((byte & 0xF) | MAGIC).to(x_lo.dtype, bitcast=True).to(tl.float32)
            hi = ((byte >> 4) | MAGIC).to(x_lo.dtype, bitcast=True).to(tl.float32)
            if FORMAT == 1:
                w_lo = (lo - (OFFSET + 8.0)) * d
                w_hi = (hi - (OFFSET + 8.0)) * d
            else:
                mins = tl.load(p2 + offs_n[:, None] * s2 + blk[None, :], mask=mask_nb, other=0.0)
                mins = mins.to(tl.float32)[:, :, None]
                w_lo = (lo - OFFSET) * d + mins
                w_hi = (hi - OFFSET) * d + mins
        w_lo = tl.reshape(w_lo.to(x_lo.dtype), (BLOCK_N, BLOCKS * 16))
        w_hi = tl.reshape(w_hi.to(x_lo.dtype), (BLOCK_N, BLOCKS * 16))
        if DOT_FP32:  # the interpreter's 16-bit dot multiplies raw bits (Triton 3.9)
            acc += tl.dot(w_lo.to(tl.float32), x_lo.to(tl.float32), input_precision="ieee")
            acc += tl.dot(w_hi.to(tl.float32), x_hi.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w_lo, x_lo, acc)
            acc = tl.dot(w_hi, x_hi, acc)
    store_split_k_plane(
        out_ptr, acc, pid_k, offs_n, mask_n, offs_m, mask_m, stride_om, stride_split
    )


def quant_mma(
    x: torch.Tensor,  # [M, K] in bf16 or fp16
    out: torch.Tensor,  # [M, N]
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # three, in kernel order, padded by plane_arguments
    size_k: int,
    *,
    block_m: int,
    block_n: int,
    blocks: int,  # 32-element blocks per K step
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = x @ dequantize(w).T`` for a format of MMA_FORMATS on tensor cores."""
    if fmt.name not in MMA_FORMATS or size_k % QK:
        raise ValueError(f"quant_mma: {fmt.name} with K={size_k} has no tensor-core path")
    if x.dtype not in MMA_DTYPES:
        raise ValueError(f"quant_mma: x in one of {MMA_DTYPES}, got {x.dtype}")
    if block_m < MIN_BLOCK_M:
        raise ValueError(f"quant_mma: block_m {block_m} < {MIN_BLOCK_M}")
    magic, offset = MAGIC_FLOATS[x.dtype]
    num_cols = planes[0].shape[0]
    num_rows = x.shape[0]
    grid = (triton.cdiv(num_cols, block_n), triton.cdiv(num_rows, block_m), split_k)
    target = split_k_planes(out, split_k)
    _quant_mma_kernel[grid](
        x, target, *planes, *(p.stride(0) for p in planes), num_rows, num_cols, size_k,
        x.stride(0), *plane_strides(target),
        FORMAT=fmt.kernel_id, BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS=blocks, SPLIT_K=split_k,
        MAGIC=magic, OFFSET=float(offset), DOT_FP32=x.device.type == "cpu",
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x),
    )  # fmt: skip
    add_split_k_planes(out, target)
