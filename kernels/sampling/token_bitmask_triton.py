# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Applying a token bitmask to logits in Triton, matching ``token_bitmask.apply_token_bitmask_ref``.

A program handles ``BLOCK_V`` columns of one masked row: it reads the row's words once per
32 columns and writes -inf only where a bit is clear (an allowed logit is never written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling.token_bitmask import BITS_PER_WORD

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_V = 1024  # columns per program


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [R, V], last stride 1
    bitmask_ptr,  # [M, W] int32, last stride 1
    row_index_ptr,  # [M]: the logits row of each bitmask row
    stride_lr,
    stride_mr,
    num_cols,  # columns covered: min(V, W * 32)
    BLOCK_V: tl.constexpr,
):
    mask_row = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_range = offs_v < num_cols
    # 1. the word and bit of each column
    words = tl.load(bitmask_ptr + mask_row * stride_mr + offs_v // 32, mask=in_range, other=-1)
    allowed = ((words >> (offs_v % 32)) & 1) != 0
    # 2. -inf into the disallowed columns of the logits row
    row = tl.load(row_index_ptr + mask_row).to(tl.int64)
    tl.store(
        logits_ptr + row * stride_lr + offs_v,
        tl.full([BLOCK_V], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
        mask=in_range & ~allowed,
    )


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, row_index: torch.Tensor
) -> None:
    """In place: ``logits[row_index[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is 0.

    ``logits``: [R, V] fp16/bf16/fp32, last stride 1; ``bitmask``: [M, W] int32, contiguous;
    ``row_index``: [M] int32/int64 of distinct rows, all on the logits' device.
    """
    _check(logits, bitmask, row_index)
    num_rows = bitmask.shape[0]
    if num_rows == 0:
        return
    num_cols = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    grid = (num_rows, triton.cdiv(num_cols, BLOCK_V))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, row_index, logits.stride(0), bitmask.stride(0), num_cols,
        BLOCK_V=BLOCK_V, num_warps=4,
    )  # fmt: skip


def _check(logits: torch.Tensor, bitmask: torch.Tensor, row_index: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [R, V] in {SUPPORTED_DTYPES} with last stride 1, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or not bitmask.is_contiguous():
        raise ValueError(
            f"bitmask must be a contiguous [M, W] int32, got {tuple(bitmask.shape)} {bitmask.dtype}"
        )
    if row_index.shape != (bitmask.shape[0],) or row_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"row_index must be [M={bitmask.shape[0]}] int32/int64, got "
            f"{tuple(row_index.shape)} {row_index.dtype}"
        )
    if not logits.device == bitmask.device == row_index.device:
        raise ValueError("logits, bitmask and row_index must be on one device")
