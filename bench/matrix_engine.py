"""pagestream's side of ``bench matrix``: every workload on one loaded engine.

The parent runs it in its own process after the peer; ``--compare self`` also runs it as
the peer, in a subprocess, through the same protocol as vLLM's child (``bench/peer_process``):

    python -m bench.matrix_engine --config-json '{"model": "dummy:tiny", ...}' \\
        --workloads standard-64,tpot-b1 --scale 0.05 --out peer.json

That self-comparison is the noise floor of a ratio (both sides the same engine: 1.0 give or
take the run-to-run spread), and how the CPU tests drive the comparison without vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.latency import run_latency
from bench.matrix_workloads import MatrixWorkload, select_workloads
from bench.peer_process import write_json_atomically
from bench.throughput import resolved_settings, run_throughput
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def engine_results(
    engine: LLMEngine, workloads: list[MatrixWorkload], *, use_tqdm: bool, profile_every: int = 0
) -> Iterator[tuple[MatrixWorkload, dict[str, Any]]]:
    """Each workload's result on ``engine``, as it finishes: a throughput run's results (with
    ``kernel_profile`` when ``profile_every``), or a latency batch's (with ``tpot_s``, its
    mean time per output token)."""
    copy_bytes_per_s: float | None = None
    for workload in workloads:
        if workload.latency is None:
            assert workload.throughput is not None
            yield (
                workload,
                run_throughput(
                    engine, workload.throughput, use_tqdm=use_tqdm, profile_every=profile_every
                )["results"],
            )
            continue
        if copy_bytes_per_s is None and engine.device.type == "cuda":
            from bench.kernels import measure_copy_bandwidth  # the limit TPOT is measured against

            copy_bytes_per_s = measure_copy_bandwidth(engine.device)
        record = run_latency(
            engine, workload.latency, copy_bytes_per_s=copy_bytes_per_s, use_tqdm=use_tqdm
        )
        result = record["results"][0]
        yield workload, {**result, "tpot_s": result["mean_tpot_s"]}


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """What the engine was, for the record: its settings and what ``auto`` became."""
    from dataclasses import asdict

    return {"settings": asdict(engine.config), "resolved": resolved_settings(engine)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.matrix_engine", allow_abbrev=False, description=__doc__
    )
    parser.add_argument("--config-json", required=True, help="the EngineConfig's fields")
    parser.add_argument("--workloads", required=True, help="matrix workload names")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--profile-every", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    config = EngineConfig(**json.loads(args.config_json))
    workloads = select_workloads(
        tuple(args.workloads.split(",")), seed=config.seed, scale=args.scale
    )
    engine = LLMEngine(config)
    out = Path(args.out)
    record: dict[str, Any] = {"peer": "self", "kind": "matrix", **engine_info(engine)}
    record["results"] = []
    write_json_atomically(out, record)
    results = engine_results(engine, workloads, use_tqdm=False, profile_every=args.profile_every)
    for workload, result in results:
        record["results"].append({"workload": workload.name, **result})
        write_json_atomically(out, record)  # the parent follows it result by result
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
