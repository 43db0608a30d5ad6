"""Small all-reduces over peer-mapped device buffers, for the decode sizes where NCCL's
latency, not bandwidth, sets the time (two all-reduces a layer, a few KiB to a few MiB each).

Every rank of one host maps one buffer of each other rank into its address space (CUDA IPC,
through torch's symmetric memory: ``symm_mem.empty`` + ``rendezvous``, which exchanges the
handles over the group's store). A sum is then:

- one-shot: copy the input into this rank's buffer, wait at a device-side barrier until every
  rank has, read all ranks' buffers and add them (each rank reads ``size x`` the message);
- two-shot: each rank sums one ``1/size`` slice of all buffers and writes it back to all of
  them, then reads the full sum from its own (less traffic; one more barrier).

Both are kernels with device-side barriers, so they are captured in the decode CUDA graphs
like NCCL's. Larger messages go to NCCL (``PeerAllReduce.fits``). NVLink multicast is never
used (``group.NO_MULTICAST_ENV`` sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` on every rank):
one-shot and two-shot need only peer access.

``PAGESTREAM_TP_ALLREDUCE`` picks the path: ``auto`` (the size table below), ``nccl`` (never
this module), ``one-shot`` or ``two-shot`` (that one for every message that fits).

A sum that a residual add and RMSNorm read next (o_proj's and down's in a decoder layer) may
instead take one kernel for all three (``peer_norm``, a one-shot sum): under ``auto`` up to
the table's ``fused_max_bytes``, under ``one-shot`` wherever it fits; never under ``two-shot``
or ``nccl``, nor with ``PAGESTREAM_TP_FUSED_NORM=0``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed.peer_norm import FUSED_SLOT_BYTES, PeerAllReduceNorm, fused_norm_requested
from engine.errors import ConfigError

logger = logging.getLogger("pagestream.engine")

ALLREDUCE_ENV = "PAGESTREAM_TP_ALLREDUCE"
METHODS = ("auto", "nccl", "one-shot", "two-shot")
MAX_PEER_BYTES = 8 * 2**20  # the buffer each rank maps; larger messages take NCCL
MAX_RANKS = 8  # one host's NVLink domain
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SizeTable:
    """Which path sums a message of ``n`` bytes: ``bands`` are ``(max_bytes, method)`` in
    increasing order, the first band that holds ``n`` wins; past the last band, NCCL.
    Measured with ``bench/allreduce.py`` (records ``bench/results/allreduce-<card>.json``).
    A sum that a residual add + RMSNorm reads next, of up to ``fused_max_bytes``, takes the
    fused kernel instead (``peer_norm``; ``bench.allreduce_norm`` compares the two)."""

    bands: tuple[tuple[int, str], ...]
    fused_max_bytes: int = 0

    def method_for(self, num_bytes: int) -> str:
        for max_bytes, method in self.bands:
            if num_bytes <= max_bytes:
                return method
        return "nccl"


# By group size (a size not listed takes the largest listed below it). Two H200s
# (allreduce-h200.json, in CUDA graphs): NCCL 7.0 us at 8 KiB against one-shot's 7.6 and
# two-shot's 10.2; from 2 MiB two-shot leads (19.4 against NCCL's 26.9 us; 42.4 against 46.3
# at 8 MiB). Larger groups keep NCCL until measured. Fused with the norm: every size the
# kernel holds (1 MiB, 128 rows of 4096 bf16) at two ranks; on two H100s
# (allreduce-norm-h100.json) it beat NCCL + the norm kernel and one-shot + the norm at every
# size, by 1.16-1.39x (6.5 against 7.9 us at one row of 4096).
SIZE_TABLES = {
    2: SizeTable(
        bands=((2**20, "nccl"), (MAX_PEER_BYTES, "two-shot")), fused_max_bytes=FUSED_SLOT_BYTES
    ),
    4: SizeTable(bands=()),
}


def requested_method() -> str:
    """``PAGESTREAM_TP_ALLREDUCE``, checked."""
    method = os.environ.get(ALLREDUCE_ENV, "auto").strip().lower() or "auto"
    if method not in METHODS:
        raise ConfigError(f"{ALLREDUCE_ENV}={method!r}: expected one of {', '.join(METHODS)}")
    return method


def size_table(world_size: int) -> SizeTable:
    return SIZE_TABLES[max(n for n in SIZE_TABLES if n <= world_size)]


class PeerAllReduce:
    """Sums of small device tensors across the group's ranks through peer-mapped buffers.

    Made by ``create`` (None where it cannot work); every rank must make it at the same point,
    since the buffer exchange is a collective.
    """

    def __init__(
        self, group: Any, device: torch.device, method: str, fuse_norm: bool = True
    ) -> None:
        from torch.distributed import _symmetric_memory as symm_mem  # CUDA builds only

        self.group_name: str = group.group_name
        self.world_size = dist.get_world_size(group)
        self.method = method
        self.table = size_table(self.world_size)
        self.fused_max_bytes = _fused_max_bytes(method, self.table) if fuse_norm else 0
        # one byte buffer; each message views its prefix in its own dtype
        self.buffer = symm_mem.empty(MAX_PEER_BYTES, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.ops = torch.ops.symm_mem
        # both ops exist in the torch releases this runs on; check at once, not mid-capture
        self.ops.one_shot_all_reduce_out, self.ops.two_shot_all_reduce_out  # noqa: B018
        self.norm: PeerAllReduceNorm | None = None  # the sum fused with residual add + RMSNorm
        if self.fused_max_bytes > 0:
            self.norm = PeerAllReduceNorm(group, device, dist.get_rank(group))

    @classmethod
    def create(
        cls, group: Any, store: dist.Store, device: torch.device, rank: int
    ) -> PeerAllReduce | None:
        """The peer all-reduce for ``group`` (its store ``store``) on ``device`` (rank
        ``rank``'s), or None: not CUDA, NCCL asked for, more ranks than one host's NVLink
        domain, a peer this device cannot map, or rank 0's process mapped peer buffers for
        an earlier group (``agree_to_map``). Every rank gets the same answer."""
        if not agree_to_map(store, rank, cls._possible(group, device, rank)):
            return None
        try:
            return cls(group, device, requested_method(), fused_norm_requested())
        except (RuntimeError, ImportError, AttributeError) as exc:  # torch without the ops
            logger.warning("tensor parallel: peer all-reduce unavailable (%s); using NCCL", exc)
            return None

    @staticmethod
    def _possible(group: Any, device: torch.device, rank: int) -> bool:
        """Whether this rank's side allows the peer path (the devices are one host's, so
        every rank finds the same)."""
        method, fuse_norm = requested_method(), fused_norm_requested()
        if device.type != "cuda" or method == "nccl":
            return False
        world_size = dist.get_world_size(group)
        if not 2 <= world_size <= MAX_RANKS:
            return False
        table = size_table(world_size)
        fuses = fuse_norm and _fused_max_bytes(method, table) > 0
        if method == "auto" and all(m == "nccl" for _, m in table.bands) and not fuses:
            return False  # NCCL is the fastest at every size measured: no buffer to map
        if not _peers_reachable(device, rank, world_size):
            logger.info("tensor parallel: no peer access between the GPUs; all-reduce on NCCL")
            return False
        return True

    def method_for(self, x: torch.Tensor) -> str | None:
        """The peer path that sums ``x`` (``one-shot``/``two-shot``), or None: NCCL does."""
        num_bytes = x.numel() * x.element_size()
        if x.dtype not in DTYPES or not x.is_contiguous() or num_bytes > MAX_PEER_BYTES:
            return None
        method = self.method if self.method != "auto" else self.table.method_for(num_bytes)
        return None if method == "nccl" else method

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether the sum of ``x`` ([T, hidden]) and the residual add + RMSNorm after it run
        as one kernel (``norm``): a contiguous float message of at most ``fused_max_bytes``."""
        num_bytes = x.numel() * x.element_size()
        return (
            self.norm is not None
            and x.dim() == 2
            and x.dtype in DTYPES
            and x.is_contiguous()
            and num_bytes <= self.fused_max_bytes
        )

    def abort(self) -> None:
        """From any thread, once a rank is gone: the fused sums stop waiting for it (torch's
        one-shot and two-shot kernels cannot be told)."""
        if self.norm is not None:
            self.norm.abort()

    def all_reduce(self, x: torch.Tensor, method: str) -> torch.Tensor:
        """The sum of every rank's ``x`` by ``method`` (``method_for``'s answer): a new tensor,
        ``x`` is left as it was."""
        num_bytes = x.numel() * x.element_size()
        staged = self.buffer[:num_bytes].view(x.dtype)  # [numel] in this rank's mapped buffer
        staged.copy_(x.reshape(-1))
        out = torch.empty_like(x)
        if method == "one-shot":
            self.ops.one_shot_all_reduce_out(staged, "sum", self.group_name, out.view(-1))
        else:
            self.ops.two_shot_all_reduce_out(staged, "sum", self.group_name, out.view(-1))
        return out


