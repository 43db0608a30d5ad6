"""Compute kernels of pagestream: each op with a plain-torch reference of the same function.

The references here are the CPU path of the engine and the ground truth that the Triton
kernels are tested against.
"""
