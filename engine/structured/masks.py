"""A step's token bitmasks: filled on the host once every grammar has seen its tokens (the
forward is running on the device meanwhile), then applied to the logits on the device."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kernels.sampling.token_bitmask import apply_token_bitmask_ref, num_mask_words

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq
    from engine.structured.grammars import GrammarMatcher

MAX_FILL_THREADS = 16  # llguidance's threads filling a step's masks in parallel


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


class GrammarMasks:
    """Fills and applies the bitmasks of a step's constrained rows."""

    def __init__(
        self, vocab_size: int, device: torch.device, num_threads: int | None = None
    ) -> None:
        self.num_words = num_mask_words(vocab_size)
        self.device = device
        self.num_threads = num_threads or default_fill_threads()
        self._executor: Any = None
        # host time spent filling masks, and how many steps needed them (benchmarks read it)
        self.fill_s = 0.0
        self.num_fills = 0

    @torch.inference_mode()  # the logits are inference tensors, whoever calls
    def apply(
        self,
        logits: torch.Tensor,
        sampling_entries: list[ScheduledSeq],
        draft_entries: list[ScheduledSeq],
    ) -> None:
        """In place on ``logits`` [S + N, V]: -inf for every token a row's grammar forbids."""
        rows = masked_rows(sampling_entries, draft_entries)
        if not rows:
            return
        start_s = time.perf_counter()
        bitmask, row_index = self.fill(rows)
        self.fill_s += time.perf_counter() - start_s
        self.num_fills += 1
        on_device = bitmask.to(self.device, non_blocking=True)
        index = row_index.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            from kernels.sampling.token_bitmask_triton import apply_token_bitmask

            apply_token_bitmask(logits, on_device, index)
        else:
            apply_token_bitmask_ref(logits, on_device, index)

    def fill(self, rows: list[MaskedRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, W] int32 bitmasks of ``rows`` (drafts included) and [M] their logits rows."""
        pin = self.device.type == "cuda"
        starts: list[int] = []
        row_index: list[int] = []
        num_masks = 0
        for row in rows:
            starts.append(num_masks)
            num_masks += len(row.draft_token_ids) + 1
            row_index += range(row.first_row, row.first_row + len(row.draft_token_ids) + 1)
        bitmask = torch.empty(num_masks, self.num_words, dtype=torch.int32, pin_memory=pin)
        plain = [
            (r.grammar.matcher, s)
            for r, s in zip(rows, starts, strict=True)
            if not r.draft_token_ids
        ]
        drafted = [
            (r.grammar.matcher, s, r.draft_token_ids)
            for r, s in zip(rows, starts, strict=True)
            if r.draft_token_ids
        ]
        # llguidance's executor writes each mask at pointer + index * bytes per mask, on its
        # threads, without the GIL. (Its llguidance.torch wrappers do the same, but importing
        # that module compiles a torch function: seconds at the first step.)
        executor = self._get_executor()
        mask_bytes = self.num_words * 4
        if plain:
            executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), mask_bytes, num_masks)
        if drafted:  # each draft is consumed for the mask after it, then rolled back
            executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.data_ptr(), mask_bytes, num_masks
            )
        return bitmask, torch.tensor(row_index, dtype=torch.int64, pin_memory=pin)

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
