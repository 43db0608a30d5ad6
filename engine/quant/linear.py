"""``QuantizedLinear``: a linear layer whose weight stays packed in a quantized format.

On CUDA the matmul runs in the Triton kernels that dequantize in registers
(kernels/quant_matmul_triton.py); elsewhere a reference dequantizes the whole weight to the
activations' dtype and calls ``F.linear`` (correct, not fast: CPU serving defaults to float
weights). The planes are buffers, so ``model.to(dtype)`` must not be used on a model that holds
these: the loader casts parameters only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from kernels.quant import QuantFormat, dequantize, empty_planes, quantize
from kernels.quant_matmul_triton import quant_matmul


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
    ) -> None:
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
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @property
    def device(self) -> torch.device:
        return next(self.buffers(recurse=False)).device

    def planes(self) -> dict[str, torch.Tensor]:
        """The packed planes by field name: this module's own buffers (no copy per call)."""
        return self._buffers  # type: ignore[return-value]  # every entry is a registered plane

    def forward(
        self,
        x: torch.Tensor,  # [T, in_features]
        out: torch.Tensor | None = None,  # [T, out_features]
    ) -> torch.Tensor:  # [T, out_features]
        if x.is_cuda:
            if self.bias is None:
                return quant_matmul(x, self.fmt, self.planes(), self.in_features, out=out)
            y = quant_matmul(x, self.fmt, self.planes(), self.in_features) + self.bias
            return y if out is None else out.copy_(y)
        weight = dequantize(self.fmt, self.planes()).to(x.dtype)  # the reference path
        y = F.linear(x, weight, self.bias)
        return y if out is None else out.copy_(y)

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
