# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""The all-reduce of a decode-size partial result, the residual add and the RMSNorm after it,
in one kernel over peer-mapped buffers; matches ``allreduce_norm.allreduce_add_rms_norm_ref``
and, roundings included, ``all_reduce`` followed by ``norm_triton.fused_add_rms_norm``.

Every rank's buffer has two slots; a call works in the one its epoch's parity picks. A program
takes rows ``pid, pid + num_programs, ...``:

1. it copies its rows of this rank's partial ``x`` into this rank's slot;
2. it meets the same program of every other rank at a barrier (``peer_barrier_triton``);
3. for each row it sums every rank's slot in rank order in fp32 (so every rank gets the same
   bits), rounds the sum to the input dtype as the all-reduce would, adds the residual
   (stored back: the new residual), and normalizes as ``norm_triton`` does;
4. the last program to finish advances the epoch (calls made, mod 2): the next call works in
   the other slot.

Why two slots and no barrier at the end: a rank may start call k+1 while another still reads
its slot of call k, so call k+1 writes the other slot. Its slot of call k is written again in
call k+2, after it passed call k+1's barrier, which every other rank reaches only once its
call k has ended (stream order; launched with PDL, the kernel waits for the one before it to
end before it touches memory). The epoch is a device counter, so eager calls and any number
of CUDA graph replays share one count. The copy in 1. is part of the kernel because the slot
is chosen on the device (a producer kernel could not write into it), and it costs no launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.collective.peer_barrier_triton import peer_barrier
from kernels.elementwise.norm_triton import _check_norm_args, _check_residual, _num_warps
from kernels.linear.int8_rows_triton import TL_FLOAT_DTYPES
from kernels.pdl import pdl_launch, wait_for_producers

NUM_SLOTS = 2
_NUM_SLOTS = tl.constexpr(NUM_SLOTS)  # globals a kernel reads must be constexpr
# Programs of one call (more rows loop in a program). Program p meets its peers on signal
# slots [(MAX_PROGRAMS + p) * WORLD_SIZE, ...): past those of torch's own kernels (at most 32
# blocks, the same layout), should its symmetric tensors share our allocation's pad; 2 x 32
# x 8 ranks x 4 bytes fill the smallest signal pad torch has had (2 KiB).
MAX_PROGRAMS = 32
_MAX_PROGRAMS = tl.constexpr(MAX_PROGRAMS)
SIGNAL_PAD_BYTES_PER_RANK = 2 * MAX_PROGRAMS * 4  # the pad a group needs, per rank in it


@dataclass(frozen=True)
class PeerBuffers:
    """Where the ranks meet: every rank's buffer and signal pad as mapped into this process,
    and this rank's epoch. Made by ``engine.distributed.peer_norm`` (tests fake the peers)."""

    buffer_ptrs: torch.Tensor  # [world] int64: each rank's buffer of NUM_SLOTS slots
    signal_pad_ptrs: torch.Tensor  # [world] int64: each rank's pad of uint32 slots
    epoch: torch.Tensor  # [2] int32: the next call's slot (calls made mod 2), programs done
    abort: torch.Tensor  # [1] int32: nonzero ends every wait at the barrier (a rank is gone)
    rank: int
    slot_bytes: int  # one slot of a buffer: the largest message
    barrier: bool = True  # False: the caller filled the other ranks' slots (one process)

    @property
    def world_size(self) -> int:
        return self.buffer_ptrs.shape[0]


@triton.jit
def _slot_start(buffer_ptrs, rank, slot, IN_DTYPE: tl.constexpr):
    """Rank ``rank``'s slot (its first element), as mapped here; 16-byte aligned (symmetric
    buffers are, and so are slots: ``peer_norm`` checks), so that accesses vectorize."""
    buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(IN_DTYPE))
    return tl.multiple_of(buffer, 16) + slot


@triton.jit
def _sum_row(
    buffer_ptrs, slot, row, offs_n, mask,
    N: tl.constexpr, BLOCK_N: tl.constexpr, WORLD_SIZE: tl.constexpr, IN_DTYPE: tl.constexpr,
):  # fmt: skip
    """Row ``row`` of the sum of every rank's slot: fp32 in rank order, rounded to IN_DTYPE.
    Loads bypass the caches (.cv): another rank wrote the lines in this very call."""
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for rank in tl.static_range(WORLD_SIZE):
        base = _slot_start(buffer_ptrs, rank, slot, IN_DTYPE)
        part = tl.load(base + row * N + offs_n, mask=mask, other=0.0, cache_modifier=".cv")
        total += part.to(tl.float32)
    return total.to(IN_DTYPE)


