"""A worker's event-loop lag over one benchmark run, from its ``/metrics`` before and after.

The worker's histogram (``worker/loop_lag.py``) counts from its start; the difference of two
scrapes is the run's. Quantiles are read off the buckets (the bound a quantile falls under),
so they are as fine as the buckets: 1, 2.5, 5, 10, 25, 50 ms and up.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from worker.loop_lag import LAG_BUCKETS_S

METRIC = "pagestream_worker_event_loop_lag_seconds"
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LagCounts:
    """The histogram as a scrape gives it: cumulative counts per bound, then the sum."""

    cumulative: tuple[int, ...]  # at or under each bound of LAG_BUCKETS_S, then all
    sum_s: float


def parse(text: str) -> LagCounts | None:
    """The lag histogram in a ``/metrics`` page; None when the page has none (an old worker)."""
    buckets: dict[float, int] = {}  # bound (float("+Inf") for the last) -> count
    sum_s = None
    for line in text.splitlines():
        if line.startswith(f"{METRIC}_bucket{{"):
            labels, value = line.rsplit(" ", 1)
            bound = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = int(float(value))
        elif line.startswith(f"{METRIC}_sum{{"):
            sum_s = float(line.rsplit(" ", 1)[1])
    bounds = [*LAG_BUCKETS_S, math.inf]
    if sum_s is None or any(bound not in buckets for bound in bounds):
        return None
    return LagCounts(tuple(buckets[bound] for bound in bounds), sum_s)


def scrape(port: int, host: str = "127.0.0.1") -> LagCounts | None:
    """The histogram of the worker serving ``/metrics`` on ``port``; None when unreachable."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
            return parse(r.read().decode())
    except OSError:
        return None


def summary(before: LagCounts, after: LagCounts) -> dict[str, float | int | None]:
    """The run's lags (``after`` less ``before``): how many probes, their mean, and the bucket
    bounds under which half and 99% of them fell (None above the last bound)."""
    counts = [b - a for a, b in zip(before.cumulative, after.cumulative, strict=True)]
    total = counts[-1]
    if total <= 0:
        return {"probes": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {
        "probes": total,
        "mean_ms": (after.sum_s - before.sum_s) / total * 1000,
        "p50_ms": _quantile_ms(counts, 0.5),
        "p99_ms": _quantile_ms(counts, 0.99),
    }


def _quantile_ms(cumulative: list[int], q: float) -> float | None:
    wanted = q * cumulative[-1]
    for bound, count in zip(LAG_BUCKETS_S, cumulative, strict=False):
        if count >= wanted:
            return bound * 1000
    return None  # past the last bound
