"""Token bitmasks: which tokens a grammar allows next, one bit per token (bit ``t % 32`` of
int32 word ``t // 32``; set = allowed). Applying one sets every disallowed logit to -inf."""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def num_mask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def unpack_bitmask_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, W] int32 -> [M, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, row_index: torch.Tensor
) -> None:
    """In place: ``logits[row_index[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is 0.

    ``logits``: [R, V] float; ``bitmask``: [M, W] int32 with W * 32 >= V; ``row_index``: [M]
    int (distinct rows of ``logits``). Columns past the bitmask's width are left alone.
    """
    num_cols = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    allowed = unpack_bitmask_ref(bitmask, num_cols)  # [M, num_cols]
    rows = row_index.long()
    logits[rows, :num_cols] = logits[rows, :num_cols].masked_fill(~allowed, float("-inf"))
