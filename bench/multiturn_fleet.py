"""``pagestream bench multiturn --workers N[,N,...] --routing shared,routed``: the multi-turn
chat workload through Redis against N worker processes, with the shared consumer group and
with prefix-aware routing (docs/routing.md).

For each count N and each mode, a fresh embedded Redis and N fresh workers (cold caches; on a
CPU, cores / N threads each) serve the same sessions: the shared system prompt, then each
session's turns (system + history + a new user turn, token ids), up to ``concurrency`` turns in
flight across the fleet, a session going to the back of the line after each reply. The row of
a run: the prefix hit rate (the prompt tokens the workers' caches served, from each ``done``
event's usage, over all prompt tokens), TTFT p50/p90 from submit to the first token, output
tokens/s over the run, the requests each worker finished, each worker's event-loop lag (from
its ``/metrics`` before and after the run: a routed turn waits for one worker's loop, a shared
one for the first free), and (routed) how many turns went to a worker's own stream and why the
others went to the shared one.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from bench import loop_lag_scrape
from bench.fleet import WORKER_FLAGS, _memory_fractions, available_cores, worker_gpus
from bench.multiturn import MultiTurnWorkload, Session, make_sessions
from bench.records import machine_info, percentiles, utc_now
from clients import AsyncClient, DoneEvent, TokenEvent
from worker.local_stack import (
    WorkerProcess,
    embedded_redis,
    engine_flags,
    free_port,
    running_workers,
)

ROUTING_MODES = ("shared", "routed")
PREFIX = "mtfleet"


def run_multiturn_fleet(
    args: argparse.Namespace, workload: MultiTurnWorkload, counts: list[int], modes: list[str]
) -> dict[str, Any]:
    """Every count in ``counts`` under every mode in ``modes``: the record."""
    vocab_size = _vocab_size(args)
    system, sessions = make_sessions(workload, vocab_size)
    rows = []
    for num_workers in sorted(set(counts)):
        for mode in modes:
            row = _run_point(args, workload, system, copy.deepcopy(sessions), num_workers, mode)
            print(format_row(row), flush=True)
            rows.append(row)
    return {
        "benchmark": "multiturn-fleet",
        "kind": "multiturn-fleet",
        "date": utc_now(),
        "machine": machine_info(),
        "settings": {
            "model": args.model,
            "workload": {
                "num_sessions": workload.num_sessions,
                "num_turns": workload.num_turns,
                "system_len": workload.system_len,
                "user_len": list(workload.user_len),
                "output_len": workload.output_len,
                "concurrency": workload.concurrency,
                "seed": workload.seed,
            },
            "engine_flags": engine_flags(args),
            "cores": available_cores(),
            "redis": "embedded, fresh per run",
            "note": "concurrency is across the whole fleet: the same offered load for every N",
        },
        "rows": rows,
        "targets": _targets(rows),
    }


def _vocab_size(args: argparse.Namespace) -> int:
    """The model's vocabulary from its config alone: an engine built here to ask (as this
    did) kept its pool's GPU memory in this process after its shutdown, and on a GPU host the
    first worker on that GPU ran out of memory (two H100s, dummy llama3-8b)."""
    from engine.loader import find_model

    return int(find_model(args.model).arch.vocab_size)


def _run_point(
    args: argparse.Namespace,
    workload: MultiTurnWorkload,
    system: list[int],
    sessions: list[Session],
    num_workers: int,
    mode: str,
) -> dict[str, Any]:
    """One run: a fresh Redis, ``num_workers`` fresh workers (on a GPU host: one per GPU when
    there are enough, else all on one, splitting its memory as ``bench serve`` does)."""
    from engine.config_flags import engine_config_from_args

    routed = mode == "routed"
    device_type = engine_config_from_args(args).resolved_device().split(":")[0]
    placing = argparse.Namespace(**{**vars(args), "worker_devices": "auto"})
    gpus = worker_gpus(placing, num_workers, device_type)
    fractions = _memory_fractions(placing, num_workers, device_type)
    threads = max(available_cores() // num_workers, 1) if device_type == "cpu" else None
    names = [f"mt-{mode}-{index}" for index in range(num_workers)]
    metrics_ports = [free_port() for _ in names]
    with embedded_redis() as redis_url:
        workers = []
        for index in range(num_workers):
            flag_args = args
            if fractions is not None:
                flag_args = argparse.Namespace(
                    **{**vars(args), "pa_memory_fraction": fractions[index]}
                )
            env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[index]
            flags = [
                *WORKER_FLAGS,
                "--routing",
                "on" if routed else "off",
                "--metrics-port",
                str(metrics_ports[index]),
                *engine_flags(flag_args),
            ]
            workers.append(WorkerProcess(redis_url, PREFIX, flags, name=names[index], env=env))
        sharing = device_type == "cuda" and (gpus is None or len(set(gpus)) < len(gpus))
        with running_workers(workers, one_at_a_time=sharing and num_workers > 1):
            before = [loop_lag_scrape.scrape(port) for port in metrics_ports]
            results = asyncio.run(
                _drive(redis_url, system, sessions, workload, routed, not args.no_progress)
            )
            after = [loop_lag_scrape.scrape(port) for port in metrics_ports]
    # each worker's event loop over the run: a late loop delays reads and first tokens
    loop_lag = {
        name: loop_lag_scrape.summary(start, end)
        for name, start, end in zip(names, before, after, strict=True)
        if start is not None and end is not None
    }
    return {
        "mode": mode, "workers": num_workers, "threads_per_worker": threads, "worker_gpus": gpus,
        "memory_fractions": fractions, **results, "loop_lag_by_worker": loop_lag,
    }  # fmt: skip


async def _drive(
    redis_url: str,
    system: list[int],
    sessions: list[Session],
    workload: MultiTurnWorkload,
    routed: bool,
    progress: bool = False,
) -> dict[str, Any]:
    waiting = deque(range(len(sessions)))
    bar = tqdm(
        total=len(sessions) * workload.num_turns, desc="turns", unit="turn", disable=not progress
    )
    ttfts_s: list[float] = []
    # each turn's TTFT split by the done event's timings: "submit", the client's route and
    # enqueue; "queue", then until a worker read it (Redis, the worker's reader); "engine",
    # admitted -> first token event made; "rest", the admission's own Redis calls and the
    # token's way back
    parts_s: dict[str, list[float]] = {"submit": [], "queue": [], "engine": [], "rest": []}
    ttft_by_turn: dict[int, list[float]] = {}
    tokens = Counter[str]()
    first_turns = Counter[str]()  # where each conversation started: its later turns follow
    # each worker's turns: TTFT, engine part, prompt and cached tokens (a slow or cold worker
    # shows here, where the fleet's percentiles mix it with the others)
    by_worker: dict[str, WorkerTally] = {}

    async def lane(client: AsyncClient) -> None:
        while waiting:
            index = waiting.popleft()
            session = sessions[index]
            reply, first_s, started_s = [], None, time.perf_counter()
            turn, done = session.num_done, None
            request_id = await client.submit(
                token_ids=session.next_prompt(system), max_tokens=workload.output_len,
                ignore_eos=True, temperature=0.0,
            )  # fmt: skip
            submit_s = time.perf_counter() - started_s  # the client's part: route and enqueue
            async for event in client.resume(request_id):
                if isinstance(event, TokenEvent):
                    first_s = first_s or time.perf_counter()
                    reply += event.token_ids
                elif isinstance(event, DoneEvent) and event.usage is not None:
                    done = event
                    tokens["prompt"] += event.usage.prompt_tokens
                    tokens["cached"] += event.usage.cached_prompt_tokens
                    tokens["output"] += len(reply)
                    if session.num_done == 0:
                        first_turns[event.worker] += 1
            ttft_s = (first_s or time.perf_counter()) - started_s
            ttfts_s.append(ttft_s)
            ttft_by_turn.setdefault(turn, []).append(ttft_s)
            if done is not None:
                _split(ttft_s, submit_s, done, parts_s)
                by_worker.setdefault(done.worker, WorkerTally()).add(ttft_s, done)
            session.add_reply(reply)
            bar.update(1)
            if session.num_done < workload.num_turns:
                waiting.append(index)

    async with AsyncClient(redis_url, prefix=PREFIX, routing=routed) as client:
        started_s = time.perf_counter()
        with bar:
            await asyncio.gather(*(lane(client) for _ in range(workload.concurrency)))
        elapsed_s = time.perf_counter() - started_s
        choices = dict(client.router.choices) if client.router is not None else {}
    ttft = percentiles(ttfts_s)
    busiest_first = sorted(by_worker.items(), key=lambda item: -len(item[1].ttfts_s))
    workers = [tally.summary(name) for name, tally in busiest_first]
    return {
        "prefix_hit_rate": tokens["cached"] / max(tokens["prompt"], 1),
        "ttft_s": {"p50": ttft["p50"], "p90": ttft["p90"]},
        "ttft_parts_p50_s": {
            part: percentiles(values)["p50"] for part, values in parts_s.items() if values
        },
        "ttft_p50_s_by_turn": {
            str(turn): percentiles(values)["p50"] for turn, values in sorted(ttft_by_turn.items())
        },
        "output_tok_s": tokens["output"] / elapsed_s,
        "num_requests": len(ttfts_s),
        "elapsed_s": elapsed_s,
        "prompt_tokens": tokens["prompt"],
        "cached_prompt_tokens": tokens["cached"],
        "requests_per_worker": [worker["requests"] for worker in workers],  # busiest first
        "first_turns_per_worker": sorted(first_turns.values(), reverse=True),
        "by_worker": workers,
        "routing_choices": choices,  # routed turns: where each went and why
        "load_avg_1m": os.getloadavg()[0],
    }


@dataclass
class WorkerTally:
    """One worker's turns in a run."""

    ttfts_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, ttft_s: float, done: DoneEvent) -> None:
        self.ttfts_s.append(ttft_s)
        if done.timings.time_to_first_token_ms is not None:
            self.engine_s.append(done.timings.time_to_first_token_ms / 1000)
        if done.usage is not None:
            self.prompt_tokens += done.usage.prompt_tokens
            self.cached_tokens += done.usage.cached_prompt_tokens

    def summary(self, name: str) -> dict[str, Any]:
        return {
            "worker": name,
            "requests": len(self.ttfts_s),
            "ttft_p50_s": percentiles(self.ttfts_s)["p50"],
            "engine_p50_s": percentiles(self.engine_s)["p50"] if self.engine_s else None,
            "prefix_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
        }


