"""``QuantizedLinear``: a linear layer whose weight stays packed in a quantized format.

On CUDA the matmul runs in the Triton kernels that dequantize in registers
(kernels/linear/quant_matmul_triton.py; q8_0/q4_0/q4_1 on tensor cores from a few rows) up to
``DEQUANT_GEMM_MIN_ROWS`` rows (``MMA_ROWS`` for the tensor-core kernel); from there on the
weight is dequantized into a scratch buffer that the model's quantized linears share and
multiplied by cuBLAS (kernels/linear/quant_dequant_triton.py, engine/quant/scratch.py). Elsewhere a
reference dequantizes the whole weight to the activations' dtype and calls ``F.linear``
(correct, not fast: CPU serving defaults to float weights). The planes are buffers, so
``model.to(dtype)`` must not be used on a model that holds these: the loader casts parameters
only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.quant.scratch import DequantScratch
from kernels.linear.int8_rows_triton import Int8Rows
from kernels.linear.quant import QuantFormat, dequantize, empty_planes, quantize
from kernels.linear.quant_dequant_triton import dequant_matmul
from kernels.linear.quant_matmul_config import MMA_ROWS, takes_int8_rows, takes_mma, uses_scaled_mm
from kernels.linear.quant_matmul_triton import quant_matmul, quant_matmul_int8_rows

# Rows from which a step dequantizes the weight once and calls cuBLAS instead of the Triton
# GEMM (bench/quant_kernels.py times both per shape; fp8 on Hopper keeps torch._scaled_mm):
# the k-quants, fp8 before Hopper and float32 activations. H100, llama3-8b's linears
# (quant-kernels-llama3-8b-h100.json): at 144 rows dequantize + cuBLAS took 0.58-0.77 of the
# GEMM's time, at 4096 rows 0.15-0.21. q8_0/q4_0/q4_1 in 16 bits take the tensor-core kernel
# and their own bounds (MMA_ROWS).
DEQUANT_GEMM_MIN_ROWS = 128


@dataclass(frozen=True)
class PackedWeight:
    """Rows of a weight already in ``fmt`` (read from a GGUF file): its planes, on any device."""

    fmt: QuantFormat
    planes: dict[str, torch.Tensor]


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` held in ``fmt``'s planes."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: QuantFormat,
        bias: bool = False,
        device: torch.device | str | None = None,
        scratch: DequantScratch | None = None,
    ) -> None:
        """``scratch``: the float weight room shared with the model's other quantized
        linears (engine/quant/plan.py hands one to all); a layer of its own by default."""
        super().__init__()
        if fmt.block_size > 1 and in_features % fmt.block_size:
            raise ModelLoadError(
                f"{fmt.name} needs rows of whole {fmt.block_size}-element blocks; a layer with "
                f"{in_features} inputs has none: pick another --quantization"
            )
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        device = device if device is not None else torch.get_default_device()
        for name, plane in empty_planes(fmt, out_features, in_features, device).items():
            self.register_buffer(name, plane)
        # Inference only, as the planes (buffers): a bias that took gradients would stop the
        # matmuls that write into a given ``out`` (cuBLAS's addmm refuses it then)
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
            if bias
            else None
        )
        self.scratch = scratch if scratch is not None else DequantScratch()
        self.scratch.reserve(out_features, in_features)

    @property
    def device(self) -> torch.device:
        return next(self.buffers(recurse=False)).device

    def planes(self) -> dict[str, torch.Tensor]:
        """The packed planes by field name: this module's own buffers (no copy per call)."""
        return self._buffers  # type: ignore[return-value]  # every entry is a registered plane

    def forward(
        self,
        x: torch.Tensor | Int8Rows,  # [T, in_features]; rounded only where takes_int8_rows
        out: torch.Tensor | None = None,  # [T, out_features]
    ) -> torch.Tensor:  # [T, out_features]
        if isinstance(x, Int8Rows):
            y = quant_matmul_int8_rows(x, self.fmt, self.planes(), self.in_features, out=out)
            return y if self.bias is None else y.add_(self.bias)
        if x.is_cuda:
            return self.kernel_forward(x, out)
        weight = dequantize(self.fmt, self.planes()).to(x.dtype)  # the reference path
        y = F.linear(x, weight, self.bias)
        return y if out is None else out.copy_(y)

    def kernel_forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The Triton path that CUDA takes (the interpreter runs it on CPU tensors in tests)."""
        if self.takes_dequant_gemm(x):
            scratch = self.scratch.buffer(x.dtype, x.device)
            return dequant_matmul(x, self.fmt, self.planes(), scratch, bias=self.bias, out=out)
        y = quant_matmul(x, self.fmt, self.planes(), self.in_features, out=out)
        return y if self.bias is None else y.add_(self.bias)

    def takes_int8_rows(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` would round ``x`` to int8 for an int8 kernel (GEMV or tensor
        cores): then the kernel that produces ``x`` may hand it over rounded (an ``Int8Rows``),
        saving a launch."""
        return x.is_cuda and takes_int8_rows(self.fmt, x.shape[0], self.in_features, x.dtype)

    def takes_dequant_gemm(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are many enough to dequantize the weight for cuBLAS (fp8 on
        Hopper keeps ``torch._scaled_mm``, which reads the e4m3 weight as it is)."""
        bound = DEQUANT_GEMM_MIN_ROWS
        if takes_mma(self.fmt, x.shape[0], x.dtype):
            bound = MMA_ROWS[self.fmt.name][1]
        if x.shape[0] < bound:
            return False
        return not uses_scaled_mm(x, self.fmt, self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the planes encode (for tests and error reports)."""
        return dequantize(self.fmt, self.planes())

    def load_rows(self, start: int, end: int, value: torch.Tensor | PackedWeight) -> None:
        """Fill output rows ``[start, end)`` from packed rows, or from float rows quantized here."""
        if isinstance(value, PackedWeight):
            if value.fmt != self.fmt:
                raise ModelLoadError(
                    f"rows {start}:{end} come in {value.fmt.name}, the layer holds {self.fmt.name}"
                )
            planes = value.planes
        else:
            planes = quantize(value.to(self.device), self.fmt)
        for name, dest in self.planes().items():
            rows = planes[name]
            if rows.shape != dest[start:end].shape:
                raise ModelLoadError(
                    f"{name} rows {start}:{end}: shape {tuple(rows.shape)} != expected "
                    f"{tuple(dest[start:end].shape)}"
                )
            dest[start:end].copy_(rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.fmt.name}, bias={self.bias is not None}"
        )


def allocate_dequant_scratch(
    model: nn.Module, max_rows: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Allocate the scratch of ``model``'s quantized linears now if a step of up to
    ``max_rows`` rows would use it; the bytes it holds (0: not needed). The engine calls this
    before it profiles its largest step and captures graphs, so the buffer counts once as
    used memory and never appears mid-capture."""
    probe = torch.empty(max_rows, 0, dtype=dtype, device=device)  # rows, dtype, device only
    scratches: dict[int, DequantScratch] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.takes_dequant_gemm(probe):
            scratches.setdefault(id(module.scratch), module.scratch)
    for scratch in scratches.values():
        scratch.buffer(dtype, device)
    return sum(scratch.allocated_bytes for scratch in scratches.values())
