"""A decode-size sum over the ranks with the residual add and RMSNorm after it, three ways,
each timed inside a CUDA graph as the decode graphs run them (a dependent chain: each call's
normed rows are the next call's share):

- ``nccl+norm``: NCCL's all-reduce, then the Triton residual add + RMSNorm (what ``auto`` ran
  before the fusion at these sizes);
- ``one-shot+norm``: the peer one-shot (a copy into the mapped buffer, then torch's kernel),
  then the norm;
- ``fused``: one kernel for the three (``engine.distributed.peer_norm``).

``python -m bench.allreduce_norm --world-size 2 --output-json OUT.json`` (a record of kind
``allreduce-norm``: one row per shape and path, with its largest difference from
``nccl+norm``'s normed rows on the same inputs, and the fused kernel's speedup by shape).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
import torch.distributed as dist

from bench.allreduce import CALLS_PER_GRAPH, graphs_record, replay_us, spawn_ranks
from bench.records import save
from engine.distributed.peer_allreduce import PeerAllReduce
from engine.distributed.peer_norm import FUSED_SLOT_BYTES

PATHS = ("nccl+norm", "one-shot+norm", "fused")
HIDDEN_SIZES = (4096, 8192)  # llama3-8b's and llama3-70b's
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # decode batches, up to what the fused kernel holds
EPS = 1e-5


def shapes(max_bytes: int = FUSED_SLOT_BYTES) -> list[tuple[int, int]]:
    """``(rows, hidden)`` of the bf16 messages that the fused kernel holds."""
    return [(r, h) for h in HIDDEN_SIZES for r in ROWS if 2 * r * h <= max_bytes]


def _step(
    path: str, peer: PeerAllReduce, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], the new residual
    from kernels.elementwise.norm_triton import fused_add_rms_norm

    if path == "fused":
        assert peer.norm is not None
        return peer.norm(x, residual, weight, EPS)
    if path == "one-shot+norm":
        x = peer.all_reduce(x, "one-shot")
    else:
        dist.all_reduce(x)
    return fused_add_rms_norm(x, residual, weight, EPS)


def _inputs(
    rows: int, hidden: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # this rank's x, residual, weight (bf16)
    gen = torch.Generator(device="cuda").manual_seed(rows * hidden)
    residual = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(hidden, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5
    gen.manual_seed(rows * hidden + rank + 1)
    x = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    return x, residual, weight


def _error(path: str, peer: PeerAllReduce, rows: int, hidden: int, rank: int) -> float:
    """Largest |difference| of ``path``'s normed rows from ``nccl+norm``'s, same inputs."""
    x, residual, weight = _inputs(rows, hidden, rank)
    normed, _ = _step(path, peer, x.clone(), residual.clone(), weight)
    expected, _ = _step("nccl+norm", peer, x.clone(), residual.clone(), weight)
    return float((normed.float() - expected.float()).abs().max())


def _time_in_graph(path: str, peer: PeerAllReduce, rows: int, hidden: int, rank: int) -> float:
    """Microseconds per call, replaying a graph of ``CALLS_PER_GRAPH`` chained calls."""
    x, residual, weight = _inputs(rows, hidden, rank)

    def chain() -> None:
        h, r = x, residual
        for _ in range(CALLS_PER_GRAPH):
            h, r = _step(path, peer, h, r, weight)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    dist.barrier()
    return replay_us(graph)


def _measure(
    sizes: list[tuple[int, int]], peer: PeerAllReduce, rank: int, world: int
) -> list[dict[str, Any]]:
    results = []
    for rows, hidden in sizes:
        for path in PATHS:
            error = _error(path, peer, rows, hidden, rank)
            us = _time_in_graph(path, peer, rows, hidden, rank)
            results.append(
                {"rows": rows, "hidden": hidden, "bytes": 2 * rows * hidden, "path": path}
                | {"us": us, "max_abs_err": error}
            )
    return results


def fused_speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape: the fused kernel's time against the faster unfused path's."""
    speedups = []
    for rows, hidden in sorted({(r["rows"], r["hidden"]) for r in results}):
        by_path = {
            r["path"]: r["us"] for r in results if (r["rows"], r["hidden"]) == (rows, hidden)
        }
        unfused = min(us for path, us in by_path.items() if path != "fused")
        speedups.append(
            {"rows": rows, "hidden": hidden, "fused_us": by_path["fused"], "unfused_us": unfused}
            | {"speedup": unfused / by_path["fused"]}
        )
    return speedups


def run(world: int, sizes: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Every path at every shape (default ``shapes()``) on GPUs 0..world-1: the record."""
    results = spawn_ranks(world, functools.partial(_measure, sizes or shapes()))
    return graphs_record("allreduce-norm", world, results) | {
        "fused_speedups": fused_speedups(results)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    record = run(args.world_size)
    for row in record["results"]:
        print(
            f"{row['rows']:>4} x {row['hidden']:<5} {row['path']:>14}  {row['us']:7.2f} us"
            f"  err {row['max_abs_err']:.3g}"
        )
    for row in record["fused_speedups"]:
        print(f"{row['rows']:>4} x {row['hidden']:<5} fused {row['speedup']:.2f}x the unfused")
    save(record, args.output_json)


if __name__ == "__main__":
    main()
