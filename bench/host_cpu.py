"""Where a host's CPU time went during a run (Linux ``/proc``): the whole host, given worker
processes, and this process. On a shared machine this says whether a CPU benchmark had the
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
    pids_s: float  # the given processes
    self_s: float  # this process


def read_cpu_times(pids: list[int]) -> CpuTimes | None:
    """The counters now; None where ``/proc`` is missing (not Linux)."""
    if not (PROC / "stat").is_file():
        return None
    return CpuTimes(time.perf_counter(), _host_busy_s(), sum(map(_process_s, pids)),
                    sum(os.times()[:2]))  # fmt: skip


def busy_cores(before: CpuTimes | None, after: CpuTimes | None) -> dict[str, float] | None:
    """Average cores busy between two readings: the host, the given processes, this process,
    and the rest (Redis, other processes on the host)."""
    if before is None or after is None:
        return None
    wall_s = after.wall_s - before.wall_s
    host, pids = after.host_busy_s - before.host_busy_s, after.pids_s - before.pids_s
    own = after.self_s - before.self_s
    return {
        "host": host / wall_s,
        "workers": pids / wall_s,
        "client": own / wall_s,
        "other": max(host - pids - own, 0.0) / wall_s,
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
