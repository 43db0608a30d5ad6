"""Matmuls against a layer's weight: ``out = x @ w.T`` with ``w`` dense, packed or fp8.

``quant.py`` holds the weight formats (q8_0, q4_0, q4_1, q4_k, q6_k, fp8), their planes and
the torch reference that dequantizes them. ``quant_matmul_triton.quant_matmul`` launches the
kernel that ``quant_matmul_config.py`` picks by format and row count: the decode GEMVs
(``quant_gemv_blocked``, ``_kquant``, ``_int8``, and ``quant_gemm_triton.py``'s element-wise
one), the tensor-core kernels for small batches (``quant_mma``, ``quant_mma_int8``,
``fp8_mma``), the GEMM beyond (``quant_gemm_triton.py``); from many rows the weight is
dequantized for cuBLAS (``quant_dequant_triton.py``). The int8 kernels multiply activations
rounded to int8 blocks (``int8_rows_triton.py``), fp8 ones rows rounded to e4m3
(``fp8_rows_triton.py``). ``gemv_triton.py`` is the GEMV of 16-bit weights; ``common.py``
holds what the kernels share (tile offsets, the K split and its stores).
"""
