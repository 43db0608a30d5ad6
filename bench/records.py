"""Benchmark records: where a run happened (machine, versions), percentiles, and the JSON file
and PNG plot each record is written to."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.llm_engine import EngineStats
from worker.errors import CommandError

RESULTS_DIR = Path("bench/results")

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean of ``values`` (all None when there are none)."""
    names = [f"p{p}" for p in PERCENTILES] + ["mean"]
    if not values:
        return dict.fromkeys(names)
    points = [*np.percentile(np.asarray(values), PERCENTILES), np.mean(values)]
    return {name: float(point) for name, point in zip(names, points, strict=True)}


def speculative_counts(before: EngineStats, after: EngineStats) -> dict[str, Any]:
    """Draft tokens verified and accepted between two readings of the engine's stats."""
    num_draft = after.num_draft_tokens - before.num_draft_tokens
    num_accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "num_draft_tokens": num_draft,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": num_accepted / num_draft if num_draft else None,
    }


def utc_now() -> str:
    """A record's timestamp: UTC, to the second (``created_utc``)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


ENV_PREFIX = "PAGESTREAM_"


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where a benchmark ran: host, Python, CPU, accelerator and library versions."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": _nvidia_driver() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": _version_of("transformers"),
        "triton": _version_of("triton"),
        # the engine's switches read from the environment (PAGESTREAM_PREFILL_ATTN, tables, ...):
        # a record says which paths it measured
        "pagestream_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX)},
    }


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, when it is on the PATH."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_record_path(record: dict[str, Any], root: Path = RESULTS_DIR) -> Path:
    """``<root>/throughput-<model slug>-<device slug>-<UTC timestamp>.json``."""
    model = record["settings"]["model"]
    model_name = Path(model).name if os.sep in model else model
    stamp = datetime.fromisoformat(record["created_utc"]).strftime("%Y%m%dT%H%M%SZ")
    device = record["machine"]["device_name"]
    return root / f"{record['kind']}-{_slug(model_name)}-{_slug(device)}-{stamp}.json"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unnamed"


def write_record(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def check_writable(path: Path) -> None:
    """Refuse a record path that cannot be written (a folder, a path under a file, a
    read-only place) with one line: said before a benchmark runs, not after it.

    Its folders are made and the file opened for appending, as writing it will; a file this
    check created is removed again."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except FileExistsError as exc:  # mkdir's word for a file where a folder should be
        blocker = next(folder for folder in path.parents if folder.exists())
        raise CommandError(
            f"cannot write the record to {path}: {blocker} is a file, not a folder"
        ) from exc
    except OSError as exc:
        raise CommandError(_cannot_write(path, exc)) from exc
    if not existed:
        path.unlink()


def check_output_json(output_json: str | None) -> None:
    """``check_writable`` for a benchmark's ``--output-json`` (unset: the default path under
    ``bench/results``, whose name needs the record)."""
    if output_json is not None:
        check_writable(Path(output_json))


def _cannot_write(path: Path, exc: OSError) -> str:
    return f"cannot write the record to {path}: {exc.strerror or exc}"


def save(record: dict[str, Any], output_json: str | None) -> None:
    """Write the JSON record (and its plot when matplotlib is there); say where."""
    from bench.plots import plot_record

    path = Path(output_json) if output_json else default_record_path(record)
    try:
        write_record(record, path)
    except OSError as exc:  # e.g. the disk filled up during the run
        raise CommandError(_cannot_write(path, exc)) from exc
    print(f"wrote {path}", file=sys.stderr)
    png = plot_record(record, path.with_suffix(".png"))
    if png is not None:
        print(f"wrote {png}", file=sys.stderr)
