"""Matmuls against a layer's weight: ``out = x @ w.T`` with ``w`` dense, packed or fp8.

``quant.py`` holds the weight formats (q8_0, q4_0, q4_1, q4_k, q6_k, fp8), their planes and
the torch reference that dequantizes them. ``quant_matmul_triton.quant_matmul`` picks a kernel
by row count: the GEMVs for decode (blocked, k-quant, int8-activation, element-wise), the
tensor-core kernels for small batches (float, int8, fp8), the GEMM beyond; from many rows the
weight is dequantized for cuBLAS (``quant_dequant_triton.py``). ``gemv_triton.py`` is the
dense GEMV of 16-bit weights.
"""
