"""Matmul against quantized weights in Triton: ``out = x @ dequantize(w).T``.

The weight never exists in float outside registers: each program loads its tile's quants and
scales from the format's planes (quant.py) and dequantizes them where the products are
formed, so a step reads the packed bytes only (4.5 bits a weight for q4_0 against 16).
``quant_matmul`` launches the kernel that quant_matmul_config.py picks by format and rows:

* decode GEMVs: quant_gemv_blocked_triton.py (q8_0, q4_0, q4_1, fp8: a block's scale applied
  once to its sum), quant_gemv_kquant_triton.py (q4_k, q6_k), quant_gemv_int8_triton.py (on
  activations rounded to int8, ``INT8_X_ROWS``), quant_gemm_triton.py's element-wise GEMV
  (any format);
* small batches on tensor cores (``MMA_ROWS``, ``INT8_MMA_ROWS``): quant_mma_triton.py for
  q8_0/q4_0/q4_1, quant_mma_int8_triton.py for q8_0 on int8 tensor cores,
  fp8_mma_triton.py for fp8 (W8A8), which beyond its range takes ``torch._scaled_mm``
  (fp8_rows_triton.py);
* the GEMM of quant_gemm_triton.py beyond. From ``DEQUANT_GEMM_MIN_ROWS`` rows up,
  engine/quant/linear.py dequantizes the whole weight once and calls cuBLAS instead
  (quant_dequant_triton.py).
"""

from __future__ import annotations

import torch

from kernels.linear.common import split_k_target
from kernels.linear.fp8_mma_triton import fp8_mma
from kernels.linear.fp8_rows_triton import fp8_scaled_mm
from kernels.linear.gemv_triton import SUPPORTED_DTYPES
from kernels.linear.int8_rows_triton import Int8Rows
from kernels.linear.quant import QK, QuantFormat
from kernels.linear.quant_gemm_triton import quant_gemm, quant_gemv_elementwise
from kernels.linear.quant_gemv_blocked_triton import BLOCKED_FORMATS, quant_gemv_blocked
from kernels.linear.quant_gemv_int8_triton import INT8_X_FORMATS, quant_gemv_int8
from kernels.linear.quant_gemv_kquant_triton import KQUANT_FORMATS, quant_gemv_kquant
from kernels.linear.quant_matmul_config import (
    MAX_GEMV_ROWS,
    QuantMatmulConfig,
    default_config,
    takes_int8_rows,
    uses_scaled_mm,
)
from kernels.linear.quant_mma_int8_triton import quant_mma_int8
from kernels.linear.quant_mma_triton import quant_mma

MAX_PLANES = 4


def quant_matmul(
    x: torch.Tensor,  # [M, K]
    fmt: QuantFormat,
    planes: dict[str, torch.Tensor],  # the weight's planes, each [N, ...]
    size_k: int,
    *,
    config: QuantMatmulConfig | None = None,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
) -> torch.Tensor:  # [M, N]
    """``x @ dequantize(fmt, planes).T``: the tensor-core kernels in ``MMA_ROWS``' range, else
    the GEMV for up to ``MAX_GEMV_ROWS`` rows, else the GEMM; fp8 beyond its range, in bf16 on
    Hopper+: ``torch._scaled_mm`` (activations quantized per row)."""
    pointers = plane_arguments(fmt, planes)
    num_rows = x.shape[0]
    num_cols = pointers[0].shape[0]
    _check(x, size_k)
    if config is None and uses_scaled_mm(x, fmt, num_cols, size_k):
        return fp8_scaled_mm(x, planes, out=out)  # W8A8 on fp8 tensor cores
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = config or default_config(num_rows, num_cols, size_k, fmt, x.dtype)
    if cfg.int8_mma:
        _launch_int8_mma(x, out, pointers, fmt, size_k, cfg)
    elif cfg.mma:
        _launch_mma(x, out, planes, pointers, fmt, size_k, cfg)
    elif num_rows <= MAX_GEMV_ROWS:
        _launch_gemv(x, out, pointers, fmt, size_k, cfg)
    else:
        quant_gemm(
            x, out, fmt, pointers, size_k, block_m=cfg.block_m, block_n=cfg.block_n,
            block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def quant_matmul_int8_rows(
    rows: Int8Rows,  # [M, K], M in INT8_X_ROWS' or INT8_MMA_ROWS' range
    fmt: QuantFormat,
    planes: dict[str, torch.Tensor],
    size_k: int,
    *,
    out: torch.Tensor | None = None,  # [M, N] in the rows' float dtype
) -> torch.Tensor:  # [M, N]
    """``quant_matmul`` of rows that their producer already rounded for the int8 kernels
    (where ``takes_int8_rows``): the same launch, less the rounding kernel."""
    pointers = plane_arguments(fmt, planes)
    num_rows, num_cols = rows.shape[0], pointers[0].shape[0]
    if not takes_int8_rows(fmt, num_rows, size_k, rows.dtype):
        raise ValueError(f"quant_matmul: {num_rows} rows of {fmt.name} take no int8 kernel")
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=rows.dtype, device=rows.device)
    cfg = default_config(num_rows, num_cols, size_k, fmt, rows.dtype)
    launch = _launch_int8_mma if cfg.int8_mma else _launch_gemv
    launch(rows, out, pointers, fmt, size_k, cfg)
    return out


