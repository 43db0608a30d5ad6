"""The worker's event-loop lag (worker/loop_lag.py): what the probe measures, the histogram
``/metrics`` serves, and the run's figures ``bench multiturn`` takes from two scrapes."""

from __future__ import annotations

import asyncio
import time

from bench import loop_lag_scrape
from engine import EngineStats
from worker.loop_lag import LAG_BUCKETS_S, LoopLag
from worker.prometheus import QueueReading, WorkerCounters, WorkerReading, render


def test_observations_land_in_their_buckets_and_the_window_resets() -> None:
    lag = LoopLag()
    for lag_s in (0.0005, 0.001, 0.003, 0.2, 2.0, -1e-9):
        lag.observe(lag_s)
    # at or under 1 ms: 0.5 ms, 1 ms and the clock's -1 ns (taken as 0); 5 ms: + 3 ms; ...
    assert lag.cumulative_counts() == [3, 3, 4, 4, 4, 4, 4, 5, 5, 5, 6]
    assert lag.count == 6 and abs(lag.sum_s - 2.2045) < 1e-9
    assert lag.take_window_max_s() == 2.0
    assert lag.take_window_max_s() == 0.0  # a new window
    lag.observe(0.01)
    assert lag.take_window_max_s() == 0.01


def test_the_probe_sees_a_loop_held_by_a_blocking_call() -> None:
    lag = LoopLag()

    async def main() -> None:
        probe = asyncio.create_task(lag.probe(interval_s=0.005))
        await asyncio.sleep(0.05)  # a free loop first
        quiet_s = lag.take_window_max_s()
        time.sleep(0.08)  # then a call that never yields, as a busy loop's would
        await asyncio.sleep(0.02)
        probe.cancel()
        assert quiet_s < 0.07
        assert lag.take_window_max_s() >= 0.07

    asyncio.run(main())
    assert lag.count >= 5


def test_metrics_serve_the_lags_as_a_prometheus_histogram() -> None:
    lag = LoopLag()
    for lag_s in (0.0002, 0.004, 0.03):
        lag.observe(lag_s)
    page = _page(lag)
    name = "pagestream_worker_event_loop_lag_seconds"
    assert f"# TYPE {name} histogram" in page
    assert f'{name}_bucket{{worker="w1",le="0.001"}} 1' in page
    assert f'{name}_bucket{{worker="w1",le="0.005"}} 2' in page
    assert f'{name}_bucket{{worker="w1",le="0.05"}} 3' in page
    assert f'{name}_bucket{{worker="w1",le="+Inf"}} 3' in page
    assert f'{name}_count{{worker="w1"}} 3' in page
    counts = loop_lag_scrape.parse(page)
    assert counts is not None and counts.cumulative == tuple(lag.cumulative_counts())
    assert abs(counts.sum_s - 0.0342) < 1e-12


def test_a_run_s_lags_are_the_difference_of_two_scrapes() -> None:
    lag = LoopLag()
    for _ in range(50):
        lag.observe(0.0001)  # before the run: an idle loop
    before = loop_lag_scrape.parse(_page(lag))
    for lag_s in [0.0002] * 90 + [0.02] * 9 + [0.3]:
        lag.observe(lag_s)
    after = loop_lag_scrape.parse(_page(lag))
    assert before is not None and after is not None
    run = loop_lag_scrape.summary(before, after)
    assert run["probes"] == 100
    assert run["p50_ms"] == 1.0  # half the run's probes woke within a millisecond
    assert run["p99_ms"] == 25.0  # 99 of 100 within 25 ms; the last one took 300
    assert abs(float(run["mean_ms"] or 0) - (0.018 + 0.18 + 0.3) * 10) < 1e-6
    assert loop_lag_scrape.summary(after, after)["probes"] == 0
    assert loop_lag_scrape.parse("# an old worker's page, no histogram\n") is None


def test_the_buckets_are_increasing() -> None:
    assert list(LAG_BUCKETS_S) == sorted(set(LAG_BUCKETS_S))


def _page(lag: LoopLag) -> str:
    return render(
        WorkerReading(
            worker="w1", model="m", stats=_stats(), num_in_flight=0, max_in_flight=1,
            queue=QueueReading(), counters=WorkerCounters(), loop_lag=lag,
        )
    )  # fmt: skip


def _stats() -> EngineStats:
    return EngineStats(
        num_running=0, num_waiting=0, num_swapped=0, num_pages_used=0, num_pages_free=8,
        prefix_hit_rate=0.0, num_preemptions=0,
    )  # fmt: skip
