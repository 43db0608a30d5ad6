"""Kernel benchmarks for ``pagestream bench kernels``: achieved bandwidth vs a device copy.

Decode attention is memory bound: every step reads each sequence's K and V once. The figure
of merit is ``bytes of K+V read / time`` over the bandwidth of a large device-to-device copy
(counting its read and write bytes), measured on the same device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

COPY_BYTES = 1 << 30  # 1 GiB source: far beyond any L2
NUM_POOL_COPIES = 4  # the pool is spread so that repeated runs do not hit L2


def _require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("kernel benchmarks need a CUDA device; none is visible to torch")
    return torch.device("cuda")


def measure_copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Device copy bandwidth in bytes/s ((read + write) bytes / median time)."""
    import triton.testing

    _require_cuda()
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.random_()
    time_ms = triton.testing.do_bench(
        lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median"
    )
    return 2 * COPY_BYTES / (time_ms * 1e-3)


def bench_paged_attention(
    batch_sizes: Sequence[int],
    context_lens: Sequence[int],
    block_sizes: Sequence[int],
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    num_kv_splits: int | None = None,
    with_reference: bool = True,
) -> list[dict[str, Any]]:
    """Decode attention (one new token per sequence) at each (batch, context, block size).

    Each record: batch, context, block_size, time_us, bytes_read (K+V, with fp8 scales),
    achieved_bytes_per_s, fraction_of_copy, and ref_time_us (the torch reference, timed
    when the pool is small enough to gather cheaply; else None).
    """
    device = _require_cuda()
    copy_bytes_per_s = measure_copy_bandwidth(device)
    records = []
    for block_size in block_sizes:
        for batch in batch_sizes:
            for context in context_lens:
                record = _bench_point(
                    batch, context, block_size, num_q_heads, num_kv_heads, head_dim,
                    dtype, cache_dtype or dtype, num_kv_splits, with_reference,
                )  # fmt: skip
                record["fraction_of_copy"] = record["achieved_bytes_per_s"] / copy_bytes_per_s
                records.append(record)
    return records


def _bench_point(
    batch: int,
    context: int,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_splits: int | None,
    with_reference: bool,
) -> dict[str, Any]:
    import triton.testing

    from kernels.attention.paged_attention import paged_attention_ref
    from kernels.attention.paged_attention_triton import paged_attention

    # Disjoint page sets, cycled call after call: a replay cannot run out of L2.
    pool, input_sets = _decode_inputs(
        batch, context, block_size, num_q_heads, num_kv_heads, head_dim, dtype, cache_dtype
    )
    k_cache, v_cache, k_scale, v_scale = pool

    def run_all_sets() -> None:
        for q, block_tables, seq_lens, starts, out in input_sets:
            paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, starts, scale=head_dim**-0.5,
                max_query_len=1, num_decodes=q.shape[0], k_scale=k_scale, v_scale=v_scale,
                num_kv_splits=num_kv_splits, out=out,
            )  # fmt: skip

    # Replayed from a CUDA graph, as the engine runs decode (torch.cuda.graph, as the engine
    # captures it): no Python launch overhead. One replay runs every page set once.
    run_all_sets()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all_sets()
    replay_ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    time_ms = replay_ms / len(input_sets)
    element_bytes = torch.finfo(cache_dtype).bits // 8
    token_bytes = num_kv_heads * (head_dim * element_bytes + (4 if k_scale is not None else 0))
    bytes_read = 2 * batch * context * token_bytes  # K and V of every token, once
    ref_time_us = None
    if with_reference and batch * context <= 64 * 4096:
        q, block_tables, seq_lens, starts, _ = input_sets[0]
        lens, locs = seq_lens.tolist(), starts.tolist()

        def run_reference() -> None:
            paged_attention_ref(
                q, k_cache, v_cache, block_tables, lens, locs, head_dim**-0.5,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip

        ref_ms = triton.testing.do_bench(run_reference, warmup=5, rep=50, return_mode="median")
        ref_time_us = ref_ms * 1e3
    return dict(
        batch=batch,
        context=context,
        block_size=block_size,
        time_us=time_ms * 1e3,
        bytes_read=bytes_read,
        achieved_bytes_per_s=bytes_read / (time_ms * 1e-3),
        ref_time_us=ref_time_us,
    )


def _decode_inputs(
    batch: int,
    context: int,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> tuple[tuple[Any, ...], list[tuple[torch.Tensor, ...]]]:
    """A random pool, and NUM_POOL_COPIES decode batches over disjoint random pages of it."""
    device = torch.device("cuda")
    pages_per_seq = -(-context // block_size)
    num_blocks = batch * pages_per_seq * NUM_POOL_COPIES
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype).to(cache_dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype).to(cache_dtype)
    k_scale = v_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        k_scale = torch.rand(shape[:3], device=device) * 0.01
        v_scale = torch.rand(shape[:3], device=device) * 0.01
    pages = torch.randperm(num_blocks, device=device).to(torch.int32)
    input_sets: list[tuple[torch.Tensor, ...]] = []
    for block_tables in pages.view(NUM_POOL_COPIES, batch, pages_per_seq):
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, num_q_heads, head_dim, device=device, dtype=dtype)
        input_sets.append((q, block_tables, seq_lens, starts, torch.empty_like(q)))
    return (k_cache, v_cache, k_scale, v_scale), input_sets