def _launch_gemv(
    x: torch.Tensor | Int8Rows,
    out: torch.Tensor,
    pointers: list[torch.Tensor],
    fmt: QuantFormat,
    size_k: int,
    cfg: QuantMatmulConfig,
) -> None:
    """The GEMV that ``cfg`` picks for the format (rounded rows: the int8 GEMV); with K split
    its programs add into an fp32 buffer, copied into ``out`` after."""
    target = split_k_target(out, cfg.split_k)
    whole_blocks = size_k % QK == 0 and cfg.block_k >= QK
    group_size = KQUANT_FORMATS.get(fmt.name)
    if isinstance(x, Int8Rows) or (cfg.int8_x and fmt.name in INT8_X_FORMATS and whole_blocks):
        quant_gemv_int8(
            x, target, fmt, pointers[:3], size_k, block_n=cfg.block_n, blocks=cfg.block_k // QK,
            split_k=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    elif cfg.blocked and fmt.name in BLOCKED_FORMATS and whole_blocks:
        quant_gemv_blocked(
            x, target, fmt, pointers[:3], size_k, block_n=cfg.block_n,
            blocks=cfg.block_k // QK, split_k=cfg.split_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    elif cfg.blocked and group_size is not None and cfg.block_k % group_size == 0:
        quant_gemv_kquant(
            x, target, fmt, pointers, size_k, block_n=cfg.block_n, block_k=cfg.block_k,
            split_k=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        quant_gemv_elementwise(
            x, target, fmt, pointers, size_k, block_n=cfg.block_n, block_k=cfg.block_k,
            split_k=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if target is not out:
        out.copy_(target)


def _launch_int8_mma(
    x: torch.Tensor | Int8Rows,
    out: torch.Tensor,
    pointers: list[torch.Tensor],
    fmt: QuantFormat,
    size_k: int,
    cfg: QuantMatmulConfig,
) -> None:
    quant_mma_int8(
        x, out, fmt, pointers[:3], size_k, block_m=cfg.block_m, block_n=cfg.block_n,
        blocks=cfg.block_k // QK, split_k=cfg.split_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_mma(
    x: torch.Tensor,
    out: torch.Tensor,
    planes: dict[str, torch.Tensor],
    pointers: list[torch.Tensor],
    fmt: QuantFormat,
    size_k: int,
    cfg: QuantMatmulConfig,
) -> None:
    if fmt.name == "fp8":  # e4m3 by e4m3: its own kernel, which rounds x first
        fp8_mma(x, out, planes, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                split_k=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
        return
    quant_mma(
        x, out, fmt, pointers[:3], size_k, block_m=cfg.block_m,
        block_n=cfg.block_n, blocks=cfg.block_k // QK, split_k=cfg.split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def plane_arguments(fmt: QuantFormat, planes: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The planes in kernel order, padded to MAX_PLANES with the first (never read)."""
    names = [p.name for p in fmt.all_planes]
    try:
        ordered = [planes[name] for name in names]
    except KeyError as error:
        raise ValueError(f"quant_matmul: {fmt.name} needs planes {names}") from error
    for plane in ordered:
        if plane.stride(-1) != 1:
            raise ValueError("quant_matmul: planes need a contiguous last dimension")
    return ordered + [ordered[0]] * (MAX_PLANES - len(ordered))


def _check(x: torch.Tensor, size_k: int) -> None:
    if x.dim() != 2 or x.shape[1] != size_k:
        raise ValueError(f"quant_matmul: x [M, {size_k}] expected, got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quant_matmul: x in one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("quant_matmul: x needs a contiguous last dimension")
