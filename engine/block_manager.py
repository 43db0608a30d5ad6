"""The page pool's bookkeeping: free list, reference counts, block tables, prefix cache.

Pure accounting, no tensors: the KV cache tensors live in ``engine.kv_cache`` and are indexed
by the block ids handed out here. A block is *owned* while its reference count is > 0. Blocks
with count 0 sit in one LRU free queue; those that still hold a full, hashed block of tokens
can be revived by a prefix-cache hit until they are handed out again (evicted). With a host
tier (``engine.kv_offload``) an evicted block's page is saved there first, and a prefix that
misses the device cache goes on matching in the host tier.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Mapping

from engine.kv_offload import HostPrefixCache, PageCopy, PageMove, PageTransfer, PrefixHit
from engine.sequence import Sequence

ROOT_HASH = b"pagestream-prefix-root"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: equal hashes mean equal prefixes, whole-prefix."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Hands out fixed-size KV pages to sequences and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        tenant_page_quotas: Mapping[str, int] | None = None,
        host_cache: HostPrefixCache | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tenant_page_quotas = dict(tenant_page_quotas or {})
        self.ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        # Front = least recently freed; cached blocks freed last are evicted last.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tenant_pages: Counter[str] = Counter()
        self.num_prefix_queries = 0  # blocks looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, found (on the device or in the host tier)
        self.host_cache = host_cache
        self._transfers: list[PageMove] = []  # decided since the last take_transfers()

    # -- queries --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def tenant_over_quota(self, tenant: str, num_new_blocks: int) -> bool:
        quota = self.tenant_page_quotas.get(tenant)
        return quota is not None and self.tenant_pages[tenant] + num_new_blocks > quota

    # -- allocation -----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """Attach cached blocks of ``seq``'s leading full blocks; returns the tokens reused.

        Each block is looked up on the device, then in the host tier, whose hits get a fresh
        page and a restore copy (see ``take_transfers``). At least one token is left to
        compute, since the step must produce logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return PrefixHit()
        num_host_blocks = 0
        for block_hash in self._matchable_hashes(seq):
            self.num_prefix_queries += 1
            block = self._block_of_hash.get(block_hash)
            if block is not None:
                self._acquire(block)
            else:
                block = self._restore_from_host(block_hash)
                if block is None:
                    break
                num_host_blocks += 1
            self.num_prefix_hits += 1
            seq.block_table.append(block)
        self.tenant_pages[seq.tenant] += len(seq.block_table)
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        host_tokens = num_host_blocks * self.block_size
        return PrefixHit(seq.num_computed_tokens - host_tokens, host_tokens)

    def take_transfers(self) -> list[PageMove]:
        """Host-tier and copy-on-write copies decided since the last call, in the order they
        must run."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens, if pages allow;
        a partial last page shared with other samples is copied first (copy-on-write)."""
        num_needed = self.num_blocks_needed(seq, num_new_tokens)
        if num_needed == 0 and not seq.shares_tail_page:
            return True  # the common decode step: the last page has room
        copies_tail = seq.shares_tail_page and self._tail_is_shared(seq)
        if num_needed + copies_tail > len(self._free):
            return False
        if seq.shares_tail_page:
            if copies_tail:
                self._copy_tail(seq)
            seq.shares_tail_page = False  # the last sharer writes the page in place
        for _ in range(num_needed):
            seq.block_table.append(self._pop_free())
        self.tenant_pages[seq.tenant] += num_needed
        return True

    def allocate_blocks(self, tenant: str, num_blocks: int) -> list[int] | None:
        """Fresh blocks not tied to token content (swap-in); None if the pool is short."""
        if num_blocks > len(self._free):
            return None
        self.tenant_pages[tenant] += num_blocks
        return [self._pop_free() for _ in range(num_blocks)]

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its last blocks go to the back of the LRU queue."""
        self.release_blocks(seq.tenant, seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.shares_tail_page = False

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """``child`` (a sample of ``parent``'s request, nothing computed yet) takes
        references to ``parent``'s pages of its first ``num_tokens`` tokens, which count as
        computed for it: the prompt's KV is shared, not recomputed. Full pages are only ever read again; a partial last page
        is copied by whichever sharer writes it first (``allocate_slots``)."""
        num_pages = -(-num_tokens // self.block_size)
        pages = parent.block_table[:num_pages]
        for block in pages:
            self.ref_counts[block] += 1
        child.block_table = list(pages)
        child.num_computed_tokens = num_tokens
        self.tenant_pages[child.tenant] += len(pages)
        if num_tokens % self.block_size:
            parent.shares_tail_page = child.shares_tail_page = True

    def trim(self, seq: Sequence) -> None:
        """Free ``seq``'s trailing blocks past its tokens: pages taken for draft tokens that
        were rejected. Such blocks hold no full block of computed tokens, so none is cached."""
        num_kept = -(-seq.num_tokens // self.block_size)
        if len(seq.block_table) > num_kept:
            self.release_blocks(seq.tenant, seq.block_table[num_kept:])
            del seq.block_table[num_kept:]

    def release_blocks(self, tenant: str, blocks: list[int]) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # should be evicted before its head blocks.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None
        self.tenant_pages[tenant] -= len(blocks)
        if self.tenant_pages[tenant] == 0:
            del self.tenant_pages[tenant]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish ``seq``'s newly filled blocks in the prefix cache: those whose tokens are
        computed, or launched (a later step's forward runs after that step's, and a step writes
        every new token's K/V before any attention reads the pages), and known on the host (a
        token sampled by a step still in flight is not)."""
        num_ready = min(seq.num_computed_tokens, seq.num_known_tokens)
        num_full = min(num_ready // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return  # caching off, or no block filled since the last call
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            block_hash = seq.block_hashes[index]
            block = seq.block_table[index]
            # Two sequences may compute the same block at once; the first one is kept.
            if block_hash not in self._block_of_hash and self._hash_of[block] is None:
                self._block_of_hash[block_hash] = block
                self._hash_of[block] = block_hash
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def hashes_filled(self, seq: Sequence, num_new_tokens: int) -> list[bytes]:
        """The hashes of the blocks that a step computing ``num_new_tokens`` more of ``seq``'s
        tokens fills (of known tokens only); none with caching off."""
        if not self.enable_prefix_caching:
            return []
        end = min(seq.num_computed_tokens + num_new_tokens, seq.num_known_tokens)
        end //= self.block_size
        self._extend_hashes(seq, end)
        return seq.block_hashes[seq.num_computed_tokens // self.block_size : end]

    def first_uncached_hash(self, seq: Sequence) -> bytes | None:
        """The hash of the first of ``seq``'s full blocks (the last token left out, as
        ``match_prefix`` leaves it) that the device cache lacks; None if it holds them all or
        caching is off. Nothing is acquired or counted."""
        if not self.enable_prefix_caching:
            return None
        for block_hash in self._matchable_hashes(seq):
            if block_hash not in self._block_of_hash:
                return block_hash
        return None

    # -- internals ------------------------------------------------------------------------

    def _tail_is_shared(self, seq: Sequence) -> bool:
        """Whether the page ``seq`` writes its next token into is partial and shared."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return (
            offset != 0
            and index < len(seq.block_table)
            and (self.ref_counts[seq.block_table[index]] > 1)
        )

    def _copy_tail(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[index]
        own = self._pop_free()
        self._transfers.append(PageCopy(shared, own))
        self.ref_counts[shared] -= 1  # still held by another sample
        seq.block_table[index] = own

    def _matchable_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of ``seq``'s full blocks but for its last token, which a step must
        compute for its logits: what a prefix match may find."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        return seq.block_hashes[:max_blocks]

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        for index in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[index - 1] if index else ROOT_HASH
            seq.block_hashes.append(hash_block(parent, seq.token_ids(index * bs, (index + 1) * bs)))

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        evicted = self._hash_of[block]
        if evicted is not None:
            del self._block_of_hash[evicted]
            self._hash_of[block] = None
            slot = self.host_cache.save(evicted) if self.host_cache is not None else None
            if slot is not None:  # copied out before the page's next owner writes it
                self._transfers.append(PageTransfer(block, slot, to_host=True))
        self.ref_counts[block] = 1
        return block

    def _restore_from_host(self, block_hash: bytes) -> int | None:
        """A fresh page that will hold ``block_hash``'s KV from the host tier, or None."""
        if self.host_cache is None or not self._free:
            return None
        slot = self.host_cache.lookup(block_hash)  # now the most recently used entry
        if slot is None:
            return None
        block = self._pop_free()
        if block_hash not in self.host_cache:
            # Saving the popped page's old block took this very slot (a one-slot tier): the
            # slot now holds that block, and the page goes back unused.
            self.ref_counts[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)
            return None
        self._transfers.append(PageTransfer(block, slot, to_host=False))
        # Published at once: the copy runs before this step's forward, so a sequence that
        # matches it in the same step reads restored contents.
        self._block_of_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return block

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Every page free or owned, counts equal to the owners: for tests and debugging."""
        owners: Counter[int] = Counter()
        for seq in seqs:
            owners.update(seq.block_table)
        for block in range(self.num_blocks):
            count = self.ref_counts[block]
            assert count >= 0, f"block {block} has a negative count"
            assert count == owners[block], f"block {block}: count {count} != {owners[block]} owners"
            assert (count == 0) == (block in self._free), f"block {block} neither free nor owned"
        for block_hash, block in self._block_of_hash.items():
            assert self._hash_of[block] == block_hash, f"block {block} cache entry is stale"


class HostBlockPool:
    """Free list of host-memory pages that hold swapped-out sequences."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self._free):
            return None
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
