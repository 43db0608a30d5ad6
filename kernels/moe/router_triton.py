# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Router top-k in Triton, matching ``moe.route_topk_ref``.

A program takes ``BLOCK_T`` tokens' rows of logits (all experts at once: ``E`` is at most a
few hundred), softmaxes them in float32 and picks the ``TOP_K`` largest one at a time: the
largest, then the largest of the rest (ties go to the lower expert id).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_producers

MAX_EXPERTS = 1024  # one program holds a row of logits in registers
BLOCK_T = 16  # tokens per program


@triton.jit
def _moe_route_topk_kernel(
    logits_ptr,  # [T, E], last stride 1
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int32
    num_tokens,
    stride_lt,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    mask_t = offs_t < num_tokens
    # 1. softmax over the experts, float32 (padding experts get probability 0)
    ptrs = logits_ptr + offs_t[:, None] * stride_lt + offs_e[None, :]
    mask = mask_t[:, None] & (offs_e[None, :] < NUM_EXPERTS)
    logits = tl.load(ptrs, mask=mask, other=-float("inf")).to(tl.float32)
    # rows past the end, and NaN logits (a padding row of a captured batch may hold garbage):
    # zeros, so that every token picks real, distinct experts and no garbage row can take
    # another token's place in the sorted layout
    logits = tl.where(mask_t[:, None] & (logits == logits), logits, 0.0)
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    probs = tl.where(offs_e[None, :] < NUM_EXPERTS, probs, -1.0)
    # 2. the TOP_K largest, one at a time; a chosen expert drops out of the running
    top_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        best_id = tl.min(tl.where(probs == best[:, None], offs_e[None, :], E_PAD), axis=1)
        best_id = tl.minimum(best_id, NUM_EXPERTS - 1)  # never out of range, whatever came in
        top_w = tl.where(offs_k[None, :] == slot, best[:, None], top_w)
        top_i = tl.where(offs_k[None, :] == slot, best_id[:, None], top_i)
        probs = tl.where(offs_e[None, :] == best_id[:, None], -1.0, probs)
    # 3. renormalised over the chosen ones where the model says so
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_offs = offs_t[:, None] * TOP_K + offs_k[None, :]
    out_mask = mask_t[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out_offs, top_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_i, mask=out_mask)


def route_topk(
    router_logits: torch.Tensor,  # [T, E], last stride 1
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int32
    """Softmax, top-k and (``renormalize``) division by the chosen weights' sum, per token."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        raise ValueError(f"router_logits' last dim must be contiguous: {router_logits.stride()}")
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"need 1 <= top_k {top_k} <= experts {num_experts} <= {MAX_EXPERTS}")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    _moe_route_topk_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        router_logits, weights, ids, num_tokens, router_logits.stride(0),
        NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=BLOCK_T,
        num_warps=4, **pdl_launch(router_logits),
    )  # fmt: skip
    return weights, ids
