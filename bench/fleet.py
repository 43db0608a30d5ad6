"""``pagestream bench serve --workers N[,N,...]``: N worker processes on one request stream.

For each count N, N workers are spawned against the same Redis and prefix (one consumer group
on one stream, a consumer name each), the load is scaled by N, and the workers are stopped
again. The load for N is N blocks of the workload (``--num-prompts`` prompts each, seeds
``--seed`` .. ``--seed + N - 1``; the first block is the offline engine's prompts) streamed by
N x ``--concurrency`` clients, so that each worker is as loaded as the one worker alone. The
record has each N's output tokens/s, requests/s, TTFT and TPOT percentiles, the requests each
worker finished, and the scaling efficiency: throughput per worker over that of the smallest
count (with N = 1 first, tput(N) / (N x tput(1))). Target: ``TARGET_EFFICIENCY`` while N is
at most the cores available.

CPU: each worker gets cores / N intra-op threads (``OMP_NUM_THREADS``), so that N workers do
not oversubscribe the cores; the clients and Redis run on the same cores. CUDA:
``--worker-devices`` places the workers: ``spread`` puts worker i on GPU i mod G (data
parallel: one worker per GPU, ``CUDA_VISIBLE_DEVICES``), ``shared`` puts them all on the first
GPU, ``auto`` spreads them when the host has at least N GPUs. With ``--tensor-parallel-size
T`` each worker is a TP group on T GPUs of its own (N x T of them, else refused): two TP2
workers on four GPUs. ``--pa-memory-fraction F``
(default 0.9) sizes a pool from F times the GPU's memory less what the GPU already holds, other
processes included, so the k-th of m workers on one GPU (from 1) starts once the one before has
beaten, with the fraction k x F / m: each gets about F / m. ``--pa-memory-mb`` and
``--pa-context-len`` are per worker and passed on as given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from typing import Any
from urllib.parse import urlsplit

from worker.errors import EXIT_USAGE, CommandError
from worker.local_stack import WorkerProcess, engine_flags, running_workers

TARGET_EFFICIENCY = 0.9  # of N x one worker's throughput, for N up to the cores available
WORKER_FLAGS = ["--batch-jobs", "0", "--log-level", "WARNING"]


def check_fleet_args(args: argparse.Namespace) -> None:
    """Refuse what a fleet run cannot do, before any model is loaded."""
    if not args.spawn_worker:
        raise CommandError("--workers spawns the workers: add --spawn-worker", EXIT_USAGE)
    if args.through != "redis":
        raise CommandError("--workers runs the load through Redis only", EXIT_USAGE)
    if args.tensor_parallel_size > 1:
        from engine.config_flags import engine_config_from_args

        device_type = engine_config_from_args(args).resolved_device().split(":")[0]
        if device_type != "cuda":  # the CPU's cores are already split between the workers
            raise CommandError(
                "--workers with --tensor-parallel-size runs each worker's group on GPUs of "
                "its own: CUDA only",
                EXIT_USAGE,
            )
        worker_gpus(args, max(args.workers), device_type)  # refuses too few GPUs, or shared


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_fleet(
    args: argparse.Namespace,
    redis_url: str,
    workload: Any,
    vocab_size: int,
    offline: dict[str, Any] | None,
) -> dict[str, Any]:
    """Each count of ``--workers`` in turn, on the Redis at ``redis_url``: the record."""
    from bench.workloads import make_random_prompts
    from engine.config_flags import engine_config_from_args

    counts = sorted(set(args.workers))
    blocks = [make_random_prompts(dataclasses.replace(workload, seed=workload.seed + index),
                                  vocab_size) for index in range(counts[-1])]  # fmt: skip
    device_type = engine_config_from_args(args).resolved_device().split(":")[0]
    num_cores = available_cores()
    rows = [_run_point(args, redis_url, blocks[:n], device_type, num_cores) for n in counts]
    _add_efficiency(rows, num_cores)
    return _record(args, workload, rows, offline, device_type, num_cores)


def _run_point(
    args: argparse.Namespace,
    redis_url: str,
    blocks: list[list[Any]],
    device_type: str,
    num_cores: int,
) -> dict[str, Any]:
    """The load of ``len(blocks)`` workers' worth through that many spawned workers."""
    from bench.streams import run_load
    from bench.workloads import warmup_prompts

    num_workers = len(blocks)
    workers = fleet_workers(args, redis_url, num_workers, device_type, num_cores)
    prompts = [prompt for block in blocks for prompt in block]
    warmup = [prompt for block in blocks for prompt in warmup_prompts(block)]
    concurrency = args.concurrency * num_workers
    gpus = worker_gpus(args, num_workers, device_type)
    sharing = gpus is not None and len(set(gpus)) < len(gpus)
    with running_workers(workers, one_at_a_time=sharing):
        groups = {"workers": [w.process.pid for w in workers if w.process is not None],
                  "redis": _local_redis_pids(redis_url)}  # fmt: skip
        results = asyncio.run(run_load(redis_url, args.prefix, prompts, warmup=warmup,
                                       concurrency=concurrency, warmup_runs=args.warmup_runs,
                                       timeout_s=args.timeout_s, cpu_groups=groups,
                                       progress=not args.no_progress))  # fmt: skip
    return {
        "num_workers": num_workers,
        "concurrency": concurrency,
        "threads_per_worker": _threads_per_worker(num_workers, device_type, num_cores),
        "memory_fractions": _memory_fractions(args, num_workers, device_type),
        "worker_gpus": gpus,
        **results,
        # the host's 1-minute load average (these processes included) right after the run;
        # with busy_cores' "other" (every process outside this benchmark), whether other
        # processes competed for the cores
        "load_avg_1m": os.getloadavg()[0],
    }


