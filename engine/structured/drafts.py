"""Speculative drafts under a grammar."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.sequence import Sequence


def keep_valid_drafts(seqs: Seq[Sequence]) -> None:
    """Cut each constrained sequence's drafts before the first its grammar rejects: such a
    draft could never be accepted, nor could any after it."""
    for seq in seqs:
        if seq.grammar is None or not seq.draft_token_ids:
            continue
        num_valid = seq.grammar.num_valid(seq.draft_token_ids)
        if num_valid < len(seq.draft_token_ids):
            del seq.draft_token_ids[num_valid:]
            if seq.draft_probs is not None:
                seq.draft_probs = seq.draft_probs[:num_valid] if num_valid else None