MAP_DECISION_KEY = "pagestream-peer-buffers"
_process = {"mapped": False}  # this process has mapped peer buffers for a group


def agree_to_map(store: dist.Store, rank: int, possible: bool) -> bool:
    """Whether this group maps peer buffers: rank 0 decides and tells the others through the
    group's ``store`` (they wait for it), so no rank waits at a rendezvous another skipped.

    Once per process of rank 0: torch's symmetric memory numbers the store exchanges of its
    rendezvous with one counter per process, so a second group formed by a long-lived rank 0
    with new rank processes (a second engine in one script) would wait on exchange keys its
    new peers never write, forever (issue 28's hang of the second two-GPU test, on two
    H100s). That group sums on NCCL instead, and says so."""
    if rank != 0:
        return bool(store.get(MAP_DECISION_KEY) == b"1")
    decision = possible and not _process["mapped"]
    if possible and not decision:
        logger.warning(
            "tensor parallel: this process mapped peer buffers for an earlier engine, and "
            "torch's symmetric memory sets them up once per process; all-reduce on NCCL"
        )
    store.set(MAP_DECISION_KEY, "1" if decision else "0")
    _process["mapped"] = _process["mapped"] or decision
    return decision


def _fused_max_bytes(method: str, table: SizeTable) -> int:
    """The largest sum fused with its norm under ``PAGESTREAM_TP_ALLREDUCE=method``: the
    fused kernel is a one-shot sum, so never where two-shot is asked for."""
    if method == "auto":
        return min(table.fused_max_bytes, FUSED_SLOT_BYTES)
    return FUSED_SLOT_BYTES if method == "one-shot" else 0


def _peers_reachable(device: torch.device, rank: int, world_size: int) -> bool:
    """Whether every pair of the group's devices can map each other's memory (rank ``r``
    runs on the first rank's device + ``r``, see ``ranks.rank_device``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    devices = range(index - rank, index - rank + world_size)
    if devices.start < 0 or devices.stop > torch.cuda.device_count():
        return False  # ranks on other hosts or hidden devices
    return all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)
