"""Per-token ops around attention and the MLP: each token's row computed on its own.

RMSNorm and residual-add + RMSNorm (``norm``), rotary embedding (``rotary``), SiLU-and-mul
(``activation``), and rotary fused with the KV write (``rotary_kv_write``, what the engine
runs): each ``X.py`` the torch reference, ``X_triton.py`` its kernel. The norms and SiLU can
round their output to int8 blocks for the int8 matmuls of ``kernels.linear``.
"""
