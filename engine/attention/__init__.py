"""Attention backends: one interface, a plain-torch implementation (CPU), Triton on CUDA."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
