"""Continuous batching: which sequences run this step, and with how many tokens each.

Each step spends a token budget (``max_batched_tokens``) on running decodes first, then on
prefill chunks of partly prefilled sequences, then on resuming swapped sequences, then on
admitting waiting ones, in priority order (lower ``priority`` first, then arrival). When
pages run out the lowest-priority, newest running sequence is preempted: its pages are freed
and it is requeued (``recompute``) or copied to host memory (``swap``). Nothing is dropped.
A waiting sequence that outranks running ones (a lower ``priority``) does not wait for pages:
it preempts the lowest-priority, newest of them and is admitted first (vLLM's priority policy).

A waiting sequence whose first uncached block another sequence computes in this very step
waits a step (SGLang's in-batch prefix caching): the engine publishes the block once the step
is launched, and the sequence then reads it instead of computing it again. Without this, 256
requests sharing a 2,048-token system prompt computed it about 20 times over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager, HostBlockPool
from engine.config import EngineConfig
from engine.kv_offload import PageMove
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # the drafts included
    # Draft tokens run after the sequence's last token (a decode step that verifies them)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so a token is sampled."""
        num_real = self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.num_computed_tokens + num_real == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) pages
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) pages
    # host prefix-tier copies, in the order decided (run between swap_out and swap_in)
    page_transfers: list[PageMove] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # timed out this step
    # (parent, sample) for samples that start this step (n > 1): each takes its first token
    # from the parent's logits row, as the parent's last prompt token runs now
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_new_tokens for entry in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_s)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, host_pool: HostBlockPool):
        self.config = config
        self.block_manager = block_manager
        self.host_pool = host_pool
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        # Tokens not recomputed at admission (re-admissions too), by where their KV was found.
        self.num_device_hit_tokens = 0
        self.num_host_hit_tokens = 0
        # Seats of running sequences' samples that have not forked yet (see ``fork``)
        self.num_reserved_seats = 0
        # Hashes of the blocks this step's chunks fill (``_note_filled``, ``_try_admit``)
        self._filled: set[bytes] = set()
        # Admissions put off to the next step because of them
        self.num_deferred_admissions = 0

    # -- queues ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def all_sequences(self) -> list[Sequence]:
        return self.waiting + self.running + self.swapped

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.all_sequences() if s.request_id == request_id), None)

    def find_all(self, request_id: str) -> list[Sequence]:
        """Every queued sample of a request (one unless it asked for n > 1)."""
        return [s for s in self.all_sequences() if s.request_id == request_id]

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of every queue and free its pages now."""
        if seq in self.running:
            self._leave_running(seq)
        for queue in (self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status is SequenceStatus.SWAPPED:
            self.host_pool.free(seq.swapped_blocks)
            seq.swapped_blocks = []
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._filled.clear()
        self._expire_deadlines(now_s, batch)
        budget = self.config.max_batched_tokens
        budget -= self._admit_outranking(budget, batch)
        admitted = {id(entry.seq) for entry in batch.scheduled}
        self.running.sort(key=_order)
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            if seq.awaits_last_token or id(seq) in admitted:
                continue  # its last token is in flight: the sequence ends when it lands
            (decodes if seq.num_uncomputed_tokens == 1 else prefills).append(seq)
        # The common decode step needs no page (the last one has room) and no quota check.
        fast = not self.block_manager.tenant_page_quotas
        page = self.block_manager.block_size
        # Draft tokens only take budget that every decode's own token leaves over.
        spare = budget - len(decodes)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step to make room
            if seq.draft_token_ids and spare > 0 and self._schedule_drafts(seq, spare, batch):
                num_drafts = len(batch.scheduled[-1].draft_token_ids)
                spare -= num_drafts
                budget -= 1 + num_drafts
                continue
            room = seq.num_computed_tokens < len(seq.block_table) * page
            if fast and room and seq.num_uncomputed_tokens == 1 and not seq.shares_tail_page:
                batch.scheduled.append(ScheduledSeq(seq, 1))
                budget -= 1
                continue
            budget -= self._schedule_running(seq, budget, batch)
        if batch.num_preempted == 0:  # (preemptions for priority leave the pool full too)
            budget -= self._resume_swapped(budget, batch)
            self._admit_waiting(budget, batch)
        # Decodes first: the attention backend batches the leading single-token queries.
        batch.scheduled.sort(key=lambda entry: entry.num_new_tokens > 1)
        self._fork_samples(batch)
        batch.page_transfers = self.block_manager.take_transfers()
        return batch

    def _fork_samples(self, batch: ScheduledBatch) -> None:
        """Start the other samples of each request whose last prompt token runs this step:
        they share its pages (``BlockManager.fork``) and sample from its logits row."""
        for entry in batch.scheduled:
            parent = entry.seq
            if not parent.forks or not entry.samples:
                continue
            num_tokens = parent.num_computed_tokens + entry.num_new_tokens
            for child in parent.forks:
                self.block_manager.fork(parent, child, num_tokens)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                batch.forks.append((parent, child))
            self.num_reserved_seats -= len(parent.forks)
            parent.forks = []

    def _expire_deadlines(self, now_s: float, batch: ScheduledBatch) -> None:
        for seq in self.all_sequences():
            if seq.deadline_s is not None and now_s >= seq.deadline_s:
                self.finish(seq, FinishReason.TIMEOUT)
                batch.finished.append(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_uncomputed_tokens, self.config.prefill_chunk, budget)

    def _schedule_running(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        num_new = self._chunk(seq, budget)
        while not self._try_allocate(seq, num_new, allow_over_quota=True):
            victim = self._pick_victim(seq, batch)
            self._preempt(victim, batch)
            if victim is seq:
                return 0
        batch.scheduled.append(ScheduledSeq(seq, num_new))
        self._note_filled(seq, num_new)
        return num_new

    def _note_filled(self, seq: Sequence, num_new: int) -> None:
        """Note the blocks a chunk of ``seq`` fills this step, while sequences wait that may
        share them."""
        if num_new > 1 and self.waiting:
            self._filled.update(self.block_manager.hashes_filled(seq, num_new))

    def _schedule_drafts(self, seq: Sequence, spare: int, batch: ScheduledBatch) -> bool:
        """Schedule a decode with up to ``spare`` of its drafts, if their pages are free;
        never preempts for drafts (the caller then schedules a plain decode)."""
        drafts = seq.draft_token_ids[:spare]
        num_new = 1 + len(drafts)
        if seq.num_uncomputed_tokens != 1 or not self._try_allocate(
            seq, num_new, allow_over_quota=False
        ):
            return False
        batch.scheduled.append(ScheduledSeq(seq, num_new, drafts))
        return True

    def _try_allocate(self, seq: Sequence, num_new: int, allow_over_quota: bool) -> bool:
        if not self.block_manager.tenant_page_quotas:  # no quotas: only the pool can say no
            return self.block_manager.allocate_slots(seq, num_new)
        needed = self.block_manager.num_blocks_needed(seq, num_new)
        over_quota = self.block_manager.tenant_over_quota(seq.tenant, needed)
        if over_quota and not (allow_over_quota and self._is_tenants_only_running(seq)):
            return False
        return self.block_manager.allocate_slots(seq, num_new)

    def _is_tenants_only_running(self, seq: Sequence) -> bool:
        # A tenant's quota caps its concurrency, never a lone sequence's progress.
        return all(other is seq or other.tenant != seq.tenant for other in self.running)

    def _pick_victim(self, seq: Sequence, batch: ScheduledBatch) -> Sequence:
        """Lowest priority, newest running sequence not yet scheduled this step (or ``seq``)."""
        scheduled = {id(entry.seq) for entry in batch.scheduled}
        needed = self.block_manager.num_blocks_needed(seq, 1)
        quota_bound = self.block_manager.tenant_over_quota(seq.tenant, needed)
        candidates = [
            s
            for s in self.running
            if id(s) not in scheduled
            and s is not seq
            and (not quota_bound or s.tenant == seq.tenant)
            and _order(s) >= _order(seq)
        ]
        return max(candidates, key=_order) if candidates else seq

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._leave_running(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.config.preemption == "swap" and self._swap_out(seq, batch):
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _swap_out(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        # Only computed pages carry KV worth keeping.
        num_kept = -(-seq.num_computed_tokens // self.block_manager.block_size)
        host_blocks = self.host_pool.allocate(num_kept)
        if host_blocks is None:
            return False  # host pool full: fall back to recompute
        batch.swap_out.extend(zip(seq.block_table[:num_kept], host_blocks, strict=True))
        self.block_manager.free(seq)
        seq.swapped_blocks = host_blocks
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        return True

    def _resume_swapped(self, budget: int, batch: ScheduledBatch) -> int:
        used = 0
        self.swapped.sort(key=_order)
        for seq in list(self.swapped):
            seats = len(self.running) + self.num_reserved_seats
            if budget - used == 0 or seats >= self.config.max_seqs:
                break
            blocks = self.block_manager.allocate_blocks(seq.tenant, len(seq.swapped_blocks))
            if blocks is None:
                break
            seq.block_table = list(blocks)
            num_new = self._chunk(seq, budget - used)
            if not self._try_allocate(seq, num_new, allow_over_quota=True):
                self.block_manager.free(seq)
                break
            batch.swap_in.extend(zip(seq.swapped_blocks, blocks, strict=True))
            self.host_pool.free(seq.swapped_blocks)
            seq.swapped_blocks = []
            self._start_running(seq, self.swapped)
            batch.scheduled.append(ScheduledSeq(seq, num_new))
            self._note_filled(seq, num_new)
            used += num_new
        return used

    def _admit_waiting(self, budget: int, batch: ScheduledBatch) -> None:
        for seq in sorted(self.waiting, key=_order):
            seats = len(self.running) + self.num_reserved_seats + len(seq.forks)
            if budget == 0 or seats >= self.config.max_seqs:
                break
            used = self._try_admit(seq, budget, batch)
            if used is None:
                break  # pool full: later arrivals must not overtake this one
            budget -= used

    def _try_admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int | None:
        """Admit ``seq`` with its first chunk; the tokens it takes (0: skipped, over its
        tenant's quota or waiting for a block this step fills), or None when the pool has no
        room."""
        if self._filled and self.block_manager.first_uncached_hash(seq) in self._filled:
            self.num_deferred_admissions += 1
            return 0
        hit = self.block_manager.match_prefix(seq)
        if seq.num_preemptions == 0 and not seq.output_token_ids:
            seq.num_cached_tokens = hit.num_tokens
        num_new = self._chunk(seq, budget)
        needed = self.block_manager.num_blocks_needed(seq, num_new)
        over_quota = self.block_manager.tenant_over_quota(seq.tenant, needed)
        if over_quota and any(other.tenant == seq.tenant for other in self.running):
            self._unadmit(seq)
            return 0  # other tenants may still fit
        if not self.block_manager.allocate_slots(seq, num_new):
            self._unadmit(seq)
            return None
        self._start_running(seq, self.waiting)
        self.num_device_hit_tokens += hit.device_tokens
        self.num_host_hit_tokens += hit.host_tokens
        batch.scheduled.append(ScheduledSeq(seq, num_new))
        self._note_filled(seq, num_new)
        return num_new

    def _admit_outranking(self, budget: int, batch: ScheduledBatch) -> int:
        """Priority preemption: a waiting sequence that outranks running ones (a strictly
        lower ``priority``) and finds the pool (or ``max_seqs``) full takes the place of the
        lowest-priority, newest of them, before anything else is scheduled. Equal priorities
        never preempt each other here: among them arrival order holds. Returns the tokens
        the admitted sequences take."""
        used = 0
        for seq in sorted(self.waiting, key=_order):
            if budget - used == 0 or not self._outranked_by(seq):
                break  # sorted: no later waiting sequence outranks anyone either
            while True:
                taken = None
                if len(self.running) < self.config.max_seqs:
                    taken = self._try_admit(seq, budget - used, batch)
                if taken is not None:
                    used += taken
                    break
                victims = self._outranked_by(seq)
                if not victims:
                    return used  # no room can be made: it waits, and so do those after it
                self._preempt(max(victims, key=_order), batch)
        return used

    def _outranked_by(self, seq: Sequence) -> list[Sequence]:
        """Running sequences ``seq`` may preempt: lower priority, not ending this step."""
        return [s for s in self.running if s.priority > seq.priority and not s.awaits_last_token]

    def _unadmit(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # give back prefix-cache hits; retried next step
        seq.num_computed_tokens = 0

    def _start_running(self, seq: Sequence, queue: list[Sequence]) -> None:
        queue.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.num_reserved_seats += len(seq.forks)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.num_reserved_seats -= len(seq.forks)
