"""Which sequences get draft tokens this step, and how many; prompt lookup makes them."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.config import EngineConfig
from engine.sequence import Sequence
from engine.spec_decode.ngram import NgramProposer


class TokenBuffer:
    """A sequence's prompt + output tokens as a growing int64 array, so that each step copies
    only the tokens added since the last (a sequence's tokens never change once known)."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self._array = np.asarray(prompt_token_ids, dtype=np.int64)
        self.num_prompt_tokens = self.length = len(prompt_token_ids)

    def sync(self, seq: Sequence) -> np.ndarray:
        """The tokens of ``seq`` (whose prompt this buffer holds), as a view."""
        new = seq.output_token_ids[self.length - self.num_prompt_tokens :]
        if new:
            needed = self.length + len(new)
            if needed > len(self._array):
                grown = np.empty(max(needed, 2 * len(self._array)), dtype=np.int64)
                grown[: self.length] = self._array[: self.length]
                self._array = grown
            self._array[self.length : needed] = new
            self.length = needed
        return self._array[: self.length]


class Proposer(Protocol):
    def propose(self, running: list[Sequence]) -> None:
        """Set ``draft_token_ids`` (and ``draft_probs``) of every running sequence."""


def max_drafts(seq: Sequence, num_tokens: int) -> int:
    """How many drafts ``seq`` may verify in its next step (at most ``num_tokens``).

    None while it prefills, or when fewer than two tokens are left before its length limit.
    """
    if seq.num_uncomputed_tokens != 1 or seq.num_pending_tokens:
        return 0  # it prefills, or its last token is not known yet
    # this step adds at most k + 1 tokens
    return max(0, min(num_tokens, seq.length_limit - seq.num_tokens - 1))


class PromptLookupProposer:
    """Drafts by prompt lookup (``--speculative ngram``) before the scheduler runs."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_tokens = config.speculative_tokens()
        self.ngram = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
        self._buffers: dict[Sequence, TokenBuffer] = {}

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for every running sequence (empty for those that get none)."""
        buffers = {seq: self._buffers.get(seq) for seq in running}
        for seq in running:
            seq.draft_token_ids = []
            k = max_drafts(seq, self.num_tokens)
            if k == 0:
                continue
            buffer = buffers[seq] or TokenBuffer(seq.prompt_token_ids)
            buffers[seq] = buffer
            seq.draft_token_ids = self.ngram.propose(buffer.sync(seq), k)
        # sequences that left the running queue drop their buffers
        self._buffers = {seq: buffer for seq, buffer in buffers.items() if buffer is not None}
