"""The fused all-reduce + residual add + RMSNorm across two GPUs (skipped with fewer): against
NCCL's all-reduce followed by the Triton norm, eagerly and replayed from a CUDA graph many
times with eager calls in between (the barrier's slots and the epoch's two buffer slots
reused across replays). The same kernel with faked peers on one process:
tests/test_allreduce_norm.py; the engine's TP2 tokens with it: tests/test_gpu_tensor_parallel.py.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

WORLD_SIZE = 2
EPS = 1e-5
# (rows, hidden, dtype): one decode row of llama3-8b, a few, more rows than the kernel's
# programs (they loop), llama3-70b's width, and a width that is no power of two
EAGER_CASES = [
    (1, 4096, torch.bfloat16),
    (3, 4096, torch.bfloat16),
    (40, 4096, torch.bfloat16),
    (2, 8192, torch.float16),
    (5, 1000, torch.float32),
]
CALLS_PER_GRAPH = 3  # odd: consecutive replays start on different buffer slots
REPLAYS = 64
RESULT_TIMEOUT_S = 180.0  # a barrier that never opens fails the test instead of hanging it


def _inputs(
    rows: int, hidden: int, dtype: torch.dtype, seed: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # this rank's x, residual, weight
    """x differs by rank; the residual and weight are every rank's same."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shared = [torch.randn(rows, hidden, generator=gen, device="cuda") for _ in range(2)]
    x = torch.randn(rows, hidden, device="cuda", generator=gen.manual_seed(seed * 10 + rank + 1))
    weight = shared[1][0] * 0.1 + 1
    return x.to(dtype), (shared[0] * 2).to(dtype), weight.to(dtype)


def _unfused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.elementwise.norm_triton import fused_add_rms_norm

    total = x.clone()
    dist.all_reduce(total)
    return fused_add_rms_norm(total, residual, weight, EPS)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _eager_rows(norm: Any, rank: int) -> list[dict[str, Any]]:
    rows = []
    for index, (num_rows, hidden, dtype) in enumerate(EAGER_CASES):
        x, residual, weight = _inputs(num_rows, hidden, dtype, seed=index, rank=rank)
        normed, total = norm(x, residual.clone(), weight, EPS)
        expected_normed, expected_total = _unfused(x, residual.clone(), weight)
        rows.append(
            {
                "case": (num_rows, hidden, str(dtype)),
                "residual_equal": torch.equal(total, expected_total),
                "normed_err": float((normed.float() - expected_normed.float()).abs().max()),
                "same_on_ranks": _same_on_every_rank(normed) and _same_on_every_rank(total),
            }
        )
    x, _, weight = _inputs(2, 4096, torch.bfloat16, seed=99, rank=rank)
    normed, total = norm(x, None, weight, EPS)  # no residual: the sum is the new one
    expected_total = x.clone()
    dist.all_reduce(expected_total)
    rows.append({"case": "no residual", "residual_equal": torch.equal(total, expected_total)})
    return rows


def _chain(
    h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, norm: Any | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CALLS_PER_GRAPH sums, each normed row the next call's share (``norm`` None: unfused)."""
    for _ in range(CALLS_PER_GRAPH):
        h, r = _unfused(h, r, weight) if norm is None else norm(h, r, weight, EPS)
    return h, r


def _graph_errors(norm: Any, rank: int) -> dict[str, Any]:
    """A graph of chained fused calls replayed REPLAYS times with new inputs (an eager call
    after every third replay shifts the slots), against the unfused chain."""
    x, residual, weight = _inputs(1, 4096, torch.bfloat16, seed=7, rank=rank)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        _chain(x.clone(), residual.clone(), weight, norm)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _chain(x, residual, weight, norm)  # residual: summed into in place
    errors = {"out_err": 0.0, "residual_err": 0.0}
    same_on_ranks = True
    for replay in range(REPLAYS):
        fresh_x, fresh_residual, _ = _inputs(1, 4096, torch.bfloat16, seed=100 + replay, rank=rank)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        graph.replay()
        expected_out, expected_residual = _chain(fresh_x, fresh_residual.clone(), weight, None)
        for name, got, expected in (
            ("out_err", out, expected_out),
            ("residual_err", residual, expected_residual),
        ):
            errors[name] = max(errors[name], float((got.float() - expected.float()).abs().max()))
        same_on_ranks = same_on_ranks and _same_on_every_rank(out)
        if replay % 3 == 0:
            norm(fresh_x, fresh_residual, weight, EPS)
    return {**errors, "same_on_ranks": same_on_ranks}


def _rank(rank: int, port: int, queue: Any) -> None:
    from engine.distributed.group import NO_MULTICAST_ENV
    from engine.distributed.peer_norm import PeerAllReduceNorm

    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        norm = PeerAllReduceNorm(dist.group.WORLD, torch.device("cuda", rank), rank)
        queue.put((rank, {"eager": _eager_rows(norm, rank), "graph": _graph_errors(norm, rank)}))
    except Exception as exc:  # the parent reports it rather than waiting for a result
        queue.put((rank, {"error": repr(exc)}))
        raise
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    """Every rank's checks, run once for the module's tests."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    try:
        found = dict(queue.get(timeout=RESULT_TIMEOUT_S) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert all("error" not in r for r in found.values()), found
    return found


def test_fused_sums_equal_nccl_and_the_norm(results: dict[int, dict[str, Any]]) -> None:
    """The new residual bit for bit (same roundings), the normed rows to a rounding of the
    statistics, and every rank the same bits."""
    for rows in (r["eager"] for r in results.values()):
        assert all(row["residual_equal"] for row in rows), rows
        assert all(row["normed_err"] <= 2e-2 for row in rows[:-1]), rows
        assert all(row["same_on_ranks"] for row in rows[:-1]), rows


def test_a_graph_of_fused_calls_replays_many_times(results: dict[int, dict[str, Any]]) -> None:
    for graph in (r["graph"] for r in results.values()):
        assert graph["same_on_ranks"], graph
        # three chained bf16 norms: a rounding of the first carries into the next sums
        assert graph["out_err"] <= 0.1 and graph["residual_err"] <= 0.1, graph
