"""The attention-backend interface and the metadata the model runner hands to it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.paged_attention import paged_attention_ref, write_kv_ref

ATTN_BACKEND_ENV = "PAGESTREAM_ATTN_BACKEND"


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens go in the page pool and which pages each sequence reads.

    Sequences are ordered decodes first (``num_decodes`` leading sequences with one new token
    each), then prefill chunks. Device tensors are built once per step by the model runner
    and shared by every layer.
    """

    slot_mapping: torch.Tensor  # [T] int64: page * block_size + row of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    num_decodes: int
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """Writes the new K/V into the pool, then attends each new query over its context."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class TorchAttentionBackend:
    """Plain-torch paged attention: the CPU path and the reference for the Triton kernels."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_cpu,
            meta.query_start_loc_cpu,
            scale,
            sliding_window,
        )


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend for ``device``; ``PAGESTREAM_ATTN_BACKEND=torch`` forces the reference."""
    choice = os.environ.get(ATTN_BACKEND_ENV, "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"{ATTN_BACKEND_ENV}={choice!r}: expected auto or torch")
    return TorchAttentionBackend()
