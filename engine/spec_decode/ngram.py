"""Prompt-lookup drafts: guess the next tokens by finding the latest n-gram elsewhere in the text.

When a model copies from its context (summaries, code edits, quoting, repeated structure),
the tokens after an earlier occurrence of the last ``n`` tokens are a good guess for what
comes next, and checking the guess costs one forward pass for several tokens. No second model.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes ``k`` tokens from the most recent earlier match of the text's suffix.

    The suffix is tried from ``max_n`` tokens down to ``min_n``: a longer match is more
    likely to continue the same way.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"need 1 <= min_n ({min_n}) <= max_n ({max_n})"
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the suffix (none when
        it does not recur)."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        text = np.asarray(token_ids, dtype=np.int64)
        ends = _match_ends(text, min(self.max_n, len(text) - 1))
        for n in range(len(ends), self.min_n - 1, -1):
            if ends[n - 1].size:  # the latest earlier n-gram equal to the suffix
                return _continuation(text, int(ends[n - 1][-1]) + 1, k)
        return []


def _continuation(text: np.ndarray, begin: int, k: int) -> list[int]:
    """``k`` tokens from ``begin`` on; where the text ends first, it is taken to repeat with
    the period between the match and the suffix (a loop goes on looping)."""
    proposal = text[begin : begin + k].tolist()
    period = len(text) - begin  # the suffix sits this far after the match
    while len(proposal) < k:
        index = len(text) + len(proposal) - period
        proposal.append(int(text[index]) if index < len(text) else proposal[index - len(text)])
    return proposal


def _match_ends(text: np.ndarray, max_n: int) -> list[np.ndarray]:
    """``ends[n - 1]``: positions ``e < len - 1`` (each with a token after it) where an
    n-gram ending at ``e`` equals the text's last ``n`` tokens, for n = 1.. up to ``max_n``
    (fewer once none is left). One pass over the text, then each longer match narrows the
    shorter one's candidates: per step the cost is the text's length, not n times it."""
    candidates = np.flatnonzero(text[:-1] == text[-1])
    ends = [candidates]
    for back in range(1, max_n):
        candidates = candidates[candidates >= back]
        candidates = candidates[text[candidates - back] == text[-1 - back]]
        if not candidates.size:
            break
        ends.append(candidates)
    return ends
