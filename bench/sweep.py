"""Throughput as the work grows: the same workload at several prompt counts, for the engine and
(optionally) vLLM in the same run.

A well-behaved engine holds its output tokens/s (or gains) from a few hundred prompts to a few
thousand: once ``--max-seqs`` sequences run, more prompts only mean more arrivals mixed into
running decodes. ``hold_ratio`` is the rate at the largest count over the rate at 256 prompts
(or the smallest count above it; the smallest count when none reaches 256), the figure the
issue's target reads (>= 0.95); ``hold_base_prompts`` is the count it was taken against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.records import machine_info, utc_now
from bench.throughput import run_throughput
from bench.vllm_peer import run_vllm_peer, throughput_peer_args
from bench.workloads import ThroughputWorkload
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.memory import release_device_memory

HOLD_BASE_PROMPTS = 256


def run_sweep(
    config: EngineConfig,
    workloads: list[ThroughputWorkload],
    *,
    compare_vllm: bool = False,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """One record: the engine's throughput at each prompt count, and vLLM's beside it."""
    peer = None
    if compare_vllm:  # first, on an empty GPU; its process is gone before the engine loads
        peer = run_vllm_peer("throughput", throughput_peer_args(config, workloads))
    engine = LLMEngine(config)
    created_utc = utc_now()
    runs = [run_throughput(engine, w, use_tqdm=use_tqdm)["results"] for w in workloads]
    machine = machine_info(engine.device)
    engine.shutdown()
    del engine
    release_device_memory()
    rows = []
    for workload, ours in zip(workloads, runs, strict=True):
        row: dict[str, Any] = {"num_prompts": workload.num_prompts, "pagestream": ours}
        if peer is not None:
            theirs = next(r for r in peer["results"] if r["num_prompts"] == workload.num_prompts)
            row["vllm"] = theirs
            row["ratio"] = ours["output_tok_s"] / theirs["output_tok_s"]
        rows.append(row)
    record: dict[str, Any] = {
        "kind": "throughput-sweep",
        "created_utc": created_utc,
        "machine": machine,
        "settings": {
            **dataclasses.asdict(config),
            **{k: v for k, v in dataclasses.asdict(workloads[0]).items() if k != "num_prompts"},
            "num_prompts": [w.num_prompts for w in workloads],
        },
        "results": rows,
        "hold_base_prompts": hold_base_count([row["num_prompts"] for row in rows]),
        "hold_ratio": hold_ratios(rows),
    }
    if peer is not None:
        record["vllm"] = {k: v for k, v in peer.items() if k != "results"}
    return record


def hold_base_count(counts: list[int]) -> int:
    """The prompt count the hold ratio is taken against: the smallest of 256 or more, else
    the smallest."""
    return min((n for n in counts if n >= HOLD_BASE_PROMPTS), default=min(counts))


def hold_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per engine: output tok/s at the largest prompt count over the base count's."""
    counts = [row["num_prompts"] for row in rows]
    base = rows[counts.index(hold_base_count(counts))]
    last = rows[counts.index(max(counts))]
    out: dict[str, float] = {}
    for name in ("pagestream", "vllm"):
        if name in base and name in last:
            out[name] = last[name]["output_tok_s"] / base[name]["output_tok_s"]
    return out


def format_sweep(record: dict[str, Any]) -> str:
    lines = ["prompts  pagestream tok/s  vllm tok/s  ratio"]
    for row in record["results"]:
        theirs = row.get("vllm", {}).get("output_tok_s")
        lines.append(
            f"{row['num_prompts']:7d}  {row['pagestream']['output_tok_s']:16,.0f}  "
            + ("" if theirs is None else f"{theirs:10,.0f}  {row['ratio']:5.2f}")
        )
    holds = ", ".join(f"{name} {ratio:.2f}" for name, ratio in record["hold_ratio"].items())
    lines.append(f"largest / {record['hold_base_prompts']}-prompt rate: {holds}")
    return "\n".join(lines)
