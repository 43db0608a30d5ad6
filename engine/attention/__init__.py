"""Kernel backends: one interface, plain-torch references (CPU) and Triton kernels (CUDA)."""

from engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerCache,
    LayerOps,
    RopeInputs,
    get_attention_backend,
)
from kernels.elementwise.norm import HeadNorms

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "HeadNorms",
    "LayerCache",
    "LayerOps",
    "RopeInputs",
    "get_attention_backend",
]
