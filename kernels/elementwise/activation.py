"""SiLU-and-mul: the gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate then up) -> [..., d] = silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
