"""Per-head q/k norms (Qwen3), rotary embedding, then the KV write, in plain torch: the
reference of the fused kernel."""

from __future__ import annotations

import torch

from kernels.attention.paged_attention import write_kv_ref
from kernels.elementwise.norm import HeadNorms
from kernels.elementwise.rotary import rotary_ref


def rotary_write_kv_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_cache: torch.Tensor,  # [max_pos, D] float32
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = store nothing
    *,
    k_scale: torch.Tensor | None = None,  # [NB, BS, Hkv] float32, with an fp8 pool
    v_scale: torch.Tensor | None = None,
    head_norms: HeadNorms | None = None,  # Qwen3: RMSNorm each q and k head before rotary
) -> torch.Tensor:  # the rotated q, a new tensor [T, Hq, D]
    """Store rotated k and v at their slots of the pool; returns q rotated (q, k untouched).
    With ``head_norms``, q and k are normed first (``rms_norm_ref``, as HF Qwen3)."""
    if head_norms is not None:
        q, k = head_norms.apply_ref(q, k)
    rotated_k = rotary_ref(k, positions, cos_cache, sin_cache)
    write_kv_ref(rotated_k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return rotary_ref(q, positions, cos_cache, sin_cache)
