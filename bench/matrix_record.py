"""``bench matrix``'s record: one file per card, one row per (model, workload), each side of a
row filled in as it is measured, so a run cut short (or split over calls) loses nothing.

A row compares one figure, named by ``metric``: ``output_tok_s`` rows carry
``pagestream_tok_s`` and ``<peer>_tok_s`` and ``better: "higher"``; ``tpot_s`` rows carry
``pagestream_tpot_s`` and ``<peer>_tpot_s`` and ``better: "lower"``. ``ratio`` is always
pagestream's figure over the peer's; ``speedup`` reads the same way for both kinds (above 1:
pagestream is ahead), and ``meets_target`` says whether the row reaches the issue's target
(throughput ratio >= 1.10, TPOT ratio <= 0.91). Each side keeps its whole result (with the
time it was measured) under its own name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.kernel_sample import category_gap, format_gap, kernel_ceiling
from bench.matrix_workloads import (
    MATRIX_ORDER,
    TOK_S_TARGET,
    TPOT_TARGET,
    MatrixWorkload,
    row_target,
)
from bench.peer_process import write_json_atomically
from bench.records import machine_info, utc_now
from engine.config import EngineConfig
from engine.errors import ConfigError

ENGINE = "pagestream"
FIGURE_SUFFIX = {"output_tok_s": "tok_s", "tpot_s": "tpot_s"}


def _engine_settings(config: EngineConfig) -> dict[str, Any]:
    """The settings every model of the matrix shares (the model itself differs per row)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}


def _device(config: EngineConfig) -> str | None:
    return None if config.device == "auto" else config.device


def new_record(
    config: EngineConfig, peer: str | None, scale: float, profile_every: int = 0
) -> dict[str, Any]:
    return {
        "kind": "matrix",
        "created_utc": utc_now(),
        "updated_utc": utc_now(),
        "machine": machine_info(_device(config)),
        "peer": peer,
        "scale": scale,
        "profile_every": profile_every,
        "targets": {"output_tok_s": TOK_S_TARGET, "tpot_s": TPOT_TARGET},
        "settings": {"model": "", "models": [], **_engine_settings(config)},
        "workloads": {},
        "engines": {},
        "peers": {},
        "results": [],
    }


def load_for_resume(
    path: Path, config: EngineConfig, peer: str | None, scale: float, profile_every: int = 0
) -> dict[str, Any]:
    """The record at ``path``, checked to be the same matrix (peer, scale, profiling, card,
    settings)."""
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: cannot read the matrix record {path}: {exc}") from exc
    if record.get("kind") != "matrix":
        raise ConfigError(f"--resume: {path} is a {record.get('kind')!r} record, not a matrix")
    here = machine_info(_device(config))
    mismatches = [
        f"{name} {record_value!r} (now {value!r})"
        for name, record_value, value in (
            ("peer", record["peer"], peer),
            ("scale", record["scale"], scale),
            ("profile_every", record.get("profile_every", 0), profile_every),
            ("card", record["machine"]["device_name"], here["device_name"]),
            ("host", record["machine"]["hostname"], here["hostname"]),
        )
        if record_value != value
    ]
    recorded = {k: v for k, v in record["settings"].items() if k not in ("model", "models")}
    ours = json.loads(json.dumps(_engine_settings(config)))  # tuples as the JSON has them
    mismatches += [
        f"--{k.replace('_', '-')} {recorded.get(k)!r} (now {v!r})"
        for k, v in ours.items()
        if recorded.get(k) != v
    ]
    if mismatches:
        raise ConfigError(
            f"--resume: {path} was measured with {'; '.join(mismatches)}. A matrix record holds "
            "one card's machine session at one setting: resume it with the same flags on the "
            "same machine, or write a new --output-json"
        )
    return record


def pending(
    record: dict[str, Any], label: str, side: str, workloads: list[MatrixWorkload]
) -> list[MatrixWorkload]:
    """The workloads whose row for ``label`` lacks the ``side`` (pagestream or the peer)."""
    rows = {row["workload"]: row for row in record["results"] if row["model"] == label}
    return [w for w in workloads if side not in rows.get(w.name, {})]


def add_result(
    record: dict[str, Any],
    label: str,
    run_as: str,
    workload: MatrixWorkload,
    side: str,
    result: dict[str, Any],
) -> dict[str, Any]:
    """Put one side's result in its row (made if new) and work out the row's figures."""
    row = _find_or_add_row(record, label, run_as, workload)
    row[side] = {**result, "measured_utc": utc_now()}
    _update_figures(row, record["peer"])
    record["updated_utc"] = utc_now()
    return row


