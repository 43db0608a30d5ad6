"""bench/decode_profile.py's arithmetic: the GPU's busy time is the union of kernel intervals."""

from __future__ import annotations

from types import SimpleNamespace

from bench.decode_profile import busy_us, summarize


def test_busy_time_counts_overlapping_kernels_once() -> None:
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_us([]) == 0


def test_summary_is_per_token_and_ranks_kernels_by_time() -> None:
    def event(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [event("gemv", 0, 30), event("norm", 30, 32), event("gemv", 40, 70)]
    summary = summarize(events, num_tokens=2)
    assert summary["gpu_busy_us_per_token"] == 31
    assert summary["kernels_per_token"] == 1.5
    assert [k["name"] for k in summary["top_kernels"]] == ["gemv", "norm"]
    assert summary["top_kernels"][0] == {"name": "gemv", "us_per_token": 30, "calls": 2}
