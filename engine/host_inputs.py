"""A step's inputs as host lists, before the model runner turns them into device tensors.

Under tensor parallelism they are also what rank 0 sends the other ranks each step (a
``StepMessage``): every rank builds its own device tensors from the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_offload import PageMove
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import PENDING_TOKEN, Sequence


@dataclass(frozen=True)
class HostInputs:
    """The packed ``[T]`` batch of a step, with its attention layout and sampling rows.

    A row with draft tokens is one attention row per position, each a one-token query over
    the context up to itself (its pages hold the earlier drafts once the layer has written
    them): a step of decodes and verifications is then a decode step for attention, and
    replays a decode graph.
    """

    token_ids: list[int]  # PENDING_TOKEN where the previous step's pick goes (on device)
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]
    # the sampling rows, then every position of rows with draft tokens; None when every token
    # samples in that order
    logits_indices: list[int] | None
    num_samples: int  # logits rows
    has_pending: bool


@dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: page moves (swaps, host-tier copies), then the forward
    (None: page moves only)."""

    swap_out: list[tuple[int, int]]
    page_transfers: list[PageMove]
    swap_in: list[tuple[int, int]]
    inputs: HostInputs | None


@dataclass(frozen=True)
class HostBatch:
    """``HostInputs`` and, on rank 0, the sequences behind its rows."""

    inputs: HostInputs
    sampling_entries: list[ScheduledSeq]  # rows without drafts that sample
    draft_entries: list[ScheduledSeq]  # rows with draft tokens (their logits rows come last)
    pending: list[tuple[int, Sequence]]  # rows whose input token is still on the device

    @classmethod
    def of(cls, batch: ScheduledBatch, block_size: int) -> HostBatch:
        token_ids: list[int] = []
        pending: list[tuple[int, Sequence]] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_entries: list[ScheduledSeq] = []
        draft_indices: list[int] = []
        draft_entries: list[ScheduledSeq] = []
        bs = block_size
        for entry in batch.scheduled:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            first = len(token_ids)
            if end - start == 1:  # a decode step (most rows): no lists to build
                token_id = seq.token_id(start)
                if token_id == PENDING_TOKEN:
                    pending.append((first, seq))
                token_ids.append(token_id)
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:  # a prefill chunk, or a decode's last token and its drafts
                drafts = entry.draft_token_ids
                token_ids += [seq.token_id(start), *drafts] if drafts else seq.token_ids(start, end)
                positions += range(start, end)
                slots += slots_of(seq.block_table, start, end, bs)
            if entry.draft_token_ids:  # logits at every position, one attention row each
                query_start_loc += range(first + 1, len(token_ids) + 1)
                seq_lens += range(start + 1, end + 1)  # each sees the context up to itself
                tables += [seq.block_table] * entry.num_new_tokens
                draft_indices += range(first, len(token_ids))
                draft_entries.append(entry)
                continue
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            tables.append(seq.block_table)
            if entry.samples:
                logits_indices.append(len(token_ids) - 1)
                sampling_entries.append(entry)
        logits_indices += draft_indices
        inputs = HostInputs(
            token_ids=token_ids,
            positions=positions,
            slots=slots,
            tables=tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            logits_indices=(
                None if _is_identity(logits_indices, len(token_ids), bool(draft_entries))
                else logits_indices
            ),
            num_samples=len(logits_indices),
            has_pending=bool(pending),
        )  # fmt: skip
        return cls(inputs, sampling_entries, draft_entries, pending)


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of positions ``[start, end)`` of a sequence with ``block_table``."""
    bs = block_size
    return [block_table[pos // bs] * bs + pos % bs for pos in range(start, end)]


def _is_identity(logits_indices: list[int], num_tokens: int, has_drafts: bool) -> bool:
    """Whether the logits rows are every token in order (then no gather is needed)."""
    if len(logits_indices) != num_tokens:
        return False
    # without drafts the rows are in batch order; draft rows come after the others
    return not has_drafts or logits_indices == list(range(num_tokens))


TABLE_WIDTH_MULTIPLE = 4  # int32 entries: rows 16-byte aligned


def padded_tables(tables: list[list[int]], table_lens: list[int]) -> np.ndarray:
    """[B, W] int32 block tables, rows padded with page 0 (never read past a row's length).
    W is a multiple of TABLE_WIDTH_MULTIPLE, so every row starts 16 bytes aligned: a kernel
    handed one row (the SDPA path's gather) sees one pointer alignment, and Triton compiles
    one variant of it, not a second at the first step whose width and row are odd."""
    width = -(-max(table_lens) // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
    # Row copies into numpy: a quarter of the time of padding 256 Python lists.
    padded = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return padded


def packed_int32(parts: list[np.ndarray]) -> tuple[np.ndarray, list[slice]]:
    """``parts`` in one int32 array, for one copy to the device, and each one's slice of it.
    Each part starts 16 bytes aligned (at a multiple of TABLE_WIDTH_MULTIPLE), as a kernel
    handed a view of it needs to compile one variant (``padded_tables``)."""
    slices, start = [], 0
    for part in parts:
        slices.append(slice(start, start + part.size))
        start += -(-part.size // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
    packed = np.zeros(start, dtype=np.int32)
    for part, where in zip(parts, slices, strict=True):
        packed[where] = part.ravel()
    return packed, slices
