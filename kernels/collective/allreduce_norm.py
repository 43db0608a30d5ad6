"""The sum over ranks followed by residual add + RMSNorm: the reference of
``allreduce_norm_triton`` (one process holding every rank's partial result)."""

from __future__ import annotations

import torch

from kernels.elementwise.norm import fused_add_rms_norm_ref, rms_norm_ref


def allreduce_add_rms_norm_ref(
    partials: torch.Tensor,  # [world, T, N]: every rank's share, in rank order
    residual: torch.Tensor | None,  # [T, N]; None: the sum is the new residual
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, N], new residual [T, N]
    """The fp32 sum in rank order, rounded to the partials' dtype as an all-reduce returns
    it, then ``fused_add_rms_norm_ref`` (or ``rms_norm_ref`` without a residual)."""
    total = partials.float().sum(0).to(partials.dtype)
    if residual is None:
        return rms_norm_ref(total, weight, eps), total
    return fused_add_rms_norm_ref(total, residual, weight, eps)
