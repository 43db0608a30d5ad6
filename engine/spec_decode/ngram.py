"""Prompt-lookup drafts: guess the next tokens by finding the latest n-gram elsewhere in the text.

When a model copies from its context (summaries, code edits, quoting, repeated structure),
the tokens after an earlier occurrence of the last ``n`` tokens are a good guess for what
comes next, and checking the guess costs one forward pass for several tokens. No second model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        for n in range(min(self.max_n, len(text) - 1), self.min_n - 1, -1):
            start = _latest_match(text, n)
            if start is not None:
                return _continuation(text, start + n, k)
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


def _latest_match(text: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last ``n`` tokens that is followed by a token
    (so not the suffix itself), or None."""
    # Windows starting at 0 .. len - n - 1: each has at least one token after it.
    windows = sliding_window_view(text[:-1], n)  # [len - n, n]
    hits = np.flatnonzero((windows == text[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