@triton.jit
def _allreduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    buffer_ptrs, signal_pad_ptrs, epoch_ptr, abort_ptr,
    num_rows, eps,
    stride_xt, stride_rt, stride_ot, stride_ut,  # x, residual, out, sum: [T, N], last stride 1
    SLOT_NUMEL: tl.constexpr,  # elements of IN_DTYPE in one slot
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    WORLD_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BARRIER: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    epoch = tl.load(epoch_ptr)
    slot = epoch * SLOT_NUMEL
    own = _slot_start(buffer_ptrs, RANK, slot, IN_DTYPE)
    # 1. this program's rows of x into this rank's slot
    for row in range(pid, num_rows, num_programs):
        x = tl.load(x_ptr + row * stride_xt + offs_n, mask=mask, other=0.0)
        tl.store(own + row * N + offs_n, x, mask=mask)
    # 2. the same program of every rank has done the same
    if BARRIER:
        peer_barrier(signal_pad_ptrs, _MAX_PROGRAMS + pid, abort_ptr, RANK, WORLD_SIZE)
    for row in range(pid, num_rows, num_programs):
        # 3. the sum (plus the residual), stored as the new residual ...
        total = _sum_row(buffer_ptrs, slot, row, offs_n, mask, N, BLOCK_N, WORLD_SIZE, IN_DTYPE)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_rt + offs_n, mask=mask, other=0.0)
            total = (total.to(tl.float32) + residual.to(tl.float32)).to(IN_DTYPE)
        tl.store(sum_ptr + row * stride_ut + offs_n, total, mask=mask)
        # ... and its RMSNorm: fp32 statistics, cast back, times the weight
        total32 = total.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(total32 * total32, axis=0) / N + eps)
        normed = (total32 * rstd).to(IN_DTYPE)
        weight = tl.load(weight_ptr + offs_n, mask=mask, other=0.0)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(OUT_DTYPE)
        tl.store(out_ptr + row * stride_ot + offs_n, out, mask=mask)
    # 4. the last program done resets the count and advances the epoch for the next call
    done = tl.atomic_add(epoch_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.store(epoch_ptr + 1, 0)
        tl.store(epoch_ptr, (epoch + 1) % _NUM_SLOTS)  # kept small: a count would wrap


def allreduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    peers: PeerBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``residual`` plus the sum of every rank's ``x``: every rank of ``peers``
    calls it with its own ``x`` at the same point of its stream.

    Shapes: ``x: [T, N]`` (this rank's share, last stride 1, at most ``peers.slot_bytes``),
    ``residual: [T, N]`` of x's dtype, or None (then the sum is the new residual);
    ``weight: [N]``. Works IN PLACE on ``residual`` (as ``fused_add_rms_norm``). Returns
    ``(normed, residual)``: normed in ``promote_types(x.dtype, weight.dtype)``.
    """
    _check_norm_args(x, weight)
    if x.dim() != 2 or x.numel() * x.element_size() > peers.slot_bytes:
        raise ValueError(
            f"x must be [T, N] of at most {peers.slot_bytes} bytes, got {tuple(x.shape)} {x.dtype}"
        )
    total = torch.empty_like(x) if residual is None else residual
    if residual is not None:
        _check_residual(x, residual)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_rows, size = x.shape
    if num_rows == 0:
        return out, total
    _allreduce_add_rms_norm_kernel[(min(num_rows, MAX_PROGRAMS),)](
        x, total, weight, out, total,
        peers.buffer_ptrs, peers.signal_pad_ptrs, peers.epoch, peers.abort,
        num_rows, eps,
        x.stride(0), total.stride(0), out.stride(0), total.stride(0),
        SLOT_NUMEL=peers.slot_bytes // x.element_size(),
        N=size,
        BLOCK_N=triton.next_power_of_2(size),
        RANK=peers.rank,
        WORLD_SIZE=peers.world_size,
        HAS_RESIDUAL=residual is not None,
        BARRIER=peers.barrier,
        IN_DTYPE=TL_FLOAT_DTYPES[x.dtype],
        OUT_DTYPE=TL_FLOAT_DTYPES[out.dtype],
        num_warps=_num_warps(size),
        **pdl_launch(x),
    )  # fmt: skip
    return out, total
