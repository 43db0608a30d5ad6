"""Rotary + KV write: the fused kernel (one launch) against the launches it replaced.

    python -m bench.rotary_kv_write [--tokens 1 8 256 8192] [--fp8] [--qk-norm]

llama3-8b's attention shapes (32 q heads, 8 kv heads, D=128, bf16; Qwen3-8B's are the same).
Without ``--qk-norm`` the fused kernel runs against rotary then write_kv (two launches); with
it, against Qwen3's path before the norms were folded in: the norm kernel on q and on k (new
tensors, as q_norm and k_norm made), then the fused kernel without norms (three launches).
Each variant runs once per layer (32 layers, each its own pool slice) inside one CUDA graph,
as a decode step replays it: a launch's fixed cost inside a graph counts, the replay's own is
spread. Prints microseconds per layer and the bytes each layer of the fused kernel moves (q
read and written, k and v read, the K/V rows written) over its time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.elementwise.norm import HeadNorms
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq

NUM_LAYERS = 32
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
MAX_POSITIONS = 8192
NORM_EPS = 1e-6  # Qwen3's rms_norm_eps


def bench_rotary_write_kv(
    token_counts: Sequence[int], fp8: bool, qk_norm: bool = False
) -> list[dict[str, Any]]:
    """One record per token count: tokens, fused_us, unfused_us (per layer), bytes."""
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA device; none is visible to torch")
    return [_bench_point(num_tokens, fp8, qk_norm) for num_tokens in token_counts]


@dataclass
class LayerInputs:
    """A step's new tokens as views of one fused qkv output, and the pools of every layer."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # [MAX_POSITIONS, D] float32
    sin: torch.Tensor
    slots: torch.Tensor  # [T] int64
    pool: torch.Tensor  # [L, 2, NB, BS, Hkv, D]
    scales: torch.Tensor | None  # [L, 2, NB, BS, Hkv] float32 with an fp8 pool

    @classmethod
    def random(cls, num_tokens: int, cache_dtype: torch.dtype) -> LayerInputs:
        device, dtype = torch.device("cuda"), torch.bfloat16
        width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        qkv = torch.randn(num_tokens, width, device=device, dtype=dtype)
        q_end, k_end = NUM_Q_HEADS * HEAD_DIM, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM
        cos, sin = rope_cos_sin_cache(rope_inv_freq(HEAD_DIM, 500000.0, None), MAX_POSITIONS)
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        pool_shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        fp8 = cache_dtype == torch.float8_e4m3fn
        return cls(
            q=qkv[:, :q_end].view(num_tokens, NUM_Q_HEADS, HEAD_DIM),
            k=qkv[:, q_end:k_end].view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            v=qkv[:, k_end:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            positions=torch.randint(0, MAX_POSITIONS, (num_tokens,), device=device),
            cos=cos.to(device),
            sin=sin.to(device),
            slots=torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens],
            pool=torch.zeros(pool_shape, device=device, dtype=cache_dtype),
            scales=torch.zeros(pool_shape[:-1], device=device) if fp8 else None,
        )

    def pool_args(self, layer: int) -> dict[str, Any]:
        """Layer ``layer``'s k_cache, v_cache (and scales with an fp8 pool)."""
        args: dict[str, Any] = dict(k_cache=self.pool[layer, 0], v_cache=self.pool[layer, 1])
        if self.scales is not None:
            args |= dict(k_scale=self.scales[layer, 0], v_scale=self.scales[layer, 1])
        return args


def _variants(
    inputs: LayerInputs, norms: HeadNorms | None
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(fused, unfused): each runs its launches once per layer."""
    from kernels.attention.kv_write_triton import write_kv
    from kernels.elementwise.norm_triton import rms_norm
    from kernels.elementwise.rotary_kv_write_triton import rotary_write_kv
    from kernels.elementwise.rotary_triton import rotary

    x = inputs
    rope = (x.positions, x.cos, x.sin)

    def fused() -> None:
        for layer in range(NUM_LAYERS):
            rotary_write_kv(
                x.q, x.k, x.v, *rope, slot_mapping=x.slots, head_norms=norms, **x.pool_args(layer)
            )

    def two_kernels() -> None:  # rotary, then write_kv
        for layer in range(NUM_LAYERS):
            rotary(x.q, x.k, *rope)
            write_kv(x.k, x.v, slot_mapping=x.slots, **x.pool_args(layer))

    def norms_then_fused() -> None:  # q_norm, k_norm, then the fused kernel without norms
        assert norms is not None
        for layer in range(NUM_LAYERS):
            q = rms_norm(x.q, norms.q_weight, norms.eps)
            k = rms_norm(x.k, norms.k_weight, norms.eps)
            rotary_write_kv(q, k, x.v, *rope, slot_mapping=x.slots, **x.pool_args(layer))

    return fused, (two_kernels if norms is None else norms_then_fused)


def _bench_point(num_tokens: int, fp8: bool, qk_norm: bool) -> dict[str, Any]:
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    inputs = LayerInputs.random(num_tokens, cache_dtype)
    norms = None
    if qk_norm:  # weights about 1, as trained Qwen3 norms have
        weights = 1 + 0.1 * torch.randn(2, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        norms = HeadNorms(weights[0], weights[1], NORM_EPS)
    fused, unfused = _variants(inputs, norms)
    element_bytes = torch.finfo(cache_dtype).bits // 8
    row_bytes = NUM_KV_HEADS * (HEAD_DIM * element_bytes + (4 if fp8 else 0))
    layer_bytes = num_tokens * (
        2 * NUM_Q_HEADS * HEAD_DIM * 2 + 2 * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * row_bytes
    )  # q read + written, k and v read (bf16), K and V rows written
    fused_us, unfused_us = _graph_time_us(fused), _graph_time_us(unfused)
    return dict(
        tokens=num_tokens,
        cache_dtype=str(cache_dtype).removeprefix("torch."),
        qk_norm=qk_norm,
        unfused="q_norm + k_norm + rotary_write_kv" if qk_norm else "rotary + write_kv",
        fused_us=fused_us,
        unfused_us=unfused_us,
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
    parser.add_argument(
        "--qk-norm",
        action="store_true",
        help="Qwen3's per-head q/k norms: fused into the kernel against their own launches",
    )
    args = parser.parse_args(argv)
    records = bench_rotary_write_kv(args.tokens, args.fp8, args.qk_norm)
    print(f"unfused: {records[0]['unfused'] if records else '-'}")
    print(f"{'tokens':>6} {'pool':>13} {'fused us':>9} {'unfused us':>11} {'fused GB/s':>11}")
    for record in records:
        print(f"{record['tokens']:>6} {record['cache_dtype']:>13} {record['fused_us']:>9.2f} "
              f"{record['unfused_us']:>11.2f} {record['fused_bytes_per_s'] / 1e9:>11.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