def _find_or_add_row(
    record: dict[str, Any], label: str, run_as: str, workload: MatrixWorkload
) -> dict[str, Any]:
    for row in record["results"]:
        if row["model"] == label and row["workload"] == workload.name:
            return row
    if label not in record["settings"]["models"]:
        record["settings"]["models"].append(label)
        record["settings"]["model"] = ", ".join(record["settings"]["models"])
    record["workloads"][workload.name] = _definition(workload)
    row = {
        "model": label,
        "workload": workload.name,
        "description": workload.description,
        "run_as": run_as,  # the shape both engines loaded (a long context needs a longer model)
        "metric": workload.metric,
        "better": "lower" if workload.metric == "tpot_s" else "higher",
        "target": row_target(workload),
    }
    record["results"].append(row)
    models = record["settings"]["models"]
    record["results"].sort(
        key=lambda r: (models.index(r["model"]), MATRIX_ORDER.index(r["workload"]))
    )
    return row


def _definition(workload: MatrixWorkload) -> dict[str, Any]:
    shape = workload.latency if workload.latency is not None else workload.throughput
    return {"description": workload.description, **dataclasses.asdict(shape)}  # type: ignore[arg-type]


def _update_figures(row: dict[str, Any], peer: str | None) -> None:
    metric, suffix = row["metric"], FIGURE_SUFFIX[row["metric"]]
    sides = [ENGINE] + ([peer] if peer else [])
    for side in sides:
        if side in row:
            row[f"{side}_{suffix}"] = row[side][metric]
    if peer is None or ENGINE not in row or peer not in row:
        return
    if "kernel_profile" in row[ENGINE] and "kernel_profile" in row[peer]:
        gap = category_gap(row[ENGINE]["kernel_profile"], row[peer]["kernel_profile"])
        row["kernel_gap_s"] = gap  # per kind of kernel: our seconds minus the peer's
        row["kernel_ceiling"] = kernel_ceiling(row[peer]["kernel_profile"])
    ratio = row[ENGINE][metric] / row[peer][metric]
    lower_is_better = row["better"] == "lower"
    row["ratio"] = ratio
    row["speedup"] = 1 / ratio if lower_is_better else ratio
    row["meets_target"] = ratio <= row["target"] if lower_is_better else ratio >= row["target"]


def save_record(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, record)


def default_path(root: Path, config: EngineConfig, scale: float, profile_every: int = 0) -> Path:
    """``<root>/matrix-<card>.json`` (``-scale<F>`` before ``.json`` for a scaled run,
    ``-profile`` for a profiled one, whose figures are not the measured ones)."""
    card = card_slug(machine_info(_device(config))["device_name"])
    scaled = "" if scale == 1 else f"-scale{scale:g}"
    profiled = "-profile" if profile_every else ""
    return root / f"matrix-{card}{scaled}{profiled}.json"


def card_slug(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``, ``cpu`` -> ``cpu``."""
    words = device_name.lower().replace("nvidia", " ").split()
    named = [word for word in words if any(c.isdigit() for c in word)]
    return (named or words or ["unnamed"])[0]


def format_matrix(record: dict[str, Any]) -> str:
    """The rows as a table: both figures, the ratio, and whether it meets the target."""
    peer = record["peer"] or "peer"
    lines = [f"{'model':<14} {'workload':<15} {'pagestream':>12} {peer:>12}  ratio  target"]
    for row in record["results"]:
        suffix = FIGURE_SUFFIX[row["metric"]]
        ours, theirs = row.get(f"{ENGINE}_{suffix}"), row.get(f"{peer}_{suffix}")
        ratio = row.get("ratio")
        lines.append(
            f"{row['model']:<14} {row['workload']:<15} {_figure(ours, suffix):>12} "
            f"{_figure(theirs, suffix):>12}  "
            + (
                ""
                if ratio is None
                else f"{ratio:5.2f}  {'met' if row['meets_target'] else 'missed'}"
            )
        )
    for row in record["results"]:
        builds = (row.get(ENGINE) or {}).get("jit_compiles") or {}
        if builds.get("count"):  # the row's time includes them (bench/jit_compiles.py)
            slowest = ", ".join(k["name"].rsplit(".", 1)[-1] for k in builds["kernels"][:3])
            lines.append(f"{row['model']} {row['workload']}: {builds['count']} Triton builds "
                         f"in the timed run, {builds['seconds']:.2f} s ({slowest})")  # fmt: skip
    for row in record["results"]:
        ours, theirs = row.get(ENGINE, {}), row.get(peer, {})
        if "kernel_profile" in ours and "kernel_profile" in theirs:
            label = f"{row['model']} {row['workload']}"
            lines.append(format_gap(label, ours["kernel_profile"], theirs["kernel_profile"], peer))
    return "\n".join(lines)


def _figure(value: float | None, suffix: str) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if suffix == "tpot_s" else f"{value:,.0f}/s"
