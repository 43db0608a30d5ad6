"""Kernels on a step's logits before sampling: the grammar's token bitmask."""
