"""A step's token bitmasks: filled on the host once every grammar has seen its tokens (the
forward is running on the device meanwhile, and the engine's other host work may go on beside
the fill), then applied to the logits on the device."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.structured.grammars import accept_one_by_one
from kernels.sampling.token_bitmask import apply_token_bitmask_ref, num_mask_words

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq
    from engine.structured.grammars import GrammarMatcher

MAX_FILL_THREADS = 16  # llguidance's threads filling a step's masks in parallel
PAR_ACCEPT_MIN_ROWS = 16  # fewer rows take their tokens one call each (no pool hand-off)


@dataclass(frozen=True)
class MaskedRow:
    """Logits rows ``[first_row, first_row + len(draft_token_ids)]`` of one constrained
    sequence: its next token, then one row after each of its draft tokens."""

    first_row: int
    grammar: GrammarMatcher
    draft_token_ids: list[int]


def masked_rows(
    sampling_entries: list[ScheduledSeq], draft_entries: list[ScheduledSeq]
) -> list[MaskedRow]:
    """The constrained rows of a step's logits ([S sampling rows, then each draft entry's
    k + 1 positions]); ended sequences and finished grammars need no mask."""
    rows = []
    for row, entry in enumerate(sampling_entries):
        grammar = entry.seq.grammar
        if grammar is not None and not entry.seq.is_finished and grammar.is_usable:
            rows.append(MaskedRow(row, grammar, []))
    row = len(sampling_entries)
    for entry in draft_entries:
        grammar = entry.seq.grammar
        if grammar is not None and not entry.seq.is_finished and grammar.is_usable:
            rows.append(MaskedRow(row, grammar, list(entry.draft_token_ids)))
        row += len(entry.draft_token_ids) + 1
    return rows


def has_grammar(entries: list[ScheduledSeq]) -> bool:
    return any([entry.seq.grammar is not None for entry in entries])  # a list: no genexpr


@dataclass
class _FillJob:
    """One step's masks to fill: the pinned buffer they go to and llguidance's arguments."""

    bitmask: torch.Tensor  # [M, W] int32
    row_index: torch.Tensor  # [M] int64: each mask's logits row
    plain: list[tuple[Any, int]]  # (matcher, mask index)
    drafted: list[tuple[Any, int, list[int]]]  # (matcher, index of its first mask, drafts)


@dataclass
class _PendingFill:
    """A fill running on the mask thread, for the step of these entries."""

    sampling_entries: list[ScheduledSeq]
    draft_entries: list[ScheduledSeq]
    done: Future[_FillJob]


class GrammarMasks:
    """Fills and applies the bitmasks of a step's constrained rows.

    ``start`` begins a step's fill on a thread of its own (llguidance computes the masks on its
    pool without the GIL), so the engine's other host work goes on meanwhile; ``apply`` waits
    for it, or fills then if nothing was started.
    """

    def __init__(
        self, vocab_size: int, device: torch.device, num_threads: int | None = None
    ) -> None:
        self.num_words = num_mask_words(vocab_size)
        self.device = device
        self.num_threads = num_threads or default_fill_threads()
        self._executor: Any = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: _PendingFill | None = None
        # host time spent filling masks, the part of it a step waited for, and how many steps
        # needed masks (benchmarks read them)
        self.fill_s = 0.0
        self.wait_s = 0.0
        self.num_fills = 0
        self.num_started = 0  # fills begun by ``start``, beside other host work

    def start(
        self, sampling_entries: list[ScheduledSeq], draft_entries: list[ScheduledSeq]
    ) -> None:
        """Begin filling the masks of a step whose grammars have every earlier token. Until
        ``apply`` the matchers are llguidance's: nothing else may touch them."""
        self._drop_pending()
        rows = masked_rows(sampling_entries, draft_entries)
        if not rows:
            return
        job = self._prepare(rows)
        started = threading.Event()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        done = self._thread.submit(self._compute, job, started)
        # let it take the GIL at once: it reads its arguments, then drops the GIL for the fill
        started.wait()
        self._pending = _PendingFill(sampling_entries, draft_entries, done)
        self.num_started += 1

    @torch.inference_mode()  # the logits are inference tensors, whoever calls
    def apply(
        self,
        logits: torch.Tensor,
        sampling_entries: list[ScheduledSeq],
        draft_entries: list[ScheduledSeq],
    ) -> None:
        """In place on ``logits`` [S + N, V]: -inf for every token a row's grammar forbids."""
        start_s = time.perf_counter()
        job = self._take_pending(sampling_entries, draft_entries)
        if job is None:
            rows = masked_rows(sampling_entries, draft_entries)
            if not rows:
                return
            job = self._compute(self._prepare(rows))
        self.wait_s += time.perf_counter() - start_s
        self.num_fills += 1
        on_device = job.bitmask.to(self.device, non_blocking=True)
        index = job.row_index.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            from kernels.sampling.token_bitmask_triton import apply_token_bitmask

            apply_token_bitmask(logits, on_device, index)
        else:
            apply_token_bitmask_ref(logits, on_device, index)

    def fill(self, rows: list[MaskedRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, W] int32 bitmasks of ``rows`` (drafts included) and [M] their logits rows."""
        job = self._compute(self._prepare(rows))
        return job.bitmask, job.row_index

    def _take_pending(
        self, sampling_entries: list[ScheduledSeq], draft_entries: list[ScheduledSeq]
    ) -> _FillJob | None:
        """The started fill of this step, once done; None if none was started for it."""
        pending = self._pending
        if pending is None:
            return None
        if pending.sampling_entries is not sampling_entries or (
            pending.draft_entries is not draft_entries
        ):
            self._drop_pending()  # another step's (one that failed before its sampling)
            return None
        self._pending = None
        return pending.done.result()

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.done.result()  # it writes into its buffer and holds the matchers
            self._pending = None

    def _prepare(self, rows: list[MaskedRow]) -> _FillJob:
        pin = self.device.type == "cuda"
        starts: list[int] = []
        row_index: list[int] = []
        num_masks = 0
        for row in rows:
            starts.append(num_masks)
            num_masks += len(row.draft_token_ids) + 1
            row_index += range(row.first_row, row.first_row + len(row.draft_token_ids) + 1)
        return _FillJob(
            bitmask=torch.empty(num_masks, self.num_words, dtype=torch.int32, pin_memory=pin),
            row_index=torch.tensor(row_index, dtype=torch.int64, pin_memory=pin),
            plain=[
                (r.grammar.matcher, s)
                for r, s in zip(rows, starts, strict=True)
                if not r.draft_token_ids
            ],
            drafted=[
                (r.grammar.matcher, s, r.draft_token_ids)
                for r, s in zip(rows, starts, strict=True)
                if r.draft_token_ids
            ],
        )

    def _compute(self, job: _FillJob, started: threading.Event | None = None) -> _FillJob:
        """Fill ``job``'s buffer. llguidance's executor writes each mask at pointer + index *
        bytes per mask, on its threads, without the GIL. (Its llguidance.torch wrappers do
        the same, but importing that module compiles a torch function: seconds at the first
        step.)"""
        start_s = time.perf_counter()
        executor = self._get_executor()
        if started is not None:
            started.set()
        pointer, mask_bytes, num_masks = (
            job.bitmask.data_ptr(),
            self.num_words * 4,
            len(job.bitmask),
        )
        if job.plain:
            executor.unsafe_compute_mask_ptr(job.plain, pointer, mask_bytes, num_masks)
        if job.drafted:  # each draft is consumed for the mask after it, then rolled back
            executor.unsafe_compute_mask_ptr_with_draft_token(
                job.drafted, pointer, mask_bytes, num_masks
            )
        self.fill_s += time.perf_counter() - start_s
        return job

    def accept_tokens(self, pairs: list[tuple[GrammarMatcher, int]]) -> list[bool]:
        """Each grammar takes its token (False: it refused it), on llguidance's pool without
        the GIL when there are ``PAR_ACCEPT_MIN_ROWS`` or more: one call a row took 0.8-1.6
        ms of the step's path at 256 rows."""
        if len(pairs) < PAR_ACCEPT_MIN_ROWS:
            return accept_one_by_one(pairs)
        matchers = [(grammar.matcher, token_id) for grammar, token_id in pairs]
        return [bool(ok) for ok in self._get_executor().consume_token_par(matchers)]

    def _get_executor(self) -> Any:
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.num_threads)
        return self._executor


def default_fill_threads() -> int:
    """Three cores in four, at most ``MAX_FILL_THREADS``; the rest stay with the engine's and
    the worker's threads. With a lexer per matcher the fill scales: 256 masks took 32 ms on
    one thread of a 32-core Xeon, 5.2 on 8, 4.1 on 12, 3.2 on 16 (bench/mask_fill.py)."""
    return max(1, min(MAX_FILL_THREADS, (os.cpu_count() or 2) * 3 // 4))
