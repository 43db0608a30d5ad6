"""Rotary + KV write: the fused kernel (one launch) against rotary then write_kv (two).

    python -m bench.rotary_kv_write [--tokens 1 8 256 8192] [--fp8]

llama3-8b's attention shapes (32 q heads, 8 kv heads, D=128, bf16). Each variant runs once
per layer (32 layers, each its own pool slice) inside one CUDA graph, as a decode step
replays it: a launch's fixed cost inside a graph counts, the replay's own is spread. Prints
microseconds per layer and the bytes each layer moves (q read and written, k and v read, the
K/V rows written) over that time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq

NUM_LAYERS = 32
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
MAX_POSITIONS = 8192


def bench_rotary_write_kv(token_counts: Sequence[int], fp8: bool) -> list[dict[str, Any]]:
    """One record per token count: tokens, fused_us, two_kernels_us (per layer), bytes."""
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA device; none is visible to torch")
    return [_bench_point(num_tokens, fp8) for num_tokens in token_counts]


def _bench_point(num_tokens: int, fp8: bool) -> dict[str, Any]:
    from kernels.attention.kv_write_triton import write_kv
    from kernels.elementwise.rotary_kv_write_triton import rotary_write_kv
    from kernels.elementwise.rotary_triton import rotary

    device, dtype = torch.device("cuda"), torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, device=device, dtype=dtype)
    q_end, k_end = NUM_Q_HEADS * HEAD_DIM, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM
    q = qkv[:, :q_end].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    k = qkv[:, q_end:k_end].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, k_end:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), device=device)
    cos, sin = rope_cos_sin_cache(rope_inv_freq(HEAD_DIM, 500000.0, None), MAX_POSITIONS)
    cos, sin = cos.to(device), sin.to(device)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    pool_shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pool = torch.zeros(pool_shape, device=device, dtype=cache_dtype)
    scales = torch.zeros(pool_shape[:-1], device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]

    def layer_args(layer: int) -> dict[str, Any]:
        args: dict[str, Any] = dict(k_cache=pool[layer, 0], v_cache=pool[layer, 1])
        if fp8:
            args |= dict(k_scale=scales[layer, 0], v_scale=scales[layer, 1])
        return args

    def fused() -> None:
        for layer in range(NUM_LAYERS):
            rotary_write_kv(q, k, v, positions, cos, sin, slot_mapping=slots, **layer_args(layer))

    def two_kernels() -> None:
        for layer in range(NUM_LAYERS):
            rotary(q, k, positions, cos, sin)
            write_kv(k, v, slot_mapping=slots, **layer_args(layer))

    element_bytes = torch.finfo(cache_dtype).bits // 8
    row_bytes = NUM_KV_HEADS * (HEAD_DIM * element_bytes + (4 if fp8 else 0))
    layer_bytes = num_tokens * (
        2 * q_end * 2 + 2 * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * row_bytes
    )  # q read + written, k and v read (bf16), K and V rows written
    fused_us, two_us = _graph_time_us(fused), _graph_time_us(two_kernels)
    return dict(
        tokens=num_tokens,
        cache_dtype=str(cache_dtype).removeprefix("torch."),
        fused_us=fused_us,
        two_kernels_us=two_us,
        layer_bytes=layer_bytes,
        fused_bytes_per_s=layer_bytes / (fused_us * 1e-6),
    )


def _graph_time_us(run_all_layers: Callable[[], None]) -> float:
    """Median time of one layer's launches, replayed from a CUDA graph of all the layers."""
    import triton.testing

    run_all_layers()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all_layers()
    replay_ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return replay_ms * 1e3 / NUM_LAYERS


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    parser.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) pool with scales")
    args = parser.parse_args(argv)
    print(f"{'tokens':>6} {'pool':>13} {'fused us':>9} {'2 kernels us':>13} {'fused GB/s':>11}")
    for record in bench_rotary_write_kv(args.tokens, args.fp8):
        print(f"{record['tokens']:>6} {record['cache_dtype']:>13} {record['fused_us']:>9.2f} "
              f"{record['two_kernels_us']:>13.2f} {record['fused_bytes_per_s'] / 1e9:>11.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
