"""Quantized linear layers: packed weights served by kernels that dequantize in registers."""

from engine.quant.linear import PackedWeight, QuantizedLinear

__all__ = ["PackedWeight", "QuantizedLinear"]
