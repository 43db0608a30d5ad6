# @triton.jit functions take Triton pointers and blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""A sequence's K and V copied out of its pages into zero-padded rows, in Triton; matches
``prefill_sdpa.gather_rows_ref``.

Row ``r`` of ``keys_out [N, Hkv, D]`` is the sequence's token ``r`` (page
``block_table[r // BS]``, slot ``r % BS``) while ``r < seq_len``, and zeros after: the layout
``prefill_sdpa`` attends (``ChunkLayout``), whole key blocks first, then the causal square
with its padding. One launch writes each row once, K and V, where torch's gather, zero fills
and slice copies made about eight kernels and wrote each row twice.

A program copies ``BLOCK_ROWS`` whole rows, every KV head's values (a page's row is
``Hkv * D`` contiguous values, 2 KB for 8 heads of 128 in 16 bits): it reads each row's page
id, then loads the rows' K and V (none past ``seq_len``: zeros) and stores them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_write_triton import check_pool

# values a program moves per tensor: 16 KB of 16-bit K, 64 per thread of 4 warps
ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def _gather_rows_kernel(
    keys_out_ptr,  # [N, Hkv, D]
    values_out_ptr,  # [N, Hkv, D], keys_out's strides
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D], k_cache's strides
    block_table_ptr,  # [max_blocks], the sequence's pages in order
    seq_len,
    num_rows,
    stride_or, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # Hkv * D
    BLOCK_SIZE: tl.constexpr,  # rows per page
    BLOCK_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # ROW_SIZE to a power of two
):  # fmt: skip
    # 1. this program's rows, every head: the sequence's up to seq_len, padding after
    offs_r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_e = tl.arange(0, BLOCK_E)  # a row's values, head-major
    head, dim = offs_e // HEAD_DIM, offs_e % HEAD_DIM
    mask_e = offs_e < ROW_SIZE
    in_seq = offs_r < seq_len
    # 2. each row's page and slot; int64 offsets: a pool may pass 2^31 values
    page = tl.load(block_table_ptr + offs_r // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    src = page * stride_cb + (offs_r % BLOCK_SIZE) * stride_cs
    src_offs = src[:, None] + (head * stride_ch + dim * stride_cd)[None, :]
    load_mask = in_seq[:, None] & mask_e[None, :]
    dst = offs_r.to(tl.int64) * stride_or
    dst_offs = dst[:, None] + (head * stride_oh + dim * stride_od)[None, :]
    store_mask = (offs_r < num_rows)[:, None] & mask_e[None, :]
    # 3. K then V: the rows past seq_len load nothing and store zeros
    keys = tl.load(k_cache_ptr + src_offs, mask=load_mask, other=0.0)
    tl.store(keys_out_ptr + dst_offs, keys, mask=store_mask)
    values = tl.load(v_cache_ptr + src_offs, mask=load_mask, other=0.0)
    tl.store(values_out_ptr + dst_offs, values, mask=store_mask)


def gather_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
) -> None:
    """Writes into ``keys_out`` and ``values_out`` a sequence's first ``seq_len`` K and V rows
    out of its pages, and zeros into their rows past ``seq_len``.

    Shapes: ``k_cache, v_cache: [NB, BS, Hkv, D]`` (equal strides, any); ``block_table:
    [max_blocks]`` int32 or int64, the sequence's pages in order; ``keys_out, values_out:
    [N, Hkv, D]`` with ``N >= seq_len``, the pool's dtype, equal strides. ``seq_len`` is a host
    int: no host sync.
    """
    check_pool(k_cache, v_cache)
    if keys_out.shape != values_out.shape or keys_out.stride() != values_out.stride():
        raise ValueError(
            f"keys_out and values_out must have equal shapes and strides, got "
            f"{tuple(keys_out.shape)} / {tuple(values_out.shape)}"
        )
    if keys_out.dim() != 3 or keys_out.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"keys_out must be [N, Hkv, D] with the pool's [Hkv, D] "
                         f"{tuple(k_cache.shape[2:])}, got {tuple(keys_out.shape)}")  # fmt: skip
    if keys_out.dtype != k_cache.dtype or values_out.dtype != k_cache.dtype:
        raise ValueError(f"keys_out and values_out must be the pool's {k_cache.dtype}, got "
                         f"{keys_out.dtype} / {values_out.dtype}")  # fmt: skip
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be 1-D int32 or int64, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")  # fmt: skip
    devices = {t.device for t in (k_cache, block_table, keys_out, values_out)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not 0 <= seq_len <= min(keys_out.shape[0], block_table.shape[0] * k_cache.shape[1]):
        raise ValueError(
            f"seq_len {seq_len} must fit keys_out's {keys_out.shape[0]} rows and the "
            f"{block_table.shape[0]} pages of {k_cache.shape[1]} rows of block_table"
        )
    num_rows, num_kv_heads, head_dim = keys_out.shape
    if num_rows == 0:
        return
    block_e = triton.next_power_of_2(num_kv_heads * head_dim)
    block_rows = max(1, ELEMENTS_PER_PROGRAM // block_e)
    grid = (triton.cdiv(num_rows, block_rows),)
    _gather_rows_kernel[grid](
        keys_out, values_out, k_cache, v_cache, block_table, seq_len, num_rows,
        *keys_out.stride(), *k_cache.stride(),
        HEAD_DIM=head_dim, ROW_SIZE=num_kv_heads * head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_ROWS=block_rows, BLOCK_E=block_e,
    )  # fmt: skip
