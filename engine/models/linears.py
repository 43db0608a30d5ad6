"""Which path a plain linear takes at a decode row: the Triton GEMV where it is measured
faster on this GPU (``bench.gemv --install``), else cuBLAS; and a product written straight
into a given buffer. Shared by the decoder's layers and a mixture of experts' router.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.linear import QuantizedLinear
from kernels.linear.common import linear_out
from kernels.linear.gemv_triton import GemvConfig, gemv
from kernels.linear.gemv_tuning import tuned_config
from kernels.linear.int8_rows_triton import Int8Rows

GEMV_MAX_ROWS = 1  # rows that take the Triton GEMV instead of cuBLAS (measured at one)
GEMV_DTYPES = (torch.bfloat16, torch.float16)
# o_proj's and down's GEMV launch shape (the LM head keeps gemv's default). H100, llama3-8b,
# one row, weights not in L2: o_proj 13.9-14.8 us against cuBLAS's 16.0, down 42.3 against
# 44.4 (and the activation kernel folds into it); the batch-1 decode step 6.26 -> 6.10 ms.
LAYER_GEMV_CONFIG = GemvConfig(block_n=8, block_k=1024)
# A mixture of experts' router (a few hundred outputs at most): a program per expert, where
# cuBLAS runs a handful of tiles. H100, qwen3-30b-a3b's 128 x 2048, one row, from memory:
# 1.77 us against cuBLAS's 5.32 (gemv-qwen3-30b-a3b-tp1-h100.json).
ROUTER_GEMV_CONFIG = GemvConfig(block_n=1, block_k=2048, num_warps=2, num_stages=3)


def takes_gemv(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether ``linear(x)`` streams through the GEMV: a decode row (at most GEMV_MAX_ROWS)
    in bf16/fp16 on CUDA, and a plain linear without bias (quantized ones have their own)."""
    return (
        x.is_cuda
        and x.shape[0] <= GEMV_MAX_ROWS
        and isinstance(linear, nn.Linear)
        and linear.bias is None
        and linear.weight.dtype in GEMV_DTYPES
    )


def gemv_config(
    x: torch.Tensor | Int8Rows, linear: nn.Module, silu_mul: bool, default: GemvConfig | None
) -> GemvConfig | None:
    """The GEMV launch shape that runs ``linear(x)`` (``silu_mul``: x is a gate_up row),
    or None for cuBLAS: where ``x`` takes the GEMV at all, the tuned table's choice for this
    GPU and shape (``bench.gemv --install``), else ``default``."""
    if not (isinstance(x, torch.Tensor) and takes_gemv(x, linear)):
        return None
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return tuned_config(weight, x.shape[0], silu_mul, default)


def input_linear(
    x: torch.Tensor | Int8Rows,
    linear: nn.Module,
    out: torch.Tensor | None = None,  # [T, out_features], contiguous (``linear_into``)
    default: GemvConfig | None = None,  # where the table has no row: None for cuBLAS
) -> torch.Tensor:  # [T, out_features]: ``out`` where given
    """``linear(x)`` for qkv, gate_up and a MoE router: cuBLAS (or ``default``), or the GEMV
    where ``bench.gemv --install`` measured a launch shape of it faster on this GPU (one
    rank's shard of a tensor-parallel layer is a narrower matrix, which cuBLAS streams less
    well). With ``out`` the product lands there (``linear_into``)."""
    config = gemv_config(x, linear, False, default)
    if config is not None:
        assert isinstance(x, torch.Tensor) and isinstance(linear.weight, torch.Tensor)
        return gemv(x, linear.weight, config=config, out=out)
    if out is not None:
        return linear_into(x, linear, out)
    result: torch.Tensor = linear(x)
    return result


def linear_into(
    x: torch.Tensor | Int8Rows,  # [T, in_features]
    linear: nn.Module,
    out: torch.Tensor,  # [T, out_features], contiguous
) -> torch.Tensor:  # out
    """``out.copy_(linear(x))``, but written by the matmul itself where it can: cuBLAS for a
    plain linear (``linear_out``: the same result bit for bit), a quantized linear's kernels
    (``QuantizedLinear.forward`` copies once where its path cannot). Any other module: its
    result, copied once. An ``out`` strided across rows works too, but there cuBLAS adds a
    bias outside its epilogue (rounded once more). Inference only: a matmul into a given
    ``out`` refuses arguments that take gradients."""
    if isinstance(linear, QuantizedLinear):
        written: torch.Tensor = linear(x, out=out)
        return written
    if isinstance(linear, nn.Linear) and isinstance(x, torch.Tensor):
        return linear_out(x, linear.weight, linear.bias, out)
    return out.copy_(linear(x))
