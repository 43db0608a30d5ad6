"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back (as HF Llama does)."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then RMSNorm of the sum; returns (normed, new residual)."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@dataclass(frozen=True)
class HeadNorms:
    """RMSNorms of each q and k head before rotary (Qwen3's q_norm and k_norm): one weight
    over the head dim for all q heads, one for all k heads, one eps."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float

    def apply_ref(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new tensors, q and k normed
        return rms_norm_ref(q, self.q_weight, self.eps), rms_norm_ref(k, self.k_weight, self.eps)
