"""Fused mixture-of-experts: a router's top-k, then each token through its experts' MLPs.

``moe.py`` holds the plain-torch references (``route_topk_ref``, ``fused_moe_ref``), the ground
truth the Triton kernels match. The Triton path is four steps, each its own file:

1. ``router_triton.py``: softmax over the router logits, top-k, renormalised as the model says;
2. ``align_triton.py``: the (token, slot) pairs sorted by expert on the device, each expert's
   run padded to the GEMM's ``BLOCK_M`` (no host sync: buffers sized for the worst case);
3. ``grouped_gemm_triton.py``: gate/up with SiLU-and-mul fused, then down with the routing
   weight applied, each program one expert's ``BLOCK_M`` rows; then the top-k sum;
4. ``config.py``: the block sizes per shape, from the table ``bench/moe_sweep.py`` measures.

For a handful of pairs ``direct_triton.py`` replaces 2 and 3: a program per pair, GEMV tiles.
``fused_moe_triton.fused_moe`` runs them in order.
"""
