# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Two partial attention results over disjoint key sets merged into one, in Triton; matches
``prefill_sdpa.merge_states_ref``.

Each part is ``(o, lse)``: the softmax-weighted values over its keys and the log-sum-exp of
its scores. Over the union of the keys:

    o = (o_1 e^{lse_1 - m} + o_2 e^{lse_2 - m}) / (e^{lse_1 - m} + e^{lse_2 - m}),  m = max

A program handles one (query, head) row: two loads of ``D`` values, two scalars, one store.
One pass over the parts, where the same merge in torch ops makes five over fp32 copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_states_kernel(
    out_ptr,  # [Q, H, D]
    o1_ptr,  # [H, Q, D] (any strides)
    o2_ptr,
    lse1_ptr,  # [H, Q] float32
    lse2_ptr,
    stride_oq, stride_oh,
    stride_1h, stride_1q,
    stride_2h, stride_2q,
    stride_l1h, stride_l1q,
    stride_l2h, stride_l2q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < HEAD_DIM
    lse1 = tl.load(lse1_ptr + head * stride_l1h + query * stride_l1q)
    lse2 = tl.load(lse2_ptr + head * stride_l2h + query * stride_l2q)
    top = tl.maximum(lse1, lse2)
    w1 = tl.exp(lse1 - top)
    w2 = tl.exp(lse2 - top)
    o1 = tl.load(o1_ptr + head * stride_1h + query * stride_1q + offs_d, mask=mask, other=0.0)
    o2 = tl.load(o2_ptr + head * stride_2h + query * stride_2q + offs_d, mask=mask, other=0.0)
    merged = (o1.to(tl.float32) * w1 + o2.to(tl.float32) * w2) / (w1 + w2)
    out_ptrs = out_ptr + query * stride_oq + head * stride_oh + offs_d
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=mask)


def merge_states(
    o1: torch.Tensor,  # [H, Q, D]
    lse1: torch.Tensor,  # [H, Q] float32
    o2: torch.Tensor,
    lse2: torch.Tensor,
    out: torch.Tensor,  # [Q, H, D]
) -> None:
    """Writes into ``out`` the merge of two parts attended over disjoint keys; every tensor's
    last dim (``D``) has stride 1 and the lse are float32."""
    heads, queries, head_dim = o1.shape
    if o2.shape != o1.shape or out.shape != (queries, heads, head_dim):
        raise ValueError(
            f"parts {tuple(o1.shape)} and {tuple(o2.shape)} need out [Q, H, D] = "
            f"{(queries, heads, head_dim)}, got {tuple(out.shape)}"
        )
    if lse1.shape != (heads, queries) or lse2.shape != (heads, queries):
        raise ValueError(f"lse [H, Q] = {(heads, queries)} wanted, got "
                         f"{tuple(lse1.shape)} and {tuple(lse2.shape)}")  # fmt: skip
    if lse1.dtype != torch.float32 or lse2.dtype != torch.float32:
        raise ValueError(f"lse must be float32, got {lse1.dtype} and {lse2.dtype}")
    for name, t in (("o1", o1), ("o2", o2), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs its last dim contiguous, got strides {t.stride()}")
    if queries == 0:
        return
    _merge_states_kernel[(queries, heads)](
        out, o1, o2, lse1, lse2,
        out.stride(0), out.stride(1),
        o1.stride(0), o1.stride(1),
        o2.stride(0), o2.stride(1),
        lse1.stride(0), lse1.stride(1),
        lse2.stride(0), lse2.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
