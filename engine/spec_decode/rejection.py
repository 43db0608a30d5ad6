"""Rejection sampling of draft tokens: the output keeps the target model's distribution.

A verified step has, for each sequence, ``k`` draft tokens ``d_1..d_k`` and the target's
distributions ``p_0..p_k`` at the ``k + 1`` positions (``p_j`` conditioned on ``d_1..d_j``).
Draft ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; at the first
rejection one token is drawn from ``norm(max(0, p_j - q_j))`` and the rest are dropped; when
every draft is accepted a bonus token is drawn from ``p_k``. The emitted tokens are then
distributed exactly as tokens drawn one at a time from the target (Leviathan et al. 2023,
Chen et al. 2023). A draft proposed without a distribution (prompt lookup) has ``q`` a point
mass on it. Greedy rows have ``p`` a point mass on the argmax: a draft is kept while it equals
the target's argmax, and the first mismatch is replaced by it.

Rows are laid out flat: row ``r`` owns positions ``starts[r] .. starts[r] + k_r`` of every
``[N, ...]`` tensor (``N`` = sum of ``k_r + 1``); a row's last position has no draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import exponential_race


@dataclass(frozen=True)
class DraftLayout:
    """Where each row's positions sit in the flat ``[N]`` layout, on the device."""

    starts: torch.Tensor  # [R] int64: the row's first position
    num_drafts: torch.Tensor  # [R] int64: k_r
    # [R, K_max + 1] int64: flat position of each row's j-th position, clamped to the row's
    # last one past k_r (those entries are masked out)
    padded_index: torch.Tensor
    draft_token_ids: torch.Tensor  # [N] int64: d_{j+1} at position j; 0 at a row's last one
    row_index: torch.Tensor  # [N] int64: the row each position belongs to
    first_positions: tuple[int, ...]  # ``starts`` on the host: reading them back would sync

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> DraftLayout:
        """The layout of rows whose drafts are ``drafts`` (one list per row, maybe empty)."""
        starts: list[int] = []
        index_rows: list[list[int]] = []
        flat_ids: list[int] = []
        row_index: list[int] = []
        max_drafts = max(len(row) for row in drafts)
        for index, row in enumerate(drafts):
            start = len(flat_ids)
            starts.append(start)
            index_rows.append([start + min(j, len(row)) for j in range(max_drafts + 1)])
            flat_ids += [*row, 0]
            row_index += [index] * (len(row) + 1)
        # one host buffer and one copy (pinned, asynchronous on CUDA) for all five tensors
        num_rows, width, num_positions = len(drafts), max_drafts + 1, len(flat_ids)
        flat = [*starts, *(len(row) for row in drafts)]
        flat += [i for index_row in index_rows for i in index_row]
        flat += [*flat_ids, *row_index]
        host = torch.tensor(flat, dtype=torch.int64, pin_memory=device.type == "cuda")
        packed = host.to(device, non_blocking=True)
        sizes = [num_rows, num_rows, num_rows * width, num_positions, num_positions]
        starts_t, num_drafts, padded, ids, rows = packed.split(sizes)
        return cls(
            starts=starts_t,
            num_drafts=num_drafts,
            padded_index=padded.view(num_rows, width),
            draft_token_ids=ids,
            row_index=rows,
            first_positions=tuple(starts),
        )

    @property
    def num_positions(self) -> int:
        return int(self.draft_token_ids.shape[0])

    def emitted(self, num_accepted: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """[N]: the token each position puts out: its draft while accepted, then the row's
        next token (positions past it are never read)."""
        offset = torch.arange(self.num_positions, device=num_accepted.device)
        offset = offset - self.starts[self.row_index]
        is_draft = offset < num_accepted[self.row_index]
        return torch.where(is_draft, self.draft_token_ids, next_token_ids[self.row_index])

    def num_accepted(self, accepted: torch.Tensor) -> torch.Tensor:
        """[R]: how many leading drafts of each row are accepted, from ``accepted`` [N] bool."""
        padded = accepted[self.padded_index]  # [R, K_max + 1]
        max_drafts = padded.shape[1] - 1
        in_row = torch.arange(max_drafts + 1, device=padded.device) < self.num_drafts.unsqueeze(1)
        return (padded & in_row).to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(target_ids: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """[R] accepted draft counts when every row is greedy; ``target_ids`` [N]: the argmax at
    each position. Row ``r`` then emits ``target_ids[starts[r] : starts[r] + n_r + 1]``
    (accepted drafts equal the argmax, and the next argmax follows them)."""
    return layout.num_accepted(target_ids == layout.draft_token_ids)


@dataclass(frozen=True)
class RejectionResult:
    num_accepted: torch.Tensor  # [R] int64: leading drafts kept
    next_token_ids: torch.Tensor  # [R] int64: the token emitted after them


def rejection_sample(
    target_probs: torch.Tensor,
    layout: DraftLayout,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> RejectionResult:
    """Accept drafts against the target and draw each row's next token (no host sync).

    ``target_probs``: [N, V] float32, the target's distribution at each position (rows sum to
    1; a greedy row is one-hot). ``uniforms``: [N] in [0, 1), one per position. ``noise``:
    [R, V] Exp(1) draws for the one token each row samples. ``draft_probs``: [N, V] the
    draft's distribution at each position (its last position per row is ignored), or None
    when every draft is a point mass (prompt lookup).
    """
    positions = torch.arange(layout.num_positions, device=target_probs.device)
    drafts = layout.draft_token_ids
    p_draft = target_probs[positions, drafts]  # [N]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[positions, drafts]
    # u < p/q, written without the division (q > 0 wherever a draft was drawn)
    accepted = uniforms * q_draft < p_draft  # [N]
    num_accepted = layout.num_accepted(accepted)  # [R]
    chosen = layout.starts + num_accepted  # [R]: the position whose distribution is sampled
    probs = target_probs[chosen]  # [R, V]
    was_rejected = (num_accepted < layout.num_drafts).unsqueeze(1)  # [R, 1]; else a bonus token
    if draft_probs is None:
        q = torch.zeros_like(probs)
        q.scatter_(1, drafts[chosen].unsqueeze(1), 1.0)
    else:
        q = draft_probs[chosen]
    residual = torch.where(was_rejected, (probs - q).clamp(min=0.0), probs)
    # A rejection has residual mass > 0 unless p == q up to rounding: then sample p itself.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    next_ids = exponential_race(residual, noise)  # draws in proportion: no need to normalize
    return RejectionResult(num_accepted, next_ids)
