"""Paged attention over a page pool: the plain-torch reference (also the CPU path).

Layout. The pool of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``. Sequence ``b`` owns pages ``block_tables[b, :ceil(seq_lens[b] / block_size)]``;
token ``t`` of it lives in page ``block_tables[b, t // block_size]`` at row
``t % block_size``. A batch packs the new tokens of every sequence into one ``[T, ...]``
tensor; ``query_start_loc[b]:query_start_loc[b + 1]`` are sequence ``b``'s new tokens, which
are its last ``query_len`` positions: causal among themselves, full over the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64: block * BS + row
) -> None:
    """Store each new token's K and V at its slot of the pool."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: list[int],  # context length of each sequence, new tokens included
    query_start_loc: list[int],  # [B + 1]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; [T, Hq, D]."""
    out = torch.empty_like(q)
    num_seqs = len(seq_lens)
    num_decodes = _leading_single_token_queries(query_start_loc)
    if num_decodes:
        end = query_start_loc[num_decodes]
        out[:end] = _decode_batch(
            q[:end], k_cache, v_cache, block_tables[:num_decodes], seq_lens[:num_decodes],
            scale, sliding_window,
        )  # fmt: skip
    for b in range(num_decodes, num_seqs):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        keys, values = _gather_context(k_cache, v_cache, block_tables[b], seq_lens[b])
        out[start:end] = _attend(q[start:end], keys, values, seq_lens[b], scale, sliding_window)
    return out


def _leading_single_token_queries(query_start_loc: list[int]) -> int:
    count = 0
    while count + 1 < len(query_start_loc) and (
        query_start_loc[count + 1] - query_start_loc[count] == 1
    ):
        count += 1
    return count


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_blocks = -(-seq_len // block_size)
    if num_blocks == 1:  # one page (or a contiguous per-sequence slot): a view, no copy
        block = int(block_table[0])
        return k_cache[block, :seq_len], v_cache[block, :seq_len]
    blocks = block_table[:num_blocks].long()
    keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def _attend(
    q: torch.Tensor,  # [Q, Hq, D]
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    query_len = q.shape[0]
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos  # [Q, L]: causal among new tokens, full over the context
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [Hq, Q, D]
        keys.to(q.dtype).transpose(0, 1),  # [Hkv, L, D]
        values.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _decode_batch(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_blocks = -(-max(seq_lens) // block_size)
    tables = block_tables[:, :max_blocks].long()
    batch = q.shape[0]
    keys = k_cache[tables].reshape(batch, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
    values = v_cache[tables].reshape(batch, -1, num_kv_heads, head_dim)
    lens = torch.tensor(seq_lens, device=q.device)[:, None]
    k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    mask = k_pos < lens  # [B, L]
    if sliding_window is not None:
        mask &= k_pos > lens - 1 - sliding_window
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, Hq, 1, D]
        keys.to(q.dtype).transpose(1, 2),  # [B, Hkv, L, D]
        values.to(q.dtype).transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]
