"""Compute kernels of pagestream: each op with a plain-torch reference of the same function.

The references are the CPU path of the engine and the ground truth that the Triton kernels
are tested against. A folder per family, each reference beside its kernels:

    attention/    paged attention (decode, prefill) over the page pool, and the KV write
    collective/   ops that read the other tensor-parallel ranks' buffers: the all-reduce
                  fused with the residual add and RMSNorm after it
    elementwise/  per-token ops around them: RMSNorm, rotary embedding, SiLU-and-mul, and
                  rotary fused with the KV write
    linear/       matmuls against a layer's weight: the dense GEMV, the quantized formats
                  (quant.py) and their GEMVs, GEMM, tensor-core kernels and dequantizer, fp8
    pdl.py        programmatic dependent launch, which every family's launchers use
"""