def _local_redis_pids(redis_url: str) -> list[int]:
    """The redis-server's process id when it runs on this host (``INFO server``), else none."""
    import redis

    if urlsplit(redis_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return []
    client = redis.Redis.from_url(redis_url)
    try:
        info: dict[str, Any] = client.info("server")  # type: ignore[assignment]
        return [int(info["process_id"])]
    finally:
        client.close()


def fleet_workers(
    args: argparse.Namespace, redis_url: str, num_workers: int, device_type: str, num_cores: int
) -> list[WorkerProcess]:
    """``num_workers`` workers with this command's engine flags: each with its share of the
    cores (CPU) or of the GPU's memory (CUDA), and a consumer name of its own."""
    threads = _threads_per_worker(num_workers, device_type, num_cores)
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    fractions = _memory_fractions(args, num_workers, device_type)
    gpus = worker_gpus(args, num_workers, device_type)
    workers = []
    for index in range(num_workers):
        flag_args = args
        if fractions is not None:
            flag_args = argparse.Namespace(**{**vars(args), "pa_memory_fraction": fractions[index]})
        name = f"fleet-{os.getpid()}-n{num_workers}-{index}"
        flags = [*WORKER_FLAGS, *engine_flags(flag_args)]
        worker_env = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[index]}
        workers.append(WorkerProcess(redis_url, args.prefix, flags, name=name, env=worker_env))
    return workers