def _split(
    ttft_s: float, submit_s: float, done: DoneEvent, parts_s: dict[str, list[float]]
) -> None:
    """Add a turn's TTFT parts from the client's submit time and its ``done`` timings (whose
    queue spans the client's and the worker's wall clocks, one host here, from before the
    client's route: its submit part is taken out)."""
    queue_ms, engine_ms = done.timings.queue_ms, done.timings.time_to_first_token_ms
    if queue_ms is None or engine_ms is None:
        return
    parts_s["submit"].append(submit_s)
    parts_s["queue"].append(max(queue_ms / 1000 - submit_s, 0.0))
    parts_s["engine"].append(engine_ms / 1000)
    parts_s["rest"].append(ttft_s - (queue_ms + engine_ms) / 1000)


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 31's targets at the largest N, against one worker's hit rate (same mode)."""
    by = {(row["mode"], row["workers"]): row for row in rows}
    largest = max(row["workers"] for row in rows)
    out: dict[str, Any] = {"workers": largest}
    for mode in ROUTING_MODES:
        one, many = by.get((mode, 1)), by.get((mode, largest))
        if one and many and one["prefix_hit_rate"]:
            out[f"{mode}_hit_rate_vs_1_worker"] = many["prefix_hit_rate"] / one["prefix_hit_rate"]
    shared, routed = by.get(("shared", largest)), by.get(("routed", largest))
    if shared and routed and shared["ttft_s"]["p50"]:
        out["ttft_p50_routed_vs_shared"] = routed["ttft_s"]["p50"] / shared["ttft_s"]["p50"]
        out["output_tok_s_routed_vs_shared"] = routed["output_tok_s"] / shared["output_tok_s"]
    out["goals"] = {"routed_hit_rate_vs_1_worker": ">= 0.9", "ttft_p50_routed_vs_shared": "<= 0.67"}
    return out


def format_row(row: dict[str, Any]) -> str:
    """One line per run."""
    return (
        f"{row['mode']:>6} x{row['workers']}: prefix hit {row['prefix_hit_rate']:.3f}, "
        f"TTFT p50 {row['ttft_s']['p50'] * 1000:.0f} ms p90 {row['ttft_s']['p90'] * 1000:.0f} ms, "
        f"{row['output_tok_s']:.1f} output tok/s, per worker {row['requests_per_worker']}"
        + (
            ", TTFT p50 parts "
            + " ".join(f"{k} {v * 1000:.1f}" for k, v in row["ttft_parts_p50_s"].items())
            + " ms"
            if row.get("ttft_parts_p50_s")
            else ""
        )
        + (f", choices {row['routing_choices']}" if row.get("routing_choices") else "")
    )
