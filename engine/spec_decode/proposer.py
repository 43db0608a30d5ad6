"""Which sequences get draft tokens this step, and how many."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.sequence import Sequence
from engine.spec_decode.ngram import NgramProposer


class DraftProposer:
    """Sets ``draft_token_ids`` of each decoding sequence before the scheduler runs.

    A sequence gets no drafts while it prefills, when it asks for logprobs (those describe one
    token per step), or when fewer than two tokens are left before its length limit.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.num_tokens = config.speculative_tokens()
        self.ngram = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.draft_token_ids = self._drafts(seq)

    def _drafts(self, seq: Sequence) -> list[int]:
        if seq.num_uncomputed_tokens != 1 or seq.num_pending_tokens:
            return []  # it prefills, or its last token is not known yet
        if seq.sampling.logprobs is not None:
            return []
        # this step adds at most k + 1 tokens
        k = min(self.num_tokens, seq.length_limit - seq.num_tokens - 1)
        if k < 1:
            return []
        return self.ngram.propose(seq.prompt_token_ids + seq.output_token_ids, k)
