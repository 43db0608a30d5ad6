"""All-reduce latency by message size and path on one host's GPUs: NCCL against the peer-buffer
one-shot and two-shot sums (``engine.distributed.peer_allreduce``), each checked against an
fp32 sum and timed inside a CUDA graph as the decode graphs run them.

``python -m bench.allreduce --world-size 2 --output-json OUT.json`` (a record of kind
``allreduce``: one row per size and path, and the size table the timings suggest). The sum
with the residual add and RMSNorm after it, unfused against the fused kernel:
``bench/allreduce_norm.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.records import machine_info, save, utc_now
from engine.distributed.group import NO_MULTICAST_ENV
from engine.distributed.peer_allreduce import MAX_PEER_BYTES, PeerAllReduce

METHODS = ("nccl", "one-shot", "two-shot")
HIDDEN_SIZES = (4096, 8192)  # llama3-8b's and llama3-70b's
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # decode batches and small prefill chunks
CALLS_PER_GRAPH = 32
REPLAYS = 20


def message_sizes(max_bytes: int = MAX_PEER_BYTES) -> list[int]:
    """bf16 element counts of the model's all-reduces at decode and small prefill sizes."""
    sizes = {rows * hidden for rows in ROWS for hidden in HIDDEN_SIZES}
    return sorted(n for n in sizes if 2 * n <= max_bytes)


def _sum(x: torch.Tensor, method: str, peer: PeerAllReduce) -> torch.Tensor:
    if method == "nccl":
        dist.all_reduce(x)
        return x
    return peer.all_reduce(x, method)


def _check(numel: int, method: str, peer: PeerAllReduce, rank: int, world: int) -> float:
    """Max |error| of one sum of random bf16 inputs against the fp32 sum of the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + numel)
    inputs = [
        torch.randn(numel, generator=gen, device="cuda", dtype=torch.float32) for _ in range(world)
    ]
    expected = torch.stack([t.bfloat16().float() for t in inputs]).sum(0)
    got = _sum(inputs[rank].bfloat16(), method, peer).float()
    return float((got - expected).abs().max())


def _time_in_graph(numel: int, method: str, peer: PeerAllReduce) -> float:
    """Microseconds per all-reduce, replaying a graph of ``CALLS_PER_GRAPH`` of them."""
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        for _ in range(3):
            _sum(x.clone(), method, peer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(CALLS_PER_GRAPH):
            y = _sum(y, method, peer) * 0.5  # keeps values bounded; a dependent chain
    dist.barrier()
    return replay_us(graph)


def _scale_us(numel: int) -> float:
    """The ``* 0.5`` each timed call carries, to subtract it out."""
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            x = x * 0.5
    return replay_us(graph)


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds per captured call: one untimed replay, then ``REPLAYS`` timed ones."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * CALLS_PER_GRAPH)


def _measure_sums(
    sizes: list[int], peer: PeerAllReduce, rank: int, world: int
) -> list[dict[str, Any]]:
    rows = []
    for numel in sizes:
        overhead_us = _scale_us(numel)
        for method in METHODS:
            error = _check(numel, method, peer, rank, world)
            us = _time_in_graph(numel, method, peer) - overhead_us
            rows.append({"bytes": 2 * numel, "method": method, "us": us, "max_abs_err": error})
    return rows


Measure = Callable[[PeerAllReduce, int, int], list[dict[str, Any]]]  # (peer, rank, world)


def _rank(rank: int, world: int, port: int, measure: Measure, queue: Any) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "one-shot")
    rows = measure(peer, rank, world)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(world: int, measure: Measure) -> list[dict[str, Any]]:
    """Rank 0's rows of ``measure`` (a picklable function), run by one process per GPU
    0..world-1 with the peer buffers mapped (one-shot, and the fused norm's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, measure, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows: list[dict[str, Any]] = queue.get()
    for proc in procs:
        proc.join(60)
    return rows


def suggested_bands(rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """``(max_bytes, method)`` bands of the fastest path at each measured size, neighbouring
    sizes with the same winner merged (``peer_allreduce.SizeTable``'s form)."""
    bands: list[tuple[int, str]] = []
    for size in sorted({row["bytes"] for row in rows}):
        fastest = min((row for row in rows if row["bytes"] == size), key=lambda row: row["us"])
        if bands and bands[-1][1] == fastest["method"]:
            bands[-1] = (size, fastest["method"])
        else:
            bands.append((size, fastest["method"]))
    return bands


def run(world: int, sizes: list[int] | None = None) -> dict[str, Any]:
    """Every path at every size (bf16 element counts; default ``message_sizes()``) on GPUs
    0..world-1: the record."""
    rows = spawn_ranks(world, functools.partial(_measure_sums, sizes or message_sizes()))
    return graphs_record("allreduce", world, rows) | {"suggested_bands": suggested_bands(rows)}


def graphs_record(kind: str, world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """A record of bf16 collectives timed in CUDA graphs on ``world`` GPUs: ``results`` with the
    machine and the settings they ran under."""
    return {
        "kind": kind,
        "created_utc": utc_now(),
        "machine": machine_info("cuda"),
        "settings": {
            "world_size": world,
            "dtype": "bfloat16",
            "calls_per_graph": CALLS_PER_GRAPH,
            "replays": REPLAYS,
            "env": {name: os.environ.get(name, value) for name, value in NO_MULTICAST_ENV.items()},
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    record = run(args.world_size)
    for row in record["results"]:
        print(
            f"{row['bytes']:>9} B  {row['method']:>8}  {row['us']:7.2f} us  err {row['max_abs_err']:.3g}"
        )
    print("fastest by size:", record["suggested_bands"])
    save(record, args.output_json)


if __name__ == "__main__":
    main()
