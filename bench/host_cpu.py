"""Where a host's CPU time went during a run (Linux ``/proc``): the whole host, named groups
of processes (the workers, Redis), and this process. On a shared machine this says whether a CPU benchmark had the
cores to itself, and which part of the service used them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU seconds at one moment."""

    wall_s: float
    host_busy_s: float  # all processes, all cores
    groups_s: dict[str, float]  # each named group of processes
    self_s: float  # this process


def read_cpu_times(groups: dict[str, list[int]]) -> CpuTimes | None:
    """The counters now, for the host, each group of processes and this process; None where
    ``/proc`` is missing (not Linux)."""
    if not (PROC / "stat").is_file():
        return None
    times_s = {name: sum(map(_process_s, pids)) for name, pids in groups.items()}
    return CpuTimes(time.perf_counter(), _host_busy_s(), times_s, sum(os.times()[:2]))


def busy_cores(before: CpuTimes | None, after: CpuTimes | None) -> dict[str, float] | None:
    """Average cores busy between two readings: the host, each group, this process
    (``client``), and the rest (``other``: every other process on the host)."""
    if before is None or after is None:
        return None
    wall_s = after.wall_s - before.wall_s
    host_s = after.host_busy_s - before.host_busy_s
    parts_s = {name: after.groups_s[name] - before.groups_s[name] for name in after.groups_s}
    parts_s["client"] = after.self_s - before.self_s
    other_s = max(host_s - sum(parts_s.values()), 0.0)
    return {
        name: value / wall_s
        for name, value in {"host": host_s, **parts_s, "other": other_s}.items()
    }


def _host_busy_s() -> float:
    """Busy time of all cores (``/proc/stat``: all but idle and iowait), in seconds."""
    fields = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:9]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _process_s(pid: int) -> float:
    """User + system time of one process (0 once it is gone)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
