"""A step's token bitmasks: filled on the host once every grammar has seen its tokens (the
forward is running on the device meanwhile, and the engine's other host work may go on beside
the fill), then applied to the logits on the device."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.structured.grammars import accept_one_by_one
from kernels.sampling.token_bitmask import apply_token_bitmask_ref, num_mask_words

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq
    from engine.structured.grammars import GrammarMatcher

MAX_FILL_THREADS = 16  # llguidance's threads filling a step's masks in parallel
PAR_ACCEPT_MIN_ROWS = 16  # fewer rows take their tokens one call each (no pool hand-off)
MIN_BUFFER_MASKS = 64  # a host buffer's first size, in masks (doubled as needed)


class MaskedRow(NamedTuple):
    """Logits rows ``[first_row, first_row + len(draft_token_ids)]`` of one constrained
    sequence: its next token, then one row after each of its draft tokens. (A tuple: 256 of
    them are made a step, a third of the time of a frozen dataclass.)"""

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
class _HostBuffer:
    """Host memory for a step's masks and their logits rows (pinned on CUDA), kept from step
    to step; ``copied``: the device's copy out of it, which a refill must wait for. On CUDA
    the device's copies live in ``device_bitmask``/``device_rows`` (as large), written on the
    copy stream once ``applied`` (the main stream's last read of them) has passed."""

    bitmask: torch.Tensor  # [capacity, W] int32
    row_index: torch.Tensor  # [capacity] int64
    copied: torch.cuda.Event | None = None
    device_bitmask: torch.Tensor | None = None
    device_rows: torch.Tensor | None = None
    applied: torch.cuda.Event | None = None


class _HostBuffers:
    """Two ``_HostBuffer``s taken in turn, each grown (doubled) when a step needs more masks:
    one step's fill writes one while the other's copy to the device may still be queued.
    Allocating pinned memory and building an index tensor each step cost more host time."""

    def __init__(self, num_words: int, pin: bool) -> None:
        self.num_words = num_words
        self.pin = pin
        self._buffers: list[_HostBuffer | None] = [None, None]
        self._next = 0

    def take(self, row_index: list[int]) -> _HostBuffer:
        """The next buffer, with room for ``len(row_index)`` masks and those rows written."""
        num_masks = len(row_index)
        slot, self._next = self._next, 1 - self._next
        buffer = self._buffers[slot]
        if buffer is not None and buffer.copied is not None:
            buffer.copied.synchronize()  # a step ago or more: long done
            buffer.copied = None
        if buffer is None or len(buffer.row_index) < num_masks:
            capacity = max(MIN_BUFFER_MASKS, 1 << (num_masks - 1).bit_length())
            buffer = _HostBuffer(
                torch.empty(capacity, self.num_words, dtype=torch.int32, pin_memory=self.pin),
                torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin),
            )
            self._buffers[slot] = buffer
        buffer.row_index.numpy()[:num_masks] = row_index
        return buffer


@dataclass
class _FillJob:
    """One step's masks to fill: the host buffer they go to and llguidance's arguments."""

    buffer: _HostBuffer
    num_masks: int
    plain: list[tuple[Any, int]]  # (matcher, mask index)
    drafted: list[tuple[Any, int, list[int]]]  # (matcher, index of its first mask, drafts)

    @property
    def bitmask(self) -> torch.Tensor:  # [M, W] int32
        return self.buffer.bitmask[: self.num_masks]

    @property
    def row_index(self) -> torch.Tensor:  # [M] int64: each mask's logits row
        return self.buffer.row_index[: self.num_masks]


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
        self._buffers = _HostBuffers(self.num_words, pin=device.type == "cuda")
        self._copy_stream: torch.cuda.Stream | None = None  # on CUDA: the masks' copies
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
        if self.device.type == "cuda":
            self._apply_on_device(logits, job)
        else:
            apply_token_bitmask_ref(logits, job.bitmask, job.row_index)

    def _apply_on_device(self, logits: torch.Tensor, job: _FillJob) -> None:
        """Copy the masks to the device on a stream of their own, then apply them on the
        current one. This runs while the step's forward may still be on the device: in the
        current stream the copy (5 MB at 256 rows of a 152k vocabulary) waited behind the
        forward and then held the sampling up by about 0.1 ms a step (H100); on the copy
        stream it overlaps the forward."""
        from kernels.sampling.token_bitmask_triton import apply_token_bitmask

        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        copy_stream, buffer = self._copy_stream, job.buffer
        if (
            buffer.device_bitmask is None
            or buffer.device_rows is None
            or (len(buffer.device_rows) < len(buffer.row_index))
        ):
            buffer.device_bitmask = torch.empty_like(buffer.bitmask, device=self.device)
            buffer.device_rows = torch.empty_like(buffer.row_index, device=self.device)
            copy_stream.wait_stream(main)  # new memory: usable in the main stream's order
        elif buffer.applied is not None:
            copy_stream.wait_event(buffer.applied)  # a step ago or more: long done
        on_device = buffer.device_bitmask[: job.num_masks]
        index = buffer.device_rows[: job.num_masks]
        with torch.cuda.stream(copy_stream):
            on_device.copy_(job.bitmask, non_blocking=True)
            index.copy_(job.row_index, non_blocking=True)
            buffer.copied = torch.cuda.Event()
            buffer.copied.record(copy_stream)  # the buffer's next fill waits for these copies
        main.wait_event(buffer.copied)
        apply_token_bitmask(logits, on_device, index)
        buffer.applied = torch.cuda.Event()
        buffer.applied.record(main)

    def fill(self, rows: list[MaskedRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, W] int32 bitmasks of ``rows`` (drafts included) and [M] their logits rows
        (copies: the host buffers are filled again by later steps)."""
        job = self._compute(self._prepare(rows))
        return job.bitmask.clone(), job.row_index.clone()

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
        plain: list[tuple[Any, int]] = []
        drafted: list[tuple[Any, int, list[int]]] = []
        row_index: list[int] = []
        for first_row, grammar, drafts in rows:
            if drafts:
                drafted.append((grammar.matcher, len(row_index), drafts))
                row_index += range(first_row, first_row + len(drafts) + 1)
            else:
                plain.append((grammar.matcher, len(row_index)))
                row_index.append(first_row)
        return _FillJob(self._buffers.take(row_index), len(row_index), plain, drafted)

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
            job.buffer.bitmask.data_ptr(),
            self.num_words * 4,
            job.num_masks,
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
