"""Paged attention over a page pool: the plain-torch reference (also the CPU path).

Layout. The pool of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``. Sequence ``b`` owns pages ``block_tables[b, :ceil(seq_lens[b] / block_size)]``;
token ``t`` of it lives in page ``block_tables[b, t // block_size]`` at row
``t % block_size``. A batch packs the new tokens of every sequence into one ``[T, ...]``
tensor; ``query_start_loc[b]:query_start_loc[b + 1]`` are sequence ``b``'s new tokens, which
are its last ``query_len`` positions: causal among themselves, full over the cached context.

fp8. A pool of dtype ``torch.float8_e4m3fn`` comes with float32 scales ``k_scale, v_scale:
[num_blocks, block_size, num_kv_heads]``, one per (token, kv head): a vector ``x`` [head_dim]
is stored as ``e4m3(x / s)`` with ``s = max(amax(|x|) / 448, 1e-12)`` and read back as
``stored.float() * s``. A negative slot in a slot mapping means "write nothing" (padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MIN_SCALE = 1e-12  # keeps an all-zero vector's scale off zero


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (e4m3fn values [..., D], float32 scales [...]), one scale per vector."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return (x32 / scale[..., None]).to(FP8_DTYPE), scale


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``stored.float() * scale`` cast to ``dtype``."""
    return (stored.float() * scale[..., None]).to(dtype)


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64: block * BS + row; negative = skip the token
    *,
    k_scale: torch.Tensor | None = None,  # [NB, BS, Hkv] float32, with an fp8 pool
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each new token's K and V at its slot of the pool (quantized if the pool is fp8)."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = cache.view(-1, *cache.shape[2:])  # [NB * BS, Hkv, D]
        if cache.dtype == FP8_DTYPE:
            if scale is None:
                raise ValueError("an fp8 KV cache needs k_scale and v_scale tensors")
            x, x_scale = quantize_fp8(x)
            scale.view(-1, scale.shape[-1]).index_copy_(0, slot_mapping, x_scale)
            rows, x = rows.view(torch.uint8), x.view(torch.uint8)  # no fp8 index_copy_ on CPU
        rows.index_copy_(0, slot_mapping, x.to(rows.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: list[int],  # context length of each sequence, new tokens included
    query_start_loc: list[int],  # [B + 1]
    scale: float,
    sliding_window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,  # [NB, BS, Hkv] float32, with an fp8 pool
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; [T, Hq, D]."""
    if k_cache.dtype == FP8_DTYPE:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 KV cache needs k_scale and v_scale tensors")
        k_cache = _DequantizedPool(k_cache, k_scale, q.dtype)  # type: ignore[assignment]
        v_cache = _DequantizedPool(v_cache, v_scale, q.dtype)  # type: ignore[assignment]
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
        keys, values = gather_context(k_cache, v_cache, block_tables[b], seq_lens[b])
        out[start:end] = _attend(q[start:end], keys, values, seq_lens[b], scale, sliding_window)
    return out


def _leading_single_token_queries(query_start_loc: list[int]) -> int:
    count = 0
    while count + 1 < len(query_start_loc) and (
        query_start_loc[count + 1] - query_start_loc[count] == 1
    ):
        count += 1
    return count


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``seq_len`` keys and values, ``[seq_len, Hkv, D]`` each, in order:
    a view of its page when it has one, else a contiguous copy of its pages' rows."""
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


class _DequantizedPool:
    """An fp8 pool that dequantizes only the pages it is indexed with (as a tensor would be)."""

    def __init__(self, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.stored, self.scale, self.dtype = stored, scale, dtype
        self.shape = stored.shape

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_fp8(self.stored[index], self.scale[index], self.dtype)  # type: ignore[index]
