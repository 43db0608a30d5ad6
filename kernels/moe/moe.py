"""Plain-torch mixture-of-experts: the reference the Triton kernels of this folder match.

Weights of all experts of a layer live in two stacked tensors: ``w13 [E, 2 * I, H]`` (each
expert's gate rows, then its up rows) and ``w2 [E, H, I]`` (its down projection); in float8
e4m3 (``--quantization fp8``) each with a float32 scale per row, ``[E, 2 * I]`` and ``[E, H]``.
"""

from __future__ import annotations

import torch

from kernels.elementwise.activation import silu_and_mul_ref
from kernels.linear.quant import FORMATS, quantize


def route_topk_ref(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, expert ids [T, top_k] int32
    """Softmax over the experts in float32, the ``top_k`` largest (largest first); with
    ``renormalize`` the chosen weights are divided by their sum (Mixtral always, Qwen3-MoE
    with ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids.to(torch.int32)


def experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k]
    w13_scale: torch.Tensor | None = None,  # [E, 2 * I] float32: w13 in float8 e4m3
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: w2 in float8 e4m3
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_j weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = ids[t, j]``.

    Each expert's MLP runs in ``x``'s dtype (its output rounded there, as a dense MLP's is);
    each weighted term is rounded to that dtype too (as HF's are), and a token's terms are
    summed in float32 in slot order and rounded once.
    """
    num_tokens, top_k = topk_ids.shape
    terms = torch.zeros(num_tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slots = torch.where(topk_ids == expert)
        hidden = silu_and_mul_ref(_project(x[token], w13[expert], _row(w13_scale, expert)))
        down = _project(hidden, w2[expert], _row(w2_scale, expert))
        weighted = down.float() * topk_weights[token, slots, None]
        terms[token, slots] = weighted.to(x.dtype)
    # in slot order, as the kernel adds them; a tensor of its own (contiguous: a collective
    # takes it next under tensor parallelism), never a view of the terms
    total = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(top_k):
        total += terms[:, slot].float()
    return total.to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    w13_scale: torch.Tensor | None = None,  # [E, 2 * I] float32: w13 in float8 e4m3
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: w2 in float8 e4m3
) -> torch.Tensor:  # [T, H]
    """The whole MoE MLP: route, then run each token through its ``top_k`` experts."""
    weights, expert_ids = route_topk_ref(router_logits, top_k, renormalize)
    return experts_ref(x, w13, w2, weights, expert_ids, w13_scale, w2_scale)


def quantize_experts_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float -> (float8 e4m3 ``[E, N, K]``, float32 scales ``[E, N]``): each row
    as the dense linears' fp8 rounds it (``kernels.linear.quant``)."""
    num_experts, num_rows, size_k = weight.shape
    planes = quantize(weight.reshape(num_experts * num_rows, size_k), FORMATS["fp8"])
    return planes["w"].view(weight.shape), planes["scale"].view(num_experts, num_rows)


def _project(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``a [M, K] @ weight [N, K].T`` in a's dtype; an fp8 weight's product is accumulated in
    float32 and each column scaled before the one rounding (as the kernels do: W8A16)."""
    if scale is None:
        return a @ weight.t()
    return ((a.float() @ weight.float().t()) * scale).to(a.dtype)


def _row(scale: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if scale is None else scale[expert]
