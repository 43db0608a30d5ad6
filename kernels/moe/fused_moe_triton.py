"""The MoE MLP in Triton: route, align, gate/up + SiLU, down + weights, top-k sum (or, for a
few pairs, route, gate/up + SiLU, down + weights + sum: the direct path).

Matches ``moe.fused_moe_ref``. Every step runs on the device with shapes fixed by the token
count alone, so a decode step that runs it can be captured in a CUDA graph.

Expert weights may be float8 e4m3 with a float32 scale per row (``--quantization fp8``):
the GEMMs convert each weight tile to x's dtype for the dot (W8A16: a decode step, bound by
the weights' bytes, reads half of them) and scale the accumulator's columns.
"""

from __future__ import annotations

import functools

import torch

from kernels.moe.align_triton import align_pairs
from kernels.moe.config import DIRECT_BLOCK_M, MoeConfig, MoeShape, pick_config
from kernels.moe.direct_triton import down_sum_direct, gate_up_silu_direct
from kernels.moe.grouped_gemm_triton import down_weighted, gate_up_silu, sum_topk
from kernels.moe.router_triton import route_topk
from kernels.moe.split_slot_buffers import SplitSlotBuffers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    config: MoeConfig | None = None,  # None: the table's for this shape and token count
    w13_scale: torch.Tensor | None = None,  # [E, 2 * I] float32: w13 in float8 e4m3
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: w2 in float8 e4m3
    direct_buffers: SplitSlotBuffers | None = None,  # kept scratch of a split-slot down tile
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over each token's ``top_k`` experts.

    ``direct_buffers``: where a config's direct down tile has ``split_slots``, its ticket
    counters and terms, kept by the caller across calls (``split_slot_buffers.py``); without
    them each such call allocates and zeroes its own."""
    _check(x, w13, w2, router_logits, w13_scale is not None, w2_scale is not None)
    num_tokens = x.shape[0]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if config is None:
        config = pick_config(moe_shape(w13, top_k, x.dtype), num_tokens, _device_name(x.device))
    topk_weights, topk_ids = route_topk(router_logits, top_k, renormalize)
    if config.block_m == DIRECT_BLOCK_M:  # a few pairs: a program each, nothing to sort
        act = gate_up_silu_direct(x, w13, topk_ids, config.gate_up, w13_scale)
        return down_sum_direct(
            act, w2, topk_weights, topk_ids, config.down, out, w2_scale, direct_buffers
        )
    align = align_pairs(topk_ids, w13.shape[0], config.block_m)
    act = gate_up_silu(x, w13, align, top_k, config.gate_up, w13_scale)  # [T * k, I]
    terms = down_weighted(act, w2, topk_weights, align, config.down, w2_scale)  # [T * k, H]
    return sum_topk(terms, top_k, out)


def moe_shape(w13: torch.Tensor, top_k: int, dtype: torch.dtype) -> MoeShape:
    """The table key of a layer with stacked gate/up weights ``w13``."""
    num_experts, two_inter, hidden = w13.shape
    name = str(dtype).removeprefix("torch.")
    if w13.dtype == FP8_DTYPE:
        name += "_w8"  # fp8 weights: other tiles may win
    return MoeShape(num_experts, hidden, two_inter // 2, top_k, name)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    logits: torch.Tensor,
    w13_scaled: bool,
    w2_scaled: bool,
) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} and w13 {tuple(w13.shape)} do not fit [T, H], "
                         "[E, 2 * I, H]")  # fmt: skip
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} != [E, H, I] = "
                         f"{(num_experts, hidden, two_inter // 2)}")  # fmt: skip
    if tuple(logits.shape) != (x.shape[0], num_experts):
        raise ValueError(f"router_logits {tuple(logits.shape)} != [T, E]")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    for name, weight, scaled in (("w13", w13, w13_scaled), ("w2", w2, w2_scaled)):
        expected = FP8_DTYPE if scaled else x.dtype
        if weight.dtype != expected:
            raise ValueError(f"{name} must be {expected} (x's dtype, or float8 e4m3 with "
                             f"scales), got {weight.dtype}")  # fmt: skip
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")
