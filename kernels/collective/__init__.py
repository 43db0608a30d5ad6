"""Ops whose kernels read other tensor-parallel ranks' buffers (peer-mapped through torch's
symmetric memory) and meet them at device-side barriers.

``allreduce_norm``: the sum of every rank's partial result, the residual add and RMSNorm
after it, as one kernel (``allreduce_norm.py`` the torch reference, ``allreduce_norm_triton.py``
the kernel); ``peer_barrier_triton.py``: the barrier its programs meet at.
"""
