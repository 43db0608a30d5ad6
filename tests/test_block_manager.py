"""Block manager and scheduler bookkeeping, without a model: pages never leak or double-free."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import ROOT_HASH, BlockManager, HostBlockPool, hash_block
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus


def make_seq(request_id: str, tokens: list[int], max_tokens: int = 4, **kwargs: object) -> Sequence:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Sequence(request_id, list(tokens), sampling, arrival_s=0.0, **kwargs)  # type: ignore[arg-type]


def test_allocate_and_free_return_every_page() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2)  # 12 tokens still fit in 3 pages
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    bm.check_invariants([])


def test_allocation_fails_without_partial_grab() -> None:
    bm = BlockManager(2, 4)
    seq = make_seq("a", list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_shares_full_blocks_and_counts_references() -> None:
    bm = BlockManager(16, 4)
    first = make_seq("a", list(range(10)))
    assert bm.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    bm.register_full_blocks(first)  # blocks 0-1 full, block 2 partial
    second = make_seq("b", [*range(8), 99, 98, 97])
    assert bm.match_prefix(second).num_tokens == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.ref_counts[b] for b in second.block_table] == [2, 2]
    bm.free(first)
    assert [bm.ref_counts[b] for b in second.block_table] == [1, 1]
    bm.check_invariants([second])


def test_blocks_of_tokens_not_yet_known_are_not_published() -> None:
    """A block whose last token is a pick still on the device (async scheduling) waits:
    its hash needs the token."""
    bm = BlockManager(8, 4)
    seq = make_seq("a", list(range(7)))
    assert bm.allocate_slots(seq, 8)
    seq.output_token_ids.append(PENDING_TOKEN)  # the 8th token: sampled, not yet seen
    seq.num_pending_tokens = 1
    seq.num_computed_tokens = 8
    bm.register_full_blocks(seq)
    assert seq.num_registered_blocks == 1 and bm.num_cached_blocks == 1
    seq.output_token_ids[-1], seq.num_pending_tokens = 42, 0
    bm.register_full_blocks(seq)
    assert seq.num_registered_blocks == 2 and bm.num_cached_blocks == 2


def test_blocks_a_chunk_fills_and_the_first_one_missing() -> None:
    bm = BlockManager(16, 4)
    first = make_seq("a", list(range(14)))
    assert bm.allocate_slots(first, 6)
    # tokens 0-5 fill block 0 only; 4 more (6-9) fill block 1, not 2
    assert bm.hashes_filled(first, 6) == [hash_block(ROOT_HASH, [0, 1, 2, 3])]
    first.num_computed_tokens = 6
    assert bm.hashes_filled(first, 4) == first.block_hashes[1:2]
    second = make_seq("b", [*range(12), 99])
    assert bm.first_uncached_hash(second) == hash_block(ROOT_HASH, [0, 1, 2, 3])
    bm.register_full_blocks(first)  # block 0
    assert bm.first_uncached_hash(second) == first.block_hashes[1]
    assert bm.num_prefix_queries == 0  # looked at, not counted
    off = BlockManager(16, 4, enable_prefix_caching=False)
    assert off.first_uncached_hash(second) is None and off.hashes_filled(first, 4) == []


def test_freed_cached_blocks_are_revived_then_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    seq = make_seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(seq, 5)
    seq.num_computed_tokens = 5
    bm.register_full_blocks(seq)
    cached = seq.block_table[:2]
    bm.free(seq)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    again = make_seq("b", [1, 2, 3, 4, 5, 6])
    assert bm.match_prefix(again).num_tokens == 4 and again.block_table == cached
    bm.free(again)
    # Taking every page evicts the cached ones: a later lookup misses.
    hog = make_seq("c", list(range(100, 108)))
    assert bm.allocate_slots(hog, 8)
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq("d", [1, 2, 3, 4, 5])).num_tokens == 0


def test_match_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq("a", list(range(8)))
    assert bm.allocate_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.register_full_blocks(seq)
    same = make_seq("b", list(range(8)))
    assert bm.match_prefix(same).num_tokens == 4  # the second page is recomputed to get logits


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    root = hash_block(b"root", [1, 2])
    assert hash_block(root, [3, 4]) != hash_block(hash_block(b"root", [9, 2]), [3, 4])


def test_tenant_pages_and_quota() -> None:
    bm = BlockManager(16, 4, tenant_page_quotas={"a": 2})
    seq = make_seq("x", list(range(8)), tenant="a")
    assert bm.allocate_slots(seq, 8)
    assert bm.tenant_pages["a"] == 2
    assert bm.tenant_over_quota("a", 1) and not bm.tenant_over_quota("b", 10)
    bm.free(seq)
    assert bm.tenant_pages["a"] == 0


def test_host_pool_round_trip() -> None:
    pool = HostBlockPool(3)
    got = pool.allocate(2)
    assert got is not None and len(set(got)) == 2
    assert pool.allocate(2) is None
    pool.free(got)
    assert pool.num_free_blocks == 3


# -- the scheduler and block manager under random traffic ---------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random add / step / abort traffic; after every rule each page is free or owned."""

    @initialize(
        block_size=st.sampled_from([2, 4, 8]),
        num_blocks=st.integers(6, 24),
        preemption=st.sampled_from(["recompute", "swap"]),
        num_host_blocks=st.integers(0, 12),
        prefix_caching=st.booleans(),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        preemption: str,
        num_host_blocks: int,
        prefix_caching: bool,
    ) -> None:
        self.max_len = num_blocks * block_size // 2  # one sequence always fits
        config = EngineConfig(
            max_seqs=4, max_batched_tokens=16, prefill_chunk=8, preemption=preemption,  # type: ignore[arg-type]
            tenant_page_quotas={"t1": max(2, num_blocks // 3)},
        )  # fmt: skip
        self.bm = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=prefix_caching,
            tenant_page_quotas=config.tenant_page_quotas,
        )
        self.host = HostBlockPool(num_host_blocks)
        self.scheduler = Scheduler(config, self.bm, self.host)
        self.added: set[str] = set()
        self.finished: set[str] = set()
        self.counter = 0
        self.clock_s = 0.0

    @rule(
        prefix=st.sampled_from([[], [7, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 50), min_size=1, max_size=10),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 2),
        tenant=st.sampled_from(["t1", "t2"]),
        timeout=st.one_of(st.none(), st.floats(0.5, 5.0)),
    )
    def add(
        self,
        prefix: list[int],
        tail: list[int],
        max_tokens: int,
        priority: int,
        tenant: str,
        timeout: float | None,
    ) -> None:
        tokens = (prefix + tail)[: max(0, self.max_len - max_tokens)]
        if not tokens:
            return
        self.counter += 1
        request_id = f"r{self.counter}"
        deadline = None if timeout is None else self.clock_s + timeout
        seq = make_seq(request_id, tokens, max_tokens, priority=priority, tenant=tenant)
        seq.arrival_s, seq.deadline_s = self.clock_s, deadline
        self.scheduler.add(seq)
        self.added.add(request_id)

    @rule()
    def step(self) -> None:
        self.clock_s += 1.0
        batch = self.scheduler.schedule(self.clock_s)
        self.finished.update(seq.request_id for seq in batch.finished)
        for entry in batch.scheduled:
            seq = entry.seq
            samples = entry.samples
            seq.num_computed_tokens += entry.num_new_tokens
            self.bm.register_full_blocks(seq)
            if samples:
                seq.output_token_ids.append(seq.num_tokens % 51)
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    self.scheduler.finish(seq, FinishReason.LENGTH)
                    self.finished.add(seq.request_id)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(pick=st.integers(0, 1000))
    def preempt(self, pick: int) -> None:
        # What schedule() does when pages run out, forced on any running sequence. The swap
        # copies it would order are not executed: this machine checks accounting only.
        seq = self.scheduler.running[pick % len(self.scheduler.running)]
        self.scheduler._preempt(seq, ScheduledBatch())
        assert seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED)

    @precondition(lambda self: self.scheduler.num_unfinished > 0)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        seqs = self.scheduler.all_sequences()
        seq = seqs[pick % len(seqs)]
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        self.finished.add(seq.request_id)

    @invariant()
    def pages_free_or_owned(self) -> None:
        if not hasattr(self, "bm"):
            return
        live = self.scheduler.all_sequences()
        self.bm.check_invariants(live)
        held = Counter[str]()
        for seq in live:
            held[seq.tenant] += len(seq.block_table)
            if seq.status is not SequenceStatus.RUNNING:
                assert not seq.block_table, f"{seq.status} sequence holds pages"
        assert +held == +self.bm.tenant_pages
        swapped_pages = sum(len(s.swapped_blocks) for s in self.scheduler.swapped)
        assert self.host.num_free_blocks + swapped_pages == self.host.num_blocks

    @invariant()
    def nothing_dropped(self) -> None:
        if not hasattr(self, "bm"):
            return
        live = {seq.request_id for seq in self.scheduler.all_sequences()}
        assert live | self.finished == self.added
        assert not live & self.finished

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        # Drain: with no new traffic every sequence finishes and every page comes back.
        for _ in range(500):
            if not self.scheduler.num_unfinished:
                break
            self.step()
        assert self.scheduler.num_unfinished == 0, "a sequence never finished"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not self.bm.tenant_pages


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_pool_machine = PoolMachine.TestCase


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_small_pool_preempts_and_still_finishes_everyone(preemption: str) -> None:
    config = EngineConfig(max_seqs=8, max_batched_tokens=64, preemption=preemption)  # type: ignore[arg-type]
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    host = HostBlockPool(16)
    scheduler = Scheduler(config, bm, host)
    for index in range(6):
        scheduler.add(make_seq(f"r{index}", [index] * 6, max_tokens=8))
    finished = 0
    for _ in range(300):
        batch = scheduler.schedule(0.0)
        for entry in batch.scheduled:
            samples = entry.samples
            entry.seq.num_computed_tokens += entry.num_new_tokens
            if samples:
                entry.seq.output_token_ids.append(1)
                if entry.seq.num_output_tokens == 8:
                    scheduler.finish(entry.seq, FinishReason.LENGTH)
                    finished += 1
        bm.check_invariants(scheduler.all_sequences())
        if not scheduler.num_unfinished:
            break
    assert finished == 6
    assert scheduler.num_preemptions > 0
    assert bm.num_free_blocks == 8 and host.num_free_blocks == 16
