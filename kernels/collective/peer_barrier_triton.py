# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""A barrier between the programs of one host's ranks, on the device, over the signal pads of
torch's symmetric memory (every rank maps every other rank's pad of uint32 slots).

Program ``p`` of rank ``r`` meets program ``p`` of every other rank ``q`` in two steps:

1. arrive: set slot ``p * WORLD_SIZE + r`` of ``q``'s pad from 0 to 1, a release at system
   scope: what the program wrote before is visible to ``q`` once ``q`` sees the 1;
2. wait: set slot ``p * WORLD_SIZE + q`` of its own pad from 1 back to 0, an acquire: what
   ``q`` wrote before it arrived is visible here.

Each wait puts its slot back to 0, so the pads are all zeros again once every rank has passed:
no epoch or flag comes from the host, and a CUDA graph holding the barrier replays it any
number of times. A rank that runs ahead into the next barrier on the same slots spins in 1.
until the slow rank has taken the previous signal in its 2., so signals never mix across
calls. torch's own symmetric-memory kernels use the same protocol (put 0 -> 1, wait 1 -> 0),
so sharing a pad with them is safe as long as every rank calls them in the same order, which
collectives do anyway.

A scalar atomic runs on one thread of the program, its result shared with the others; the CTA
barriers around the signals order the other threads' memory operations with them (the release
and acquire are cumulative).

A rank that dies leaves the others spinning: a nonzero ``abort`` flag (set from the host,
``PeerAllReduceNorm.abort``) ends every spin, and the barrier returns as if all had arrived
(the results are garbage; the engine is dead by then). A spin reads it once every
ABORT_POLL_SPINS tries, so that waiting for a live rank costs one atomic a try.
"""

from __future__ import annotations

import triton
import triton.language as tl

ABORT_POLL_SPINS = tl.constexpr(64)  # tries between two reads of the flag: microseconds


@triton.jit
def _unless_aborted(spinning, spins, abort_ptr):
    """``(spinning, spins + 1)``, spinning cleared every ABORT_POLL_SPINS tries if the abort
    flag is set. The flag is read by an atomic: one thread reads it and all get its value (a
    plain load in every thread could see it change between threads and split the loop)."""
    spins += 1
    if spins % ABORT_POLL_SPINS == 0:
        spinning = spinning & (tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="sys") == 0)
    return spinning, spins


@triton.jit
def peer_barrier(signal_pad_ptrs, slot, abort_ptr, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Return once program ``slot`` of every rank has called it (or ``abort_ptr``'s int32 is
    set). ``signal_pad_ptrs``: [WORLD_SIZE] int64, each rank's pad as mapped here; slots
    ``[slot * WORLD_SIZE, (slot + 1) * WORLD_SIZE)`` of every pad are this program's."""
    tl.debug_barrier()  # every thread's writes before the arrival
    own_pad = tl.load(signal_pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
    # 1. arrive at every other rank (spin while it still holds our previous signal)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            peer_pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.int32))
            arrive = peer_pad + slot * WORLD_SIZE + RANK
            spinning = tl.atomic_cas(arrive, 0, 1, sem="release", scope="sys") != 0
            spins = 0
            while spinning:
                spinning = tl.atomic_cas(arrive, 0, 1, sem="release", scope="sys") != 0
                spinning, spins = _unless_aborted(spinning, spins, abort_ptr)
    # 2. wait for every other rank's arrival, taking it back to 0
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            arrived = own_pad + slot * WORLD_SIZE + peer
            spinning = tl.atomic_cas(arrived, 1, 0, sem="acquire", scope="sys") != 1
            spins = 0
            while spinning:
                spinning = tl.atomic_cas(arrived, 1, 0, sem="acquire", scope="sys") != 1
                spinning, spins = _unless_aborted(spinning, spins, abort_ptr)
    tl.debug_barrier()  # every thread's reads after the acquires
