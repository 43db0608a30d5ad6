# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""The experts' two grouped GEMMs over the expert-sorted pairs, and the top-k sum.

Program ``(pid_m, pid_n)`` takes block ``pid_m`` of the sorted layout (``BLOCK_M`` pairs of
one expert, ``align_triton.py``) and ``BLOCK_N`` output columns; a block past the end (its
expert -1) returns at once, and padding slots (pair id ``num_pairs``) are masked.

* ``gate_up_silu``: ``act[p] = silu(x[t] @ Wg[e].T) * (x[t] @ Wu[e].T)`` with ``t = p // k``:
  one program holds the gate and up accumulators of the same columns, so the activation is
  applied before anything is stored ([P, 2I] is never written).
* ``down_weighted``: ``terms[p] = w[p] * (act[p] @ W2[e].T)``, rounded to the model's dtype
  (as HF rounds each expert's weighted output): half the bytes of float32 terms, which a
  long prefill writes and reads again ([T * k, H]).
* ``sum_topk``: ``out[t] = terms[t, 0] + ... + terms[t, k - 1]`` in slot order, in float32,
  rounded once.

The top-k sum is its own small kernel rather than an atomic add in ``down_weighted``: a
token's ``k`` terms come from ``k`` programs, and atomic float adds would land in the order
the programs run, so a token's output (and the greedy tokens after it) could change from one
run to the next. The terms of a token are ``k * H`` values: rereading them costs little
beside the expert weights. (The direct path of a few pairs, ``direct_triton.py``, sums in
its down kernel instead: there one program walks all of a token's experts.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.common import tile_offsets
from kernels.linear.int8_rows_triton import TL_FLOAT_DTYPES
from kernels.moe.align_triton import MoeAlignment
from kernels.moe.config import GemmTile
from kernels.pdl import pdl_launch, wait_for_producers

SUM_BLOCK_H = 1024  # output columns per program of the top-k sum


@triton.jit
def _block_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s pair ids and the mask of the real ones (not padding)."""
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def _moe_gate_up_silu_kernel(
    x_ptr,  # [T, K], last stride 1
    w_ptr,  # [E, 2 * N, K]: gate rows, then up rows; last stride 1
    w_scale_ptr,  # [E, 2 * N] float32 with W_SCALED (fp8 weights), else unused
    act_ptr,  # [P, N], last stride 1
    sorted_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_ap,
    TOP_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,  # x's (and the weights', unless fp8)
    DOT_DTYPE: tl.constexpr,  # tl.dot's operands: DTYPE, or fp32 in the interpreter
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs, mask_m = _block_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M)
    tokens = tl.where(mask_m, pairs // TOP_K, 0)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn  # [BLOCK_K, BLOCK_N], the up rows of the same columns
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 1. gate and up over K, one x tile feeding both
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = mask_k[:, None] & mask_n[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_SCALED:  # fp8 weights: each output column (weight row) times its scale
        scale_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        acc_g *= tl.load(scale_ptrs, mask=mask_n, other=0.0)[None, :]
        acc_u *= tl.load(scale_ptrs + N, mask=mask_n, other=0.0)[None, :]
    # 2. silu(gate) * up with the reference's rounding points (the projection, then silu)
    gate = acc_g.to(DTYPE).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    act = (silu * acc_u.to(DTYPE).to(tl.float32)).to(DTYPE)
    act_ptrs = act_ptr + pairs[:, None] * stride_ap + offs_n[None, :]
    tl.store(act_ptrs, act, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_weighted_kernel(
    act_ptr,  # [P, K], last stride 1
    w_ptr,  # [E, N, K], last stride 1
    w_scale_ptr,  # [E, N] float32 with W_SCALED (fp8 weights), else unused
    weights_ptr,  # [P] float32: each pair's routing weight
    terms_ptr,  # [P, N], last stride 1
    sorted_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_ap,
    stride_we,
    stride_wn,
    stride_se,
    stride_tp,
    W_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,  # x's (and the weights', unless fp8)
    DOT_DTYPE: tl.constexpr,  # tl.dot's operands: DTYPE, or fp32 in the interpreter
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs, mask_m = _block_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M)
    rows = tl.where(mask_m, pairs, 0)
    offs_n, mask_n = tile_offsets(pid_n, BLOCK_N, N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_ap + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALED:
        scales = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=mask_n)
        acc *= scales[None, :]
    # the expert's output rounded as a dense down_proj's is, weighted in float32, rounded
    routing = tl.load(weights_ptr + rows, mask=mask_m, other=0.0)
    term = (acc.to(DTYPE).to(tl.float32) * routing[:, None]).to(DTYPE)
    terms_ptrs = terms_ptr + pairs[:, None] * stride_tp + offs_n[None, :]
    tl.store(terms_ptrs, term, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_topk_kernel(
    terms_ptr,  # [T * TOP_K, H], contiguous
    out_ptr,  # [T, H], last stride 1
    H,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DTYPE: tl.constexpr,  # out's
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    token = tl.program_id(0)
    offs_h, mask_h = tile_offsets(tl.program_id(1), BLOCK_H, H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        term = tl.load(terms_ptr + (token * TOP_K + slot) * H + offs_h, mask=mask_h, other=0.0)
        acc += term.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_h, acc.to(DTYPE), mask=mask_h)


def _dot_args(x: torch.Tensor) -> dict[str, object]:
    """The element types of a GEMM on ``x``'s rows: ``DTYPE`` (x's), ``DOT_DTYPE`` (tl.dot's
    operands: x's, but fp32 in the interpreter, whose bf16 ``tl.dot`` multiplies raw bits in
    Triton 3.9) and ``PRECISION`` (fp32 in full, not TF32: the reference's)."""
    dot_dtype = tl.float32 if x.device.type == "cpu" else TL_FLOAT_DTYPES[x.dtype]
    precision = "ieee" if dot_dtype == tl.float32 else "tf32"
    return {"DTYPE": TL_FLOAT_DTYPES[x.dtype], "DOT_DTYPE": dot_dtype, "PRECISION": precision}


def gate_up_silu(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: x's dtype, or float8 e4m3 with w13_scale
    align: MoeAlignment,
    top_k: int,
    tile: GemmTile,
    w13_scale: torch.Tensor | None = None,  # [E, 2 * I] float32: fp8 rows' scales
) -> torch.Tensor:  # [T * top_k, I]: pair p's activation
    """Each pair's ``silu(gate) * up`` through its expert."""
    num_pairs, inter = x.shape[0] * top_k, w13.shape[1] // 2
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (align.block_experts.numel(), triton.cdiv(inter, tile.block_n))
    scale, stride_se = _scale_args(w13, w13_scale)
    _moe_gate_up_silu_kernel[grid](
        x, w13, scale, act, align.sorted_pairs, align.block_experts, num_pairs, inter,
        x.shape[1], x.stride(0), w13.stride(0), w13.stride(1), stride_se, act.stride(0),
        TOP_K=top_k, W_SCALED=w13_scale is not None, BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_dot_args(x),
        **pdl_launch(x),
    )  # fmt: skip
    return act


def down_weighted(
    act: torch.Tensor,  # [P, I]
    w2: torch.Tensor,  # [E, H, I]: act's dtype, or float8 e4m3 with w2_scale
    topk_weights: torch.Tensor,  # [T, top_k] float32, contiguous
    align: MoeAlignment,
    tile: GemmTile,
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: fp8 rows' scales
) -> torch.Tensor:  # [P, H]: pair p's weighted expert output, in act's dtype
    """Each pair's expert output times its routing weight."""
    num_pairs, hidden = act.shape[0], w2.shape[1]
    terms = torch.empty(num_pairs, hidden, dtype=act.dtype, device=act.device)
    grid = (align.block_experts.numel(), triton.cdiv(hidden, tile.block_n))
    scale, stride_se = _scale_args(w2, w2_scale)
    _moe_down_weighted_kernel[grid](
        act, w2, scale, topk_weights, terms, align.sorted_pairs, align.block_experts,
        num_pairs, hidden, act.shape[1], act.stride(0), w2.stride(0), w2.stride(1), stride_se,
        terms.stride(0), W_SCALED=w2_scale is not None, BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_dot_args(act),
        **pdl_launch(act),
    )  # fmt: skip
    return terms


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The kernels' scale pointer and expert stride (the weight itself and 0 without scales:
    never read)."""
    if scale is None:
        return weight, 0
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(weight.shape[:2]):
        raise ValueError(f"weight scales must be float32 {tuple(weight.shape[:2])}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    if scale.stride(1) != 1:
        raise ValueError(f"weight scales' last dim must be contiguous: {scale.stride()}")
    return scale, scale.stride(0)


def sum_topk(terms: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """``out [T, H] = terms.view(T, top_k, H).sum(1)`` in slot order, rounded once."""
    num_tokens, hidden = out.shape
    if num_tokens:
        _moe_sum_topk_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK_H))](
            terms, out, hidden, out.stride(0), TOP_K=top_k, BLOCK_H=SUM_BLOCK_H, DTYPE=TL_FLOAT_DTYPES[out.dtype],
            num_warps=4,
            **pdl_launch(out),
        )  # fmt: skip
    return out
