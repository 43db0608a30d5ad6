"""The buffers of the direct path's split-slot down kernel (``direct_triton.py``), kept across
calls.

That kernel runs a program per (token, column tile, slot): each parks its pair's product in
``terms`` and takes a ticket from its (token, tile) counter in ``tickets``; the program that
draws the last ticket weighs and sums the token's products in slot order and sets the
counter back to 0. So the counters are zero between calls and need zeroing only once, when
they are made: a ``SplitSlotBuffers`` allocates them at the first call of a shape and hands
the same tensors to every later one (no allocation, no memset per call).

Ownership: whoever launches the kernels keeps one ``SplitSlotBuffers`` (the Triton backend,
one for its model's MoE layers; ``bench/moe_sweep.py``, one per layer it times). Calls that
share it must be ordered on one stream, as a model's layers are: a call's counters are in
use until its kernel ends. A CUDA graph captures the tensors' addresses, so a shape's first
call must come before the capture (the engine runs each batch size once before capturing
it); a first call inside a capture is refused rather than allocated there, where the
counters would be zeroed only when the graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotTerms:
    """One call's scratch: the (token, column tile) ticket counters, zero between calls, and
    each pair's product before its routing weight."""

    tickets: torch.Tensor  # [T, H] int32: a token's tile ``n`` counts at [t, n], zero at rest
    terms: torch.Tensor  # [T * top_k, H] float32: each (token, slot) pair's product

    @classmethod
    def allocate(cls, num_tokens: int, top_k: int, hidden: int, device: torch.device) -> SlotTerms:
        """Fresh buffers; a column tile holds at least one column, so ``H`` counters a token
        serve any ``block_n``."""
        tickets = torch.zeros(num_tokens, hidden, dtype=torch.int32, device=device)
        terms = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=device)
        return cls(tickets, terms)


class SplitSlotBuffers:
    """``SlotTerms`` per (device, token count, top_k, hidden size), made at a shape's first
    call and kept for the owner's lifetime (graphs captured with them hold their addresses)."""

    def __init__(self) -> None:
        self._terms: dict[tuple[torch.device, int, int, int], SlotTerms] = {}

    def take(self, num_tokens: int, top_k: int, hidden: int, device: torch.device) -> SlotTerms:
        """The kept buffers of this shape, allocated (counters zeroed) at its first call."""
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one key
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, num_tokens, top_k, hidden)
        kept = self._terms.get(key)
        if kept is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"SplitSlotBuffers: first call of {num_tokens} tokens x top-{top_k}, "
                    f"hidden {hidden} inside CUDA graph capture; run the step once before "
                    "capturing it so that its buffers exist (and are zeroed) beforehand"
                )
            kept = self._terms[key] = SlotTerms.allocate(num_tokens, top_k, hidden, device)
        return kept

    @property
    def allocated_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for kept in self._terms.values()
            for t in (kept.tickets, kept.terms)
        )
