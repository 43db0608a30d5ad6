"""Quantized linear layers: packed weights served by kernels that dequantize in registers."""

from engine.quant.linear import PackedWeight, QuantizedLinear, allocate_dequant_scratch

__all__ = ["PackedWeight", "QuantizedLinear", "allocate_dequant_scratch"]
