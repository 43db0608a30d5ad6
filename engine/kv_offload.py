"""The host tier of the prefix cache (``--kv-offload-mb``): bookkeeping, no tensors.

When the block manager hands out a free device page that still holds a cached, hashed block,
the page's contents are first copied to a host slot here (unless the host tier already holds
that block). A later sequence whose prefix misses the device cache goes on matching block
hashes here; each hit gets a fresh device page and a host -> device copy instead of a
forward pass over its tokens. Slots are reused least recently used first.

The copies themselves run in the model runner, in the order they were decided
(``PageTransfer`` list of one step), before the step's forward: a page evicted and handed
out again in the same step is saved before anything overwrites it, and a slot restored and
then reused for another page in the same step is read before it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec


# The page moves are msgspec structs, tagged, so that a step's list of both kinds travels to
# the other tensor-parallel ranks as msgpack (``distributed/step_channel.py``).
class PageTransfer(msgspec.Struct, frozen=True, tag=True):
    """One page copied between the device pool and the host tier."""

    device_block: int
    host_slot: int
    to_host: bool  # True: save an evicted page; False: restore a host hit


class PageCopy(msgspec.Struct, frozen=True, tag=True):
    """One device page copied to another (copy-on-write of a page shared by the samples of
    one request); runs in order with the ``PageTransfer``s of its step."""

    src_block: int
    dst_block: int


PageMove = PageTransfer | PageCopy


@dataclass(frozen=True)
class PrefixHit:
    """Tokens of a sequence's prefix found in the cache, by tier."""

    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class HostPrefixCache:
    """LRU map from a block's chained prefix hash to the host slot holding its KV."""

    def __init__(self, num_slots: int) -> None:
        # Front = least recently used: saved or hit longest ago.
        self._slot_of_hash: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.num_offloaded_pages = 0  # device -> host copies
        self.num_evictions = 0  # host entries dropped to make room

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of_hash

    def save(self, block_hash: bytes) -> int | None:
        """The slot to copy an evicted device page into; None when no copy is needed
        (the tier already holds that block, or has no slots)."""
        if block_hash in self._slot_of_hash:
            self._slot_of_hash.move_to_end(block_hash)
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._slot_of_hash:
            _, slot = self._slot_of_hash.popitem(last=False)
            self.num_evictions += 1
        else:
            return None  # a tier of zero slots
        self._slot_of_hash[block_hash] = slot
        self.num_offloaded_pages += 1
        return slot

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._slot_of_hash.get(block_hash)
        if slot is not None:
            self._slot_of_hash.move_to_end(block_hash)
        return slot
