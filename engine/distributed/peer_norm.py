"""The all-reduce of a decode-size message fused with the residual add and RMSNorm after it
(``kernels.collective.allreduce_norm_triton``): its peer-mapped buffers and its switch.

A decoder layer sums two partial results over the ranks (o_proj's, down's) and adds each to
the residual stream and normalizes it. Unfused that is an all-reduce (NCCL, or the peer
one-shot: a copy into the mapped buffer, then the sum) and a norm kernel; fused it is one
kernel, which copies this rank's share into its buffer, meets the other ranks at a device-side
barrier, sums every rank's buffer, adds the residual and normalizes. The model gets there
through ``group.PartialSum``: the layer hands the norm its unsummed share.

``PAGESTREAM_TP_FUSED_NORM=0`` turns it off (``1``, the default: on wherever
``PeerAllReduce.fuses_norm`` says so).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.errors import ConfigError

FUSED_NORM_ENV = "PAGESTREAM_TP_FUSED_NORM"
# The largest fused message: 128 rows of llama3-8b's 4096 bf16, 64 of llama3-70b's 8192.
# Each rank maps two of them (``allreduce_norm_triton.NUM_SLOTS``).
FUSED_SLOT_BYTES = 2**20
ALIGNMENT_BYTES = 16  # the kernel's vector loads and stores
DEFAULT_SIGNAL_PAD_BYTES = 2048  # torch releases without ``signal_pad_size`` (newer: larger)


def fused_norm_requested() -> bool:
    """``PAGESTREAM_TP_FUSED_NORM``, checked: on unless ``0``."""
    value = os.environ.get(FUSED_NORM_ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ConfigError(f"{FUSED_NORM_ENV}={value!r}: expected 1 (fuse, the default) or 0")
    return value == "1"


class PeerAllReduceNorm:
    """``(normed, residual)`` of the sum of every rank's share plus the residual, in one
    kernel. Made by ``PeerAllReduce`` on every rank at the same point (the buffer exchange is
    a collective)."""

    def __init__(self, group: Any, device: torch.device, rank: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem  # CUDA builds only

        # Triton: imported where it runs (a CPU-only install never imports it)
        from kernels.collective.allreduce_norm_triton import (
            NUM_SLOTS,
            SIGNAL_PAD_BYTES_PER_RANK,
            PeerBuffers,
            allreduce_add_rms_norm,
        )

        self.kernel = allreduce_add_rms_norm
        self.buffer = symm_mem.empty(NUM_SLOTS * FUSED_SLOT_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        pad_bytes = getattr(type(handle), "signal_pad_size", DEFAULT_SIGNAL_PAD_BYTES)
        if SIGNAL_PAD_BYTES_PER_RANK * len(handle.buffer_ptrs) > pad_bytes:
            raise RuntimeError(f"a signal pad of {pad_bytes} bytes is too small for the group")
        self.peers = PeerBuffers(
            buffer_ptrs=_as_device_array(_buffer_ptrs(handle, self.buffer, rank), device),
            signal_pad_ptrs=_as_device_array(list(handle.signal_pad_ptrs), device),
            epoch=torch.zeros(2, dtype=torch.int32, device=device),
            abort=torch.zeros(1, dtype=torch.int32, device=device),
            rank=rank,
            slot_bytes=FUSED_SLOT_BYTES,
        )
        # what ``abort`` copies, on a stream of its own: a DMA, which neither waits for the
        # step's stream nor needs an SM
        self.abort_stream = torch.cuda.Stream(device)
        self.abort_value = torch.ones(1, dtype=torch.int32).pin_memory()

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]: this rank's share
        residual: torch.Tensor | None,  # [T, hidden], summed into in place
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, hidden], the new residual
        return self.kernel(x, residual, weight, eps, self.peers)

    def abort(self) -> None:
        """From any thread, once a rank is gone: the fused calls waiting for it at their
        barrier, and all later ones, go on without it (their results are garbage). Returns
        without waiting for the flag to land."""
        device = self.peers.abort.device
        with torch.cuda.device(device), torch.cuda.stream(self.abort_stream):
            self.peers.abort.copy_(self.abort_value, non_blocking=True)


def _buffer_ptrs(handle: Any, buffer: torch.Tensor, rank: int) -> list[int]:
    """Every rank's ``buffer`` as mapped here. The handle's pointers are those of the
    allocation that holds it (torch may place several symmetric tensors in one): each rank's
    tensor sits at the same offset in its own."""
    offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
    ptrs = [base + offset for base in handle.buffer_ptrs]
    if offset < 0 or any(ptr % ALIGNMENT_BYTES for ptr in ptrs):
        raise RuntimeError(f"symmetric buffers not {ALIGNMENT_BYTES}-byte aligned: {ptrs}")
    return ptrs


def _as_device_array(values: list[int], device: torch.device) -> torch.Tensor:  # [world] int64
    return torch.tensor(values, dtype=torch.int64, device=device)
