"""Verifies a step's draft tokens against the target's logits at every draft position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import DeviceSample, Sampler, SamplingRow, TokenLogprobs, draw_noise
from engine.scheduler import ScheduledSeq
from engine.spec_decode.rejection import DraftLayout, rejection_sample, verify_greedy


@dataclass
class VerifiedDrafts:
    """Each row's accepted drafts and the token after them, still on the device."""

    entries: list[ScheduledSeq]
    layout: DraftLayout
    num_accepted: torch.Tensor  # [R]
    # [N]: the token each position puts out (and the raw logprobs of rows that ask)
    emitted: DeviceSample

    def resolve(self) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Per row, the tokens it gains this step (accepted drafts, then one more) and their
        logprobs; waits for the device."""
        num_accepted = self.num_accepted.tolist()
        out = self.emitted.resolve()
        starts = self.layout.first_positions
        return [
            (out.token_ids[start : start + n + 1], out.logprobs[start : start + n + 1])
            for start, n in zip(starts, num_accepted, strict=True)
        ]


class DraftVerifier:
    """Rejection sampling over the logits of decode rows that ran with draft tokens."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, entries: list[ScheduledSeq]) -> VerifiedDrafts:
        """``logits``: [N, >= V], each entry's ``k + 1`` positions in order (its last real
        token, then its drafts)."""
        device = logits.device
        layout = DraftLayout.build([entry.draft_token_ids for entry in entries], device)
        if all(entry.seq.picks_argmax for entry in entries):
            # accepted drafts equal the argmax there, and the argmax follows them
            target_ids = logits[:, : self.sampler.vocab_size].argmax(dim=-1)  # [N]
            num_accepted = verify_greedy(target_ids, layout)
            sample = DeviceSample(target_ids, None)
        else:
            per_entry = [position_rows(entry) for entry in entries]
            rows = [row for entry_rows in per_entry for row in entry_rows]
            probs = self.sampler.target_probs(logits, rows)  # [N, V]
            # each row draws one token, after its last position's settings
            noise = draw_noise([r[-1] for r in per_entry], probs.shape[1], device)  # [R, V]
            draft_probs = _draft_probs(entries, probs.shape[1], device)
            uniforms = _uniforms(entries, device)
            result = rejection_sample(probs, layout, uniforms, noise, draft_probs)
            num_accepted = result.num_accepted
            emitted = layout.emitted(num_accepted, result.next_token_ids)
            sample = self.sampler.picked_on_device(logits, emitted, rows)
        sample.start_copy()
        return VerifiedDrafts(entries, layout, num_accepted, sample)


def position_rows(entry: ScheduledSeq) -> list[SamplingRow]:
    """The sampling row at each of the entry's positions: position ``j`` follows the first
    ``j`` drafts, which then count as output (penalties, ``min_tokens``)."""
    seq, drafts = entry.seq, entry.draft_token_ids
    penalties = seq.sampling.has_penalties
    return [
        seq.sampling_row(
            seq.output_token_ids + drafts[:j] if penalties else None, seq.num_output_tokens + j
        )
        for j in range(len(drafts) + 1)
    ]


def _draft_probs(
    entries: list[ScheduledSeq], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[N, V] the draft distribution at each position (a point mass where the proposer kept
    none; zeros at each row's last position, which has no draft), or None when every draft is
    a point mass."""
    if all(entry.seq.draft_probs is None for entry in entries):
        return None
    parts = []
    for entry in entries:
        drafts, q = entry.draft_token_ids, entry.seq.draft_probs
        if q is None:
            ids = torch.tensor(drafts, dtype=torch.int64, device=device)
            q = torch.nn.functional.one_hot(ids, vocab_size).float()
        parts += [q[: len(drafts)].to(device), torch.zeros(1, vocab_size, device=device)]
    return torch.cat(parts)


def _uniforms(entries: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    """[N] uniform draws, one per position; a seeded sequence draws from its own generator."""
    sizes = [len(entry.draft_token_ids) + 1 for entry in entries]
    uniforms = torch.rand(sum(sizes), device=device)
    start = 0
    for entry, size in zip(entries, sizes, strict=True):
        generator = entry.seq.generator
        if generator is not None:
            draws = torch.rand(size, generator=generator, device=generator.device)
            uniforms[start : start + size] = draws.to(device)
        start += size
    return uniforms
