"""Logits processors of the sampler: suppressed tokens, repetition/presence/frequency
penalties, and the top-k/top-p/min-p filters, each over a whole batch with per-row settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams


class PenaltyRow(Protocol):
    """What the processors read of one row (``engine.sampler.PenaltyRow`` has it)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def suppressed_token_ids(self) -> Sequence[int]: ...


def suppress_tokens(logits: torch.Tensor, rows: Sequence[PenaltyRow], vocab_size: int) -> None:
    pairs = [
        (i, token_id)
        for i, row in enumerate(rows)
        for token_id in row.suppressed_token_ids
        if token_id < vocab_size  # ids past the vocab can never be sampled anyway
    ]
    if pairs:
        row_index, token_index = torch.tensor(pairs, device=logits.device).unbind(dim=1)
        logits[row_index, token_index] = float("-inf")


def penalize(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> torch.Tensor:
    vocab_size, device = logits.shape[1], logits.device
    output_counts = count_tokens([row.output_token_ids for row in rows], vocab_size, device)
    return apply_penalties(
        logits,
        _prompt_mask(rows, vocab_size, device),
        output_counts,
        repetition=column([row.params.repetition_penalty for row in rows], device),
        presence=column([row.params.presence_penalty for row in rows], device),
        frequency=column([row.params.frequency_penalty for row in rows], device),
    )


def _prompt_mask(rows: Sequence[PenaltyRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] bool: token occurs in the prompt. Only repetition penalty needs it."""
    if all(row.params.repetition_penalty == 1.0 for row in rows):
        return torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    return count_tokens([row.prompt_token_ids for row in rows], vocab_size, device) > 0


def count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab_size] float32 count of each token id in each row's list."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with an id one past the vocab; its counts land in a spare column that we drop.
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.long, device=device).view(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab]
    prompt_mask: torch.Tensor,  # [num_rows, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [num_rows, vocab] occurrences in the output
    repetition: torch.Tensor,  # [num_rows, 1]; 1 = off
    presence: torch.Tensor,  # [num_rows, 1]; 0 = off
    frequency: torch.Tensor,  # [num_rows, 1]; 0 = off
) -> torch.Tensor:
    """Penalized logits [num_rows, vocab]; rows with neutral penalties come back bit-identical."""
    output_mask = output_counts > 0
    # Repetition (HF/CTRL): shrink toward zero for every token seen in prompt or output.
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(prompt_mask | output_mask, scaled, logits)
    logits = logits - frequency * output_counts
    return logits - presence * output_mask


# -- filters


def apply_filters(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p (vLLM's order); filtered-out logits become -inf.

    ``logits``: [num_rows, vocab] float32, already divided by temperature. Each setting is a
    [num_rows] tensor, or None when no row uses it. Per row, ``top_k == 0``, ``top_p == 1``
    and ``min_p == 0`` are off: such a row comes back unchanged whatever its neighbours ask.
    """
    if top_k is not None or top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    if min_p is not None:
        logits = _apply_min_p(logits, min_p)
    return logits


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """One descending sort serves both filters; masks are built in sorted order, then unsorted."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    if top_k is not None:
        sorted_logits = _top_k_sorted(sorted_logits, top_k)
    if top_p is not None:
        sorted_logits = _top_p_sorted(sorted_logits, top_p)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _top_k_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Drop everything below the k-th largest value, so ties at the k-th value all stay."""
    vocab_size = sorted_logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [num_rows]
    kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [num_rows, 1]
    return sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))


def _top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop a token once the better tokens before it already reach top_p (renormalized).

    The best token has 0 mass before it, so it always stays.
    """
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [num_rows, vocab]
    mass_before = F.pad(cumulative[:, :-1], (1, 0))  # [num_rows, vocab]
    # top_p == 1 is off outright: a float32 cumsum can reach 1 before the tail ends.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    return sorted_logits.masked_fill(drop, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose prob is at least ``min_p`` times the top token's prob."""
    probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


# -- per-row settings as tensors


def per_row(
    values: list[int] | list[float], off: float, device: torch.device
) -> torch.Tensor | None:
    """Per-row settings as a [num_rows] tensor, or None when every row has the filter off."""
    if all(value == off for value in values):
        return None
    return torch.tensor(values, device=device)


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row scalars as a [num_rows, 1] float32 column that broadcasts over the vocab."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
