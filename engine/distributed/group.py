"""The collectives of a tensor-parallel group, and how a group of size 1 skips them.

Two process groups and a peer buffer: the device group (NCCL on CUDA, gloo on the CPU) carries the model's
all-reduces and gathers, also inside CUDA graphs; the control group (always gloo, without a
timeout) carries rank 0's step messages, which are Python objects on the host. On CUDA, small all-reduces (decode's)
take ``peer_allreduce.PeerAllReduce`` over peer-mapped buffers instead of NCCL, and a sum
that a residual add and RMSNorm read next may be left to the norm (``PartialSum``), which
then sums, adds and normalizes in one kernel (``peer_norm``).

A rank leaves by aborting its communicators, which waits for no one: NCCL's
``destroy_process_group`` flushes and finalizes them, a wait on the other ranks that never ends
when one of them is gone, stopping or stuck in a collective (see ``ranks.RankProcesses.stop``).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed.peer_allreduce import MAX_PEER_BYTES, PeerAllReduce
from engine.distributed.step_channel import StepChannel
from engine.host_inputs import StepMessage

logger = logging.getLogger("pagestream.engine")

CONTROL_TIMEOUT = datetime.timedelta(days=3650)  # no limit in practice: see ``join``
# NVLink multicast stays off on every rank (NCCL's NVLS algorithms, torch symmetric memory,
# NVSHMEM): the GPU hosts this runs on are to run without it. A value already set wins.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``size``; with ``size == 1`` every collective returns its input."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # dist.ProcessGroup
    control_group: Any = None
    peer: PeerAllReduce | None = None  # small all-reduces on CUDA
    steps: StepChannel | None = None  # rank 0's step messages (else the control group)
    backend: str = "none"  # the device group's: nccl, or gloo on the CPU

    @property
    def sums(self) -> str:
        """Which path sums the model's all-reduces: ``none`` (one rank), ``gloo``, ``nccl``,
        or the peer method (``auto``, ``one-shot``, ``two-shot``) with ``+norm`` where the
        sums before a norm are fused with it. Benchmarks record it; tests check it."""
        if self.size == 1:
            return "none"
        if self.peer is None:
            return self.backend
        return self.peer.method + ("+norm" if self.peer.norm is not None else "")

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples, and tells the others what to run."""
        return self.rank == 0

    @classmethod
    def join(
        cls, rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float
    ) -> TensorParallelGroup:
        """Form the group with the other ranks, all of whom have reached ``store``."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        for name, value in NO_MULTICAST_ENV.items():  # before NCCL reads them, on every rank
            os.environ.setdefault(name, value)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # its own gloo group, also on the CPU: the ranks wait there for rank 0's next step for
        # as long as the engine idles, where a collective's timeout would end them
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        peer = PeerAllReduce.create(dist.group.WORLD, store, device, rank)
        group = cls(rank, size, dist.group.WORLD, control, peer, backend=backend)
        if rank == 0:
            logger.info(
                "tensor parallel: all-reduce on %s%s", group.sums,
                "" if peer is None else f" (peer buffers up to {MAX_PEER_BYTES} bytes, "
                f"{backend} past them; +norm: up to {peer.fused_max_bytes} with the norm)",
            )  # fmt: skip
        return group

    @staticmethod
    def ready_key(rank: int) -> str:
        """The store key a rank sets once it has started (rank 0 waits for all of them)."""
        return f"pagestream-rank-{rank}-ready"

    def leave(self) -> None:
        """Drop this rank's side of every group without waiting for the other ranks (they may
        be gone or stuck); afterwards ``dist.is_initialized()`` is False."""
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        if self.size == 1 or not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # private
        if abort is not None:
            abort()
        else:  # may wait on the others: callers bound it, and leave once they are gone
            dist.destroy_process_group()

    def interrupt(self) -> None:
        """Abort the device group's communicators, from any thread: a collective waiting for
        a rank that is gone returns (NCCL's would wait until its timeout). The group is
        unusable afterwards; ``leave`` still cleans up. The fused sums' barriers stop waiting
        too (``PeerAllReduce.abort``)."""
        if self.peer is not None:
            self.peer.abort()
        abort = getattr(self.device_group, "abort", None)  # absent in older torch
        if abort is not None:
            abort()

    # -- the model's collectives -------------------------------------------------------------

    def all_reduce_for_norm(self, x: torch.Tensor) -> torch.Tensor | PartialSum:
        """``all_reduce(x)`` for a sum that a residual add and RMSNorm read next (o_proj's,
        down's): where one kernel can do the three, ``x`` unsummed, for the norm to sum."""
        if self.peer is not None and self.peer.fuses_norm(x):
            return PartialSum(x, self)
        return self.all_reduce(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``x``: ``x`` itself, summed in place, or a new tensor (use the
        result, not ``x``)."""
        if self.size == 1:
            return x
        method = None if self.peer is None else self.peer.method_for(x)
        if self.peer is not None and method is not None:
            return self.peer.all_reduce(x, method)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, hidden], the new residual
        """RMSNorm of ``residual`` (summed into in place; None: zeros) plus the sum of every
        rank's ``x``, in one kernel: only for an ``x`` that ``all_reduce_for_norm`` left."""
        norm = None if self.peer is None else self.peer.norm
        assert norm is not None, "all_reduce_add_rms_norm without the fused peer path"
        return norm(x, residual, weight, eps)

    def gather_vocab(
        self, local: torch.Tensor, vocab_size: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N, V/size] per rank -> [N, V] on every rank (the last shard's padding dropped)."""
        if self.size == 1:
            return local if out is None else out.copy_(local)
        gathered = local.new_empty(self.size, *local.shape)  # [size, N, V/size]
        if local.is_cuda:
            dist.all_gather_into_tensor(gathered, local.contiguous(), group=self.device_group)
        else:  # gloo has no all_gather_into_tensor
            dist.all_gather(list(gathered.unbind(0)), local.contiguous(), group=self.device_group)
        logits = gathered.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab_size]
        return logits.contiguous() if out is None else out.copy_(logits)

    # -- control -----------------------------------------------------------------------------

    def send_step(self, message: StepMessage | None) -> None:
        """Rank 0: the next step to every other rank (``None``: stop)."""
        if self.steps is not None:
            self.steps.send(message, overflow=self.broadcast_object)
        else:
            self.broadcast_object(message)

    def receive_step(self) -> StepMessage | None:
        """A rank other than 0: rank 0's next step, once it is sent."""
        if self.steps is not None:
            message: StepMessage | None = self.steps.receive(overflow=self.broadcast_object)
            return message
        received: StepMessage | None = self.broadcast_object()
        return received

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), on the device."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out


@dataclass(frozen=True)
class PartialSum:
    """This rank's share of a sum over the group's ranks, not yet summed: the norm that reads
    it next sums it, adds the residual and normalizes in one kernel (``add_rms_norm``). Made by
    ``TensorParallelGroup.all_reduce_for_norm``."""

    local: torch.Tensor  # [T, hidden]
    group: TensorParallelGroup

    def total(self) -> torch.Tensor:  # [T, hidden]
        """The sum itself, for a consumer that cannot fuse it (a norm that rounds to int8)."""
        return self.group.all_reduce(self.local)

    def add_rms_norm(
        self, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, hidden], the new residual
        """As ``fused_add_rms_norm(total(), residual, weight, eps)``, in one kernel."""
        return self.group.all_reduce_add_rms_norm(self.local, residual, weight, eps)


def summed(x: torch.Tensor | PartialSum) -> torch.Tensor:
    """``x``, summed over the ranks if it is still a ``PartialSum``."""
    return x.total() if isinstance(x, PartialSum) else x
