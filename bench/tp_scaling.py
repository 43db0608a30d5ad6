"""One tensor-parallel scaling record from ``bench latency`` records of one machine session:
``python -m bench.tp_scaling OUT.json latency-tp1.json latency-tp2.json ...``.

Each latency record holds one model at one ``--tensor-parallel-size``; the scaling record has
a row per (model, size, batch) with its TPOT and TTFT, and for each model measured at size 1
the ratio of every other size's TPOT to size 1's at the same batch. The records must come from
one card (the same ``device_name``), so that the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.records import save, utc_now
from engine.errors import ConfigError


def scaling_record(latency_records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``tp-scaling`` record of ``latency_records`` (each of kind ``latency``)."""
    if not latency_records:
        raise ConfigError("give at least one latency record")
    cards = {record["machine"]["device_name"] for record in latency_records}
    if len(cards) != 1:
        raise ConfigError(f"the records come from several cards ({sorted(cards)}): one card only")
    rows = [row for record in latency_records for row in _rows(record)]
    by_key = {(row["model"], row["tensor_parallel_size"], row["batch"]): row for row in rows}
    for row in rows:
        single = by_key.get((row["model"], 1, row["batch"]))
        if single is not None and row["tensor_parallel_size"] > 1:
            row["tpot_over_tp1"] = row["tpot_s"] / single["tpot_s"]
    first = latency_records[0]
    return {
        "kind": "tp-scaling",
        "created_utc": utc_now(),
        "machine": first["machine"],
        "settings": {
            "model": ", ".join(sorted({row["model"] for row in rows})),
            "sources": [record["created_utc"] for record in latency_records],
            "input_len": first["settings"]["input_len"],
            "output_len": first["settings"]["output_len"],
        },
        "results": sorted(rows, key=lambda r: (r["model"], r["tensor_parallel_size"], r["batch"])),
    }


def _rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    if record.get("kind") != "latency":
        raise ConfigError(f"not a latency record (kind {record.get('kind')!r})")
    settings = record["settings"]
    return [
        {
            "model": settings["model"],
            "tensor_parallel_size": settings["tensor_parallel_size"],
            "batch": result["batch"],
            "tpot_s": result["mean_tpot_s"],
            "ttft_s": result["mean_ttft_s"],
            "output_tok_s": result["output_tok_s"],
            "fraction_of_limit": result.get("fraction_of_limit"),
        }
        for result in record["results"]
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.tp_scaling", description=__doc__
    )
    parser.add_argument("output_json", help="the scaling record to write (and its .png)")
    parser.add_argument("latency", nargs="+", type=Path, help="bench latency records")
    args = parser.parse_args(argv)
    try:
        records = [json.loads(path.read_text()) for path in args.latency]
        save(scaling_record(records), args.output_json)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
