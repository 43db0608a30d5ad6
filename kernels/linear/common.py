# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Pieces the linear kernels share: a program's tile, its run of K, and how the K splits meet.

A kernel reads its program ids first (its grid in one place); ``tile_offsets`` turns one into
the program's offsets along that axis and their mask. A narrow weight gives too few output
tiles to fill the GPU; splitting K over ``SPLIT_K`` programs (grid axis 1 of a GEMV, axis 2
of a tensor-core kernel) makes more, each walking a run of whole K steps (``k_split``). Their
fp32 partial sums meet in one of two ways:

* the GEMVs add them atomically into a zeroed fp32 buffer (``split_k_target``,
  ``store_split_k``) that the launcher copies into ``out``;
* the tensor-core kernels store each split's sums in a plane of its own, ``[SPLIT_K, M, N]``
  (``split_k_planes``, ``store_split_k_plane``), which one more kernel adds in split order
  (``add_split_k_planes``): a step's tokens must not depend on the order in which atomic
  additions land.

The ``@triton.jit`` helpers are inlined where a kernel calls them: it compiles as if they
were written out in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_producers


def linear_out(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N]
) -> torch.Tensor:  # out
    """``F.linear(x, weight, bias)`` written into ``out`` by cuBLAS: the calls ``F.linear``
    makes (``mm``, or ``addmm`` with the bias in its epilogue), so the same result bit for
    bit where ``out`` is contiguous."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


ADD_PLANES_BLOCK = 1024  # output elements per program of the plane sum


@triton.jit
def tile_offsets(pid, BLOCK: tl.constexpr, size):
    """Program ``pid``'s ``BLOCK`` offsets along its grid axis, and the mask of those below
    ``size``."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < size


@triton.jit
def k_split(pid_k, total, STEP: tl.constexpr, SPLIT_K: tl.constexpr):
    """The run of K that split ``pid_k`` of ``SPLIT_K`` walks when ``total`` (elements, blocks
    or groups) is split: ``(first, length)``, the length a whole number of ``STEP``s; the last
    run may reach past ``total`` (the loads mask it)."""
    per_split = tl.cdiv(total, SPLIT_K * STEP) * STEP
    return pid_k * per_split, per_split


@triton.jit
def store_split_k(out_ptr, acc, offs_m, offs_n, out_mask, stride_om, SPLIT_K: tl.constexpr):
    """A GEMV program's fp32 tile ``acc [M_PAD, BLOCK_N]`` of ``out [M, N]`` (last stride 1)
    at rows ``offs_m``, columns ``offs_n``: stored when the program covered all of K, else
    added atomically (the launcher zeroed ``out``, and the K splits sum into it)."""
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


@triton.jit
def store_split_k_plane(
    out_ptr, acc, pid_k, offs_n, mask_n, offs_m, mask_m, stride_om, stride_split
):
    """A tensor-core program's tile ``acc = out^T [BLOCK_N, BLOCK_M]``, rounded to ``out``'s
    dtype, into the plane of its K split ``pid_k`` (``stride_split`` 0 without planes)."""
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def rows_pad(num_rows: int) -> int:
    """A GEMV's ``M_PAD``: its rows of ``x`` padded to a power of two (``tl.arange``'s size)."""
    return max(triton.next_power_of_2(num_rows), 1)


def split_k_target(out: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where a GEMV's programs put their sums: ``out``, or with K split a zeroed fp32 buffer
    the splits add into (partial sums meet in fp32 and round once: copy it into ``out``)."""
    if split_k == 1:
        return out
    return torch.zeros(out.shape, dtype=torch.float32, device=out.device)


def split_k_planes(out: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where a tensor-core kernel's programs store: ``out`` itself, or with K split an fp32
    plane per split, ``[SPLIT_K, M, N]``, that ``add_split_k_planes`` sums in a fixed order."""
    if split_k == 1:
        return out
    return torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)


def plane_strides(target: torch.Tensor) -> tuple[int, int]:
    """The kernels' ``stride_om`` and ``stride_split`` (0 when there are no planes)."""
    return target.stride(-2), target.stride(0) if target.dim() == 3 else 0


@triton.jit
def _add_planes_kernel(
    planes_ptr, out_ptr, N, numel, stride_om,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``out = planes[0] + planes[1] + ...`` in that order, in float32, rounded once."""
    wait_for_producers(PDL)
    offs, mask = tile_offsets(tl.program_id(0), BLOCK, numel)
    acc = tl.load(planes_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(planes_ptr + split * numel + offs, mask=mask, other=0.0)
    out_ptrs = out_ptr + (offs // N) * stride_om + offs % N
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def add_split_k_planes(out: torch.Tensor, target: torch.Tensor) -> None:
    """Sum the K splits' planes into ``out`` (nothing when the kernel stored into ``out``):
    one kernel, the planes added in split order and rounded once to ``out``'s dtype (torch's
    ``sum`` then ``copy_`` took two, 4.1 us a linear on an H100, 9% of a q4_0 llama3-8b
    decode step at batch 8)."""
    if target is out:
        return
    num_rows, num_cols = out.shape
    numel = num_rows * num_cols
    _add_planes_kernel[(triton.cdiv(numel, ADD_PLANES_BLOCK),)](
        target, out, num_cols, numel, out.stride(0), SPLIT_K=target.shape[0],
        BLOCK=ADD_PLANES_BLOCK, **pdl_launch(out),
    )  # fmt: skip
