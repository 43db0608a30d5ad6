"""``pagestream bench multiturn --workers N --routing ...`` at a tiny size on the CPU: the
record's shape, every turn answered, and routing keeping each conversation's later turns on
the worker that holds it (its hit rate at 2 workers is that of one worker). No speed is
asserted: the CPU is shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commands import main as cli_main

SESSIONS, TURNS = 4, 3


def test_multiturn_fleet_record_and_routing_keeps_the_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "fleet-routing.json"
    code = cli_main([
        "bench", "multiturn", "--model", "dummy:tiny", "--device", "cpu", "--workers", "1,2",
        "--routing", "routed", "--num-sessions", str(SESSIONS), "--num-turns", str(TURNS),
        "--system-len", "16", "--user-len", "40-60", "--output-len", "4", "--concurrency", "2",
        "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "multiturn-fleet" and record["machine"]["device"] == "cpu"
    assert out.with_suffix(".png").stat().st_size > 0  # TTFT parts, hit rate, throughput
    rows = record["rows"]
    assert [(row["mode"], row["workers"]) for row in rows] == [("routed", 1), ("routed", 2)]
    for row in rows:
        assert row["num_requests"] == SESSIONS * TURNS == sum(row["requests_per_worker"])
        assert sum(row["first_turns_per_worker"]) == SESSIONS  # where each one started
        # each worker's own turns: as many as it finished, its TTFT and hit rate
        workers = row["by_worker"]
        assert [w["requests"] for w in workers] == row["requests_per_worker"]
        assert len({w["worker"] for w in workers}) == row["workers"]
        assert all(0 < w["engine_p50_s"] <= 2 * row["ttft_s"]["p90"] for w in workers)
        assert all(w["ttft_p50_s"] > 0 and 0 <= w["prefix_hit_rate"] < 1 for w in workers)
        if row["workers"] == 1:  # the one worker's turns are the fleet's
            assert workers[0]["prefix_hit_rate"] == pytest.approx(row["prefix_hit_rate"])
            assert workers[0]["ttft_p50_s"] == pytest.approx(row["ttft_s"]["p50"])
        assert 0 < row["prefix_hit_rate"] < 1 and row["output_tok_s"] > 0
        assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p90"]
        # TTFT split by the done events' timings (each part of the same turns), and by turn
        parts = row["ttft_parts_p50_s"]
        assert set(parts) == {"submit", "queue", "engine", "rest"} and parts["engine"] > 0
        assert parts["submit"] > 0 and parts["queue"] >= 0
        assert parts["engine"] < 2 * row["ttft_s"]["p90"]
        assert list(row["ttft_p50_s_by_turn"]) == [str(turn) for turn in range(TURNS)]
        # each worker's event loop over the run, from its /metrics before and after
        lags = row["loop_lag_by_worker"]
        assert sorted(lags) == sorted(w["worker"] for w in workers)
        assert all(lag["probes"] > 0 and lag["mean_ms"] >= 0 for lag in lags.values())
        # every turn's choice counted: a session's first turn finds no holder
        assert sum(row["routing_choices"].values()) == row["num_requests"]
        assert row["routing_choices"]["no holder"] >= SESSIONS
    one, two = rows
    # routed, each later turn finds its history on the worker it goes to, as with one worker
    assert two["prefix_hit_rate"] >= 0.9 * one["prefix_hit_rate"]
    assert record["targets"]["routed_hit_rate_vs_1_worker"] >= 0.9
    assert "shared_hit_rate_vs_1_worker" not in record["targets"]  # not run


def test_an_unknown_routing_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "multiturn", "--model", "dummy:tiny", "--workers", "2", "--routing", "sticky"]
    assert cli_main(argv) == 2
    assert "expected shared, routed or both" in capsys.readouterr().err