def visible_gpus() -> list[str]:
    """This host's GPUs as ``CUDA_VISIBLE_DEVICES`` names them for a child (its own list, if
    set, else ``0..count-1``)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def worker_gpus(args: argparse.Namespace, num_workers: int, device_type: str) -> list[str] | None:
    """The GPUs each worker runs on (``CUDA_VISIBLE_DEVICES``), or None: on the CPU, or
    ``shared`` (all on the device the engine flags name). Worker i gets ``T`` GPUs from
    ``i*T`` on, modulo the visible ones (``--tensor-parallel-size T``; 1: one GPU each). A
    TP group never shares its GPUs with another (two groups' ranks on one GPU would each plan
    their pools from all of its memory): T x N GPUs, or a ``CommandError``."""
    if device_type != "cuda":
        return None
    tp = args.tensor_parallel_size
    gpus = visible_gpus()
    if tp > 1 and (args.worker_devices == "shared" or len(gpus) < num_workers * tp):
        raise CommandError(
            f"--workers {num_workers} with --tensor-parallel-size {tp} needs "
            f"{num_workers * tp} GPUs, {len(gpus)} visible: each worker's group on GPUs of its "
            f"own, not --worker-devices shared",
            EXIT_USAGE,
        )
    if args.worker_devices == "shared":
        return None
    if args.worker_devices == "auto" and len(gpus) < num_workers:
        return None
    if not gpus:
        raise CommandError("--worker-devices spread: no GPU is visible", EXIT_USAGE)
    return [
        ",".join(gpus[(index * tp + rank) % len(gpus)] for rank in range(tp))
        for index in range(num_workers)
    ]


def _memory_fractions(
    args: argparse.Namespace, num_workers: int, device_type: str
) -> list[float] | None:
    """The ``--pa-memory-fraction`` of each worker on a shared GPU, in start order (None when
    the pool is not sized by a fraction of the GPU)."""
    from engine.config import DEFAULT_MEMORY_FRACTION

    if device_type != "cuda" or args.pa_memory_mb is not None or args.pa_context_len is not None:
        return None
    fraction = args.pa_memory_fraction or DEFAULT_MEMORY_FRACTION
    gpus = worker_gpus(args, num_workers, device_type) or ["shared"] * num_workers
    # the k-th worker of the m on one GPU: k x F / m (the GPU's own count, not N)
    return [
        round(fraction * (gpus[: index + 1].count(gpu)) / gpus.count(gpu), 4)
        for index, gpu in enumerate(gpus)
    ]


def _threads_per_worker(num_workers: int, device_type: str, num_cores: int) -> int | None:
    """CPU workers split the cores; on a GPU the CPU threads are left at torch's default."""
    return max(1, num_cores // num_workers) if device_type == "cpu" else None


def _add_efficiency(rows: list[dict[str, Any]], num_cores: int) -> None:
    """Scaling efficiency of each count against the smallest, and whether it meets the target
    (None above the core count, where the target does not apply)."""
    base = rows[0]
    base_per_worker = base["output_tok_s"] / base["num_workers"]
    for row in rows:
        row["ideal_output_tok_s"] = base_per_worker * row["num_workers"]
        row["scaling_efficiency"] = row["output_tok_s"] / row["ideal_output_tok_s"]
        within_cores = row["num_workers"] <= num_cores
        row["target_met"] = row["scaling_efficiency"] >= TARGET_EFFICIENCY if within_cores else None


def _record(
    args: argparse.Namespace,
    workload: Any,
    rows: list[dict[str, Any]],
    offline: dict[str, Any] | None,
    device_type: str,
    num_cores: int,
) -> dict[str, Any]:
    from bench.records import machine_info, utc_now

    settings = {k: v for k, v in vars(args).items() if k != "handler"}
    return {
        "kind": "serve-fleet",
        "created_utc": utc_now(),
        "machine": {**machine_info(device_type), "cores_available": num_cores},
        "settings": {
            **settings,
            **dataclasses.asdict(workload),
            "redis": "given" if args.redis_url else "embedded",
            "load": "N x --concurrency clients over N x --num-prompts prompts for N workers",
        },
        "results": rows,
        "offline": offline,
        "targets": {
            "efficiency_at_least": TARGET_EFFICIENCY,
            "applies_up_to_workers": num_cores,  # the cores available
            "met": all(row["target_met"] is not False for row in rows),
        },
    }


def format_fleet(record: dict[str, Any]) -> str:
    """One line per worker count."""
    cores = record["machine"]["cores_available"]
    lines = [f"{cores} cores available; load per worker: {record['settings']['concurrency']} "
             f"streams, {record['settings']['num_prompts']} prompts"]  # fmt: skip
    for row in record["results"]:
        by_worker = ", ".join(str(count) for count in row["requests_by_worker"].values())
        lines.append(
            f"{row['num_workers']} workers: {row['output_tok_s']:.1f} output tok/s, "
            f"{row['requests_per_s']:.2f} req/s, efficiency {row['scaling_efficiency']:.2f}; "
            f"TTFT p50 {row['ttft_s']['p50'] * 1e3:.1f} ms, "
            f"TPOT p50 {row['tpot_s']['p50'] * 1e3:.2f} ms; requests per worker: {by_worker}"
            + (" (more workers than cores)" if row["num_workers"] > cores else "")
        )
        busy = row.get("busy_cores")
        if busy:
            lines.append("  cores busy: " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()))
    return "\n".join(lines)
