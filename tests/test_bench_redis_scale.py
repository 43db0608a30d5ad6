"""``pagestream bench redis-scale`` at a tiny size: one primary, then a real 3-primary cluster,
each carrying producers (workers without an engine) and readers (clients) for a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.redis_scale import ScaleSettings, plan_placement
from commands import main
from worker.errors import CommandError


def test_every_token_written_is_read_on_one_primary_and_on_a_cluster(tmp_path: Path) -> None:
    path = tmp_path / "redis-scale-test.json"
    code = main(["bench", "redis-scale", "--primaries", "3", "--producers", "1", "--readers",
                 "3", "--streams-per-producer", "8", "--output-len", "8", "--duration-s", "1",
                 "--pin", "off", "--home-shards", "--output-json", str(path)])  # fmt: skip
    assert code == 0
    record = json.loads(path.read_text())
    single, cluster, homed = record["results"]
    assert (single["redis"], single["primaries"], single["shards"]) == ("single", 1, 1)
    assert (cluster["redis"], cluster["primaries"], cluster["shards"]) == ("cluster", 3, 3)
    assert (homed["redis"], homed["primaries"], homed["shards"]) == ("cluster", 3, 3)
    assert [row["readers_home_shards"] for row in record["results"]] == [False, False, True]
    for row in (single, cluster, homed):
        # end to end: every token and event written was read, by requests that all finished
        assert row["tokens_read"] == row["tokens_written"] == row["requests"] * 8 > 0
        assert row["token_events_read"] == row["token_events_written"] == row["tokens_read"]
        assert row["requests"] == row["requests_written"] and row["mismatched_requests"] == 0
        assert row["tokens_per_s"] == pytest.approx(row["tokens_read"] / row["elapsed_s"])
        assert row["redis_cpu_us_per_token"] > 0 and row["redis_commands_per_s"] > 0
        assert row["cost"]["redis_calls_per_token_by_command"]["xadd"] >= 1.0
        assert len(row["redis_cpu_busy_by_primary"]) == row["primaries"]
        assert (row["producers"], row["readers"]) == (1, 3)
        assert row["cost"]["redis_command_us_per_token_by_command"]["xadd"] > 0
    # the requests' keys spread over every primary, or each reader's on its home shard's
    assert all(busy > 0 for busy in cluster["redis_cpu_busy_by_primary"])
    assert all(busy > 0 for busy in homed["redis_cpu_busy_by_primary"])
    assert record["ratio"] == pytest.approx(cluster["tokens_per_s"] / single["tokens_per_s"])
    assert record["ratio_home_shards"] == pytest.approx(
        homed["tokens_per_s"] / single["tokens_per_s"]
    )
    assert record["targets"]["ratio_at_least"] == 2.5
    assert record["targets"]["met"] == (record["ratio"] >= 2.5)
    assert record["settings"]["num_primaries"] == 3 and record["settings"]["redis_cores"] == []


def test_placement_pins_each_primary_alone_and_splits_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16 cores with hyperthread siblings i and i + 8
    monkeypatch.setattr("bench.redis_scale._siblings", lambda core: {core % 8, core % 8 + 8})
    placement = plan_placement(ScaleSettings(num_primaries=3), list(range(16)))
    assert placement.redis_cores == [0, 1, 2]
    assert placement.load_cores == [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]
    assert (placement.num_producers, placement.num_readers) == (5, 5)
    assert plan_placement(ScaleSettings(pin="off"), list(range(16))).redis_cores == []
    few = plan_placement(ScaleSettings(num_primaries=3), [0, 1, 2, 3])  # auto: too few to pin
    assert few.redis_cores == [] and (few.num_producers, few.num_readers) == (2, 2)
    with pytest.raises(CommandError, match="cannot hold"):
        plan_placement(ScaleSettings(num_primaries=3, pin="on"), [0, 1, 2])


def test_a_bad_setting_is_refused_before_any_redis_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "redis-scale", "--primaries", "1"]) != 0
    assert "--primaries must be >= 2" in capsys.readouterr().err
    assert main(["bench", "redis-scale", "--readers", "4", "--home-shards"]) != 0
    assert (
        "--home-shards needs the readers to be a multiple of --primaries" in capsys.readouterr().err
    )
