"""Rank 0 tells the other ranks each step through a ring of slots in shared memory, not
through a collective: a step message is msgpack (msgspec, no pickle) written into the next
slot, and one byte down a pipe per rank wakes it (the write is a system call, so the slot's
bytes are visible before the wake-up is).

Over gloo, each step was two broadcasts of a pickled object over TCP on the host's critical
path. Here rank 0 writes and goes on; a rank blocks on its pipe while the engine idles, and
sees end-of-file when rank 0's process is gone.

Layout of the file (``/dev/shm`` where it exists): ``[sequence of rank r's last taken step,
one uint64 per rank] [slot 0] ... [slot SLOTS-1]``, each slot ``[uint32 length][payload]``.
Rank 0 never writes a slot that a rank has not taken yet: the ring holds ``SLOTS`` steps, and
rank 0 is never more than two ahead (each step's all-reduces wait for every rank).
A message larger than a slot goes over the control group (``group.broadcast_object``) and the
slot says so.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from engine.host_inputs import StepMessage

SLOTS = 4
# A 256-sequence decode step is about 10 KiB; a slot holds long block tables too. Small enough
# for a container's default 64 MiB /dev/shm, which NCCL also uses.
SLOT_BYTES = 2**20
LENGTH = struct.Struct("<I")
OVERSIZE = 0xFFFFFFFF  # the slot's length when the message went over the control group
FULL_RING_POLL_S = 50e-6


@dataclass(frozen=True)
class ChannelEnd:
    """What a rank needs to attach: the ring's file and the read end of its pipe."""

    path: str
    read_fd: int
    size: int  # ranks in the group


class StepChannel:
    """One side of the ring: rank 0 ``send``s, each other rank ``receive``s."""

    def __init__(self, path: str, size: int, rank: int, fds: list[int]) -> None:
        self.path, self.size, self.rank = path, size, rank
        self.header_bytes = 8 * size
        with open(path, "r+b") as file:
            self.map = mmap.mmap(file.fileno(), self.header_bytes + SLOTS * SLOT_BYTES)
        self.taken = memoryview(self.map)[: self.header_bytes].cast("Q")  # [size]
        self.fds = fds  # rank 0: the write ends, by rank (index 0 unused); others: [read end]
        self.read_fds: list[int] = []  # rank 0, until the ranks have started: theirs
        self.sent = 0  # rank 0: steps written; others: steps taken
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepMessage | None)

    # -- rank 0 -------------------------------------------------------------------------------

    @classmethod
    def create(cls, size: int) -> StepChannel:
        """Rank 0's side: the ring's file and a pipe per other rank (``end_for`` each)."""
        path = _ring_file(8 * size + SLOTS * SLOT_BYTES)
        pipes = [os.pipe() for _ in range(size - 1)]
        channel = cls(path, size, 0, [-1, *(write for _, write in pipes)])
        channel.read_fds = [-1, *(read for read, _ in pipes)]
        return channel

    def end_for(self, rank: int) -> ChannelEnd:
        """What rank ``rank`` attaches with (its pipe's read end, passed to its process)."""
        return ChannelEnd(self.path, self.read_fds[rank], self.size)

    def started(self) -> None:
        """Every rank has attached: drop the file's name and rank 0's copies of the read ends
        (the mapping and the pipes stay)."""
        for fd in self.read_fds[1:]:
            os.close(fd)
        self.read_fds = []
        Path(self.path).unlink(missing_ok=True)

    def send(self, message: StepMessage | None, overflow: Any) -> None:
        """Rank 0: ``message`` to every rank (``None``: stop). ``overflow(message)`` carries one
        larger than a slot (the control group's broadcast)."""
        payload = self.encoder.encode(message)
        self._wait_for_room()
        offset = self.header_bytes + (self.sent % SLOTS) * SLOT_BYTES
        if len(payload) + LENGTH.size <= SLOT_BYTES:
            LENGTH.pack_into(self.map, offset, len(payload))
            self.map[offset + LENGTH.size : offset + LENGTH.size + len(payload)] = payload
        else:
            LENGTH.pack_into(self.map, offset, OVERSIZE)
        self.sent += 1
        for rank, fd in enumerate(self.fds[1:], start=1):
            try:
                os.write(fd, b"\x01")
            except BrokenPipeError as exc:  # a RuntimeError, as a failed collective's
                raise RuntimeError(f"rank {rank}'s step pipe is closed: it is gone") from exc
        if len(payload) + LENGTH.size > SLOT_BYTES:
            overflow(message)

    def _wait_for_room(self) -> None:
        """Until every rank has taken the step that last used the next slot."""
        oldest = self.sent - SLOTS  # the step whose slot is next
        while oldest >= 0 and min(self.taken[1:]) <= oldest:
            time.sleep(FULL_RING_POLL_S)

    # -- the other ranks ----------------------------------------------------------------------

    @classmethod
    def attach(cls, end: ChannelEnd, rank: int) -> StepChannel:
        return cls(end.path, end.size, rank, [end.read_fd])

    def receive(self, overflow: Any) -> StepMessage | None:
        """A rank other than 0: the next step, waiting for it (``overflow()`` receives one
        larger than a slot). Rank 0's process gone: ``EOFError``."""
        if not os.read(self.fds[0], 1):
            raise EOFError("rank 0 is gone")
        offset = self.header_bytes + (self.sent % SLOTS) * SLOT_BYTES
        (length,) = LENGTH.unpack_from(self.map, offset)
        if length == OVERSIZE:
            message: StepMessage | None = overflow()
        else:
            start = offset + LENGTH.size
            message = self.decoder.decode(self.map[start : start + length])
        self.sent += 1
        self.taken[self.rank] = self.sent
        return message

    def close(self) -> None:
        """Unmap the ring and close this side's pipes (rank 0: the ranks see end-of-file)."""
        if self.read_fds:  # rank 0, before the ranks started
            self.started()
        self.taken.release()
        self.map.close()
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []


def _ring_file(num_bytes: int) -> str:
    """A file of ``num_bytes`` for the ring, its blocks allocated (a full tmpfs fails here, not
    with SIGBUS mid-step): in /dev/shm (memory) where there is room, else the temp folder."""
    for folder in ("/dev/shm", None):
        try:
            handle, path = tempfile.mkstemp(prefix="pagestream-steps-", dir=folder)
        except OSError:
            continue
        try:
            os.posix_fallocate(handle, 0, num_bytes)
            return path
        except OSError:
            Path(path).unlink(missing_ok=True)
        finally:
            os.close(handle)
    raise OSError(f"no room for the tensor-parallel step ring ({num_bytes} bytes)")
