"""The record of ``pagestream bench redis-scale``: its JSON, its lines of text and the
target it is held to."""

from __future__ import annotations

import subprocess
from typing import Any

TARGET_RATIO = 2.5  # cluster tokens/s over single, at 3 primaries (issue 31)


def make_record(
    settings: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    num_primaries: int,
    num_cores: int,
) -> dict[str, Any]:
    """The JSON record: machine (``num_cores`` available), ``settings`` (the derived counts
    and cores too), the single and cluster ``rows`` (and the cluster with readers on home
    shards), each cluster's ratio against the target."""
    from bench.records import machine_info, utc_now

    single, cluster = rows[:2]
    ratio = _ratio(cluster, single)
    homed = _ratio(rows[2], single) if len(rows) > 2 else None
    return {
        "kind": "redis-scale",
        "created_utc": utc_now(),
        "machine": {
            **machine_info("cpu"),
            "cores_available": num_cores,
            "redis_server": redis_server_version(),
        },
        "settings": {
            **settings,
            "load": "producers: workers without an engine, one token per request in "
            "flight per step; readers: clients submitting and reading to done",
        },
        "results": rows,
        "ratio": ratio,  # readers spread over every shard, as a client by default
        "ratio_home_shards": homed,  # each reader on a home shard (None: not run)
        "targets": {
            "ratio_at_least": TARGET_RATIO,
            "at_primaries": 3,
            "met": _met(ratio, num_primaries),
            "met_home_shards": _met(homed, num_primaries),
        },
    }


def _ratio(cluster: dict[str, Any], single: dict[str, Any]) -> float | None:
    return cluster["tokens_per_s"] / single["tokens_per_s"] if single["tokens_per_s"] else None


def _met(ratio: float | None, num_primaries: int) -> bool | None:
    return None if ratio is None or num_primaries != 3 else ratio >= TARGET_RATIO


def format_row(row: dict[str, Any]) -> str:
    """One line of a setup's figures."""
    busy = ", ".join(f"{value:.2f}" for value in row["redis_cpu_busy_by_primary"])
    homed = ", readers on home shards" if row.get("readers_home_shards") else ""
    return (f"{row['redis']} ({row['primaries']} primaries{homed}): "
            f"{row['tokens_per_s']:,.0f} tokens/s "
            f"({row['tokens_read']:,} read of {row['tokens_written']:,} written, "
            f"{row['requests']:,} requests), {row['redis_commands_per_s']:,.0f} Redis commands/s, "
            f"{row['redis_cpu_us_per_token']:.1f} us Redis CPU per token; primaries busy {busy}")  # fmt: skip


def format_ratio(record: dict[str, Any]) -> str:
    """The ratio against the target."""
    targets = record["targets"]
    met = {True: "met", False: "not met", None: "n/a"}[targets["met"]]
    ratio = record["ratio"]
    text = (f"cluster / single: {ratio:.2f}x (target >= {targets['ratio_at_least']}x at "
            f"{targets['at_primaries']} primaries: {met})")  # fmt: skip
    homed = record.get("ratio_home_shards")
    if homed is not None:
        met_homed = {True: "met", False: "not met", None: "n/a"}[targets["met_home_shards"]]
        text += f"; readers on home shards: {homed:.2f}x ({met_homed})"
    return text


def redis_server_version() -> str | None:
    """``redis-server --version`` of the binary the bench starts."""
    from worker.local_stack import redis_server_binary

    try:
        done = subprocess.run([redis_server_binary(), "--version"], capture_output=True,
                              text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
