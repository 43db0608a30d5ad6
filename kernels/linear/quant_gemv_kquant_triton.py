# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Decode GEMV for q4_k and q6_k weights, walking their super-blocks in contiguous groups.

The element-wise GEMV (quant_gemm_triton.py) computes every weight's byte address
on its own, which scatters the loads. Here a program loads whole groups of a super-block as
``[BLOCK_N, GROUPS, W]`` tiles of contiguous bytes:

* q4_k: a group is 64 elements = 32 bytes of ``qs``: low nibbles are sub-block ``2c``, high
  nibbles sub-block ``2c + 1``. Each sub-block's 6-bit scale and min are decoded once per
  group and applied to the group's sums: ``d sc sum(q x) - dmin mn sum(x)``.
* q6_k: a group is half a super-block, 128 elements = 64 bytes of ``ql`` (low nibbles are
  elements ``t``, high nibbles ``64 + t``) and 32 bytes of ``qh`` (2 bits each, shifted by
  the element's quarter). The int8 scales change every 16 elements: the tile is split into
  runs of 16, each run's sum scaled once.

``SPLIT_K > 1`` adds fp32 partial sums atomically into a zeroed buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import k_split, rows_pad, store_split_k, tile_offsets
from kernels.linear.quant import QK_K, QuantFormat
from kernels.pdl import pdl_launch, wait_for_producers

KQUANT_FORMATS = {"q4_k": 64, "q6_k": 128}  # format -> elements of a group


@triton.jit
def _q4_k_scale_min(scales_row, sub, mask):
    """The 6-bit scale and min of sub-blocks ``sub`` (0..7) of the super-blocks at
    ``scales_row`` (quant.py: q4_k_scales_mins spells out the packing)."""
    a = tl.load(scales_row + sub % 4, mask=mask, other=0).to(tl.int32)
    b = tl.load(scales_row + sub % 4 + 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(scales_row + sub % 4 + 8, mask=mask, other=0).to(tl.int32)
    low_half = sub < 4
    sc = tl.where(low_half, a & 63, (c & 0xF) | ((a >> 6) << 4)).to(tl.float32)
    mn = tl.where(low_half, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
    return sc, mn


@triton.jit
def _q4_k_group_sums(x_ptr, p0, p1, p2, p3, s0, s1, s2, s3, offs_n, N, grp, mask_g, m, M,
                     stride_xm):  # fmt: skip
    """Row ``m`` of x against 64-element groups ``grp``: [BLOCK_N, GROUPS] partial sums."""
    lanes = tl.arange(0, 32)
    rows = offs_n[:, None]
    mask_ng = (offs_n < N)[:, None] & mask_g[None, :]
    byte = tl.load(p3 + rows[:, :, None] * s3 + grp[None, :, None] * 32 + lanes[None, None, :],
                   mask=mask_ng[:, :, None], other=0).to(tl.int32)  # fmt: skip
    x_mask = (mask_g & (grp * 0 + m < M))[:, None]  # padding rows of x read nothing
    x_row = x_ptr + m * stride_xm + grp[:, None] * 64 + lanes[None, :]
    x_lo = tl.load(x_row, mask=x_mask, other=0.0).to(tl.float32)  # [GROUPS, 32]
    x_hi = tl.load(x_row + 32, mask=x_mask, other=0.0).to(tl.float32)
    sum_lo = tl.sum((byte & 0xF).to(tl.float32) * x_lo[None, :, :], axis=2)
    sum_hi = tl.sum((byte >> 4).to(tl.float32) * x_hi[None, :, :], axis=2)
    sblock = grp // 4
    scales_row = p2 + rows * s2 + sblock[None, :] * 12
    sub = (grp % 4) * 2
    sc_lo, mn_lo = _q4_k_scale_min(scales_row, sub[None, :], mask_ng)
    sc_hi, mn_hi = _q4_k_scale_min(scales_row, sub[None, :] + 1, mask_ng)
    d = tl.load(p0 + rows * s0 + sblock[None, :], mask=mask_ng, other=0.0).to(tl.float32)
    dmin = tl.load(p1 + rows * s1 + sblock[None, :], mask=mask_ng, other=0.0).to(tl.float32)
    x_sum_lo = tl.sum(x_lo, axis=1)[None, :]
    x_sum_hi = tl.sum(x_hi, axis=1)[None, :]
    return d * (sc_lo * sum_lo + sc_hi * sum_hi) - dmin * (mn_lo * x_sum_lo + mn_hi * x_sum_hi)


@triton.jit
def _q6_k_group_sums(x_ptr, p0, p1, p2, p3, s0, s1, s2, s3, offs_n, N, g0, num_groups, m, M,
                     stride_xm, GROUPS: tl.constexpr):  # fmt: skip
    """Row ``m`` of x against the 128-element groups (half super-blocks) ``g0 + [0, GROUPS)``.

    A group's elements ``16 s + u`` (s < 4) take the low nibbles of its 64 ``ql`` bytes and
    ``64 + 16 s + u`` the high ones; each run of 16 has one int8 scale, applied to its sum.
    The tile axis ``j`` runs over (group, s): [BLOCK_N, GROUPS * 4, 16].
    """
    lanes = tl.arange(0, 16)
    j = tl.arange(0, 4 * GROUPS)
    group = g0 + j // 4
    run = j % 4
    mask_j = group < num_groups
    rows = offs_n[:, None, None]
    mask_nj = (offs_n < N)[:, None] & mask_j[None, :]
    mask_3d = mask_nj[:, :, None]
    t = (run * 16)[None, :, None] + lanes[None, None, :]  # element within the first half
    low = tl.load(p2 + rows * s2 + group[None, :, None] * 64 + t, mask=mask_3d,
                  other=0).to(tl.int32)  # fmt: skip
    high = tl.load(p3 + rows * s3 + group[None, :, None] * 32 + t % 32, mask=mask_3d,
                   other=0).to(tl.int32)  # fmt: skip
    shift = t // 32 * 2
    q_first = ((low & 0xF) | (((high >> shift) & 3) << 4)) - 32  # elements t
    q_second = ((low >> 4) | (((high >> (shift + 4)) & 3) << 4)) - 32  # elements 64 + t
    x_mask = (mask_j & (j * 0 + m < M))[:, None]  # padding rows of x read nothing
    x_at = x_ptr + m * stride_xm + group[:, None] * 128 + (run * 16)[:, None] + lanes[None, :]
    x_first = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)[None, :, :]
    x_second = tl.load(x_at + 64, mask=x_mask, other=0.0).to(tl.float32)[None, :, :]
    sum_first = tl.sum(q_first.to(tl.float32) * x_first, axis=2)  # [BLOCK_N, GROUPS * 4]
    sum_second = tl.sum(q_second.to(tl.float32) * x_second, axis=2)
    scale_at = p1 + offs_n[:, None] * s1 + group[None, :] * 8 + run[None, :]
    scale_first = tl.load(scale_at, mask=mask_nj, other=0).to(tl.float32)
    scale_second = tl.load(scale_at + 4, mask=mask_nj, other=0).to(tl.float32)
    d = tl.load(p0 + offs_n[:, None] * s0 + group[None, :] // 2, mask=mask_nj, other=0.0)
    return d.to(tl.float32) * (scale_first * sum_first + scale_second * sum_second)


@triton.jit
def _quant_gemv_kquant_kernel(
    x_ptr, out_ptr, p0, p1, p2, p3, s0, s1, s2, s3,
    M, N, K,
    stride_xm,  # x: [M, K], last stride 1
    stride_om,  # out: [M, N], last stride 1
    FORMAT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_m = tl.arange(0, M_PAD)
    num_groups = K // GROUP_SIZE
    first, groups_per_split = k_split(pid_k, num_groups, GROUPS, SPLIT_K)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for g0 in range(first, first + groups_per_split, GROUPS):
        grp = g0 + tl.arange(0, GROUPS)
        mask_g = grp < num_groups
        for m in tl.static_range(M_PAD):
            if FORMAT == 3:
                part = _q4_k_group_sums(x_ptr, p0, p1, p2, p3, s0, s1, s2, s3, offs_n, N, grp,
                                        mask_g, m, M, stride_xm)  # fmt: skip
            else:
                part = _q6_k_group_sums(x_ptr, p0, p1, p2, p3, s0, s1, s2, s3, offs_n, N, g0,
                                        num_groups, m, M, stride_xm, GROUPS)  # fmt: skip
            acc += tl.where(offs_m[:, None] == m, tl.sum(part, axis=1)[None, :], 0.0)
    out_mask = (offs_m[:, None] < M) & mask_n[None, :]
    store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K)


def quant_gemv_kquant(
    x: torch.Tensor,  # [M, K], M <= 8
    out: torch.Tensor,  # [M, N] (fp32 and zeroed when split_k > 1)
    fmt: QuantFormat,
    planes: list[torch.Tensor],  # the format's four planes in kernel order
    size_k: int,
    *,
    block_n: int,
    block_k: int,  # elements per K step: a multiple of the group size
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """``out = x @ dequantize(w).T`` for q4_k or q6_k (K a multiple of 256)."""
    group_size = KQUANT_FORMATS.get(fmt.name)
    if group_size is None or size_k % QK_K or block_k % group_size:
        raise ValueError(f"quant_gemv_kquant: {fmt.name}, K={size_k}, step {block_k}")
    grid = (triton.cdiv(planes[0].shape[0], block_n), split_k)
    _quant_gemv_kquant_kernel[grid](
        x, out, *planes, *(p.stride(0) for p in planes), x.shape[0], planes[0].shape[0],
        size_k, x.stride(0), out.stride(0), FORMAT=fmt.kernel_id,
        M_PAD=rows_pad(x.shape[0]), BLOCK_N=block_n,
        GROUPS=block_k // group_size, GROUP_SIZE=group_size, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x),
    )  # fmt: skip
