"""Plain-torch mixture-of-experts: the reference the Triton kernels of this folder match.

Weights of all experts of a layer live in two stacked tensors: ``w13 [E, 2 * I, H]`` (each
expert's gate rows, then its up rows) and ``w2 [E, H, I]`` (its down projection).
"""

from __future__ import annotations

import torch

from kernels.elementwise.activation import silu_and_mul_ref


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
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_j weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = ids[t, j]``.

    Each expert's MLP runs in ``x``'s dtype (its output rounded there, as a dense MLP's is);
    each weighted term is rounded to that dtype too (as HF's are), and a token's terms are
    summed in float32 in slot order and rounded once.
    """
    num_tokens, top_k = topk_ids.shape
    terms = torch.zeros(num_tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        hidden = silu_and_mul_ref(x[token] @ w13[expert].t())
        weighted = (hidden @ w2[expert].t()).float() * topk_weights[token, slot, None]
        terms[token, slot] = weighted.to(x.dtype)
    total = terms[:, 0].float()
    for slot in range(1, top_k):  # in slot order, as the kernel adds them
        total += terms[:, slot].float()
    return total.to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:  # [T, H]
    """The whole MoE MLP: route, then run each token through its ``top_k`` experts."""
    weights, expert_ids = route_topk_ref(router_logits, top_k, renormalize)
    return experts_ref(x, w13, w2, weights, expert_ids)
