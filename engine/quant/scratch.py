"""The float weight room that a model's quantized linears share for the dequantize-then-cuBLAS
path (kernels/linear/quant_dequant_triton.py).

One buffer per device and dtype, sized once for the largest linear (an LM head beyond
``MAX_SLICE_ROWS`` output rows is taken in slices): linears run one after another, so one
weight's room serves them all. It is allocated outside the memory profile (engine/runtime.py
calls engine/quant/linear.py's ``allocate_dequant_scratch`` before it measures), so the pool
plan counts it once as used memory, and before any CUDA graph is captured: captured steps
then reuse its address.
"""

from __future__ import annotations

import torch

MAX_SLICE_ROWS = 32768  # output rows a slice holds: an LM head of 128k rows takes 4 slices


class DequantScratch:
    """A flat buffer per ``(device, dtype)`` with room for the largest reserved weight."""

    def __init__(self) -> None:
        self.num_elements = 0
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def reserve(self, num_rows: int, size_k: int) -> None:
        """Make room for a weight ``[num_rows, size_k]`` (in slices of ``MAX_SLICE_ROWS``)."""
        if self._buffers:
            raise RuntimeError("DequantScratch: a weight reserved after the buffer exists")
        self.num_elements = max(self.num_elements, min(num_rows, MAX_SLICE_ROWS) * size_k)

    def buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The flat buffer for ``dtype`` on ``device``, allocated at its first request."""
        if device.type == "cuda" and device.index is None:  # "cuda" and x's "cuda:0": one
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "DequantScratch: first use inside CUDA graph capture; allocate it before "
                    "capturing (engine.quant.allocate_dequant_scratch)"
                )
            buffer = torch.empty(self.num_elements, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
