"""``pagestream bench serve --workers 1,2`` at a tiny size on the CPU: worker processes on one
stream, a scaling record. No speed is asserted (the CPU is shared): the record's shape, the load
scaled by N, and every worker's consumer serving part of it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from bench.fleet import TARGET_EFFICIENCY, _add_efficiency, available_cores, fleet_workers
from bench.host_cpu import CpuTimes, busy_cores, read_cpu_times
from commands import main as cli_main
from worker.errors import EXIT_USAGE

NUM_PROMPTS = 8  # per worker
CONCURRENCY = 4  # per worker


def test_fleet_sweep_scales_the_load_and_every_worker_serves(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    code = cli_main([
        "bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--workers", "1,2",
        "--concurrency", str(CONCURRENCY), "--num-prompts", str(NUM_PROMPTS),
        "--input-len", "4-8", "--output-len", "3-6", "--max-seqs", "8",
        "--no-offline", "--vocab-size", "100", "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "serve-fleet" and record["settings"]["redis"] == "embedded"
    cores = record["machine"]["cores_available"]
    assert cores == available_cores() >= 1
    rows = record["results"]
    assert [row["num_workers"] for row in rows] == [1, 2]
    for row in rows:
        n = row["num_workers"]
        assert row["concurrency"] == n * CONCURRENCY
        assert row["num_requests"] == n * NUM_PROMPTS
        # Greedy, EOS ignored: every request produced its drawn 3-6 tokens.
        assert 3 * n * NUM_PROMPTS <= row["output_tokens"] <= 6 * n * NUM_PROMPTS
        assert row["threads_per_worker"] == max(1, cores // n)
        assert row["memory_fractions"] is None  # a CPU pool is not a share of a GPU
        # Each of the N consumers on the one stream finished some of the requests.
        served = row["requests_by_worker"]
        assert len(served) == n and all(count > 0 for count in served.values())
        assert sum(served.values()) == row["num_requests"]
        for name in ("ttft_s", "tpot_s"):
            assert 0 < row[name]["p50"] <= row[name]["p90"] <= row[name]["p99"]
        assert row["requests_per_s"] == pytest.approx(row["num_requests"] / row["elapsed_s"])
        assert row["workers"]["num_steps"] > 0
        # CPU time from /proc around the run, counted in clock ticks (10 ms): this short
        # run's parts may read 0, the busy host may not
        busy = row["busy_cores"]
        assert set(busy) == {"host", "workers", "redis", "client", "other"}
        assert busy["host"] > 0 and min(busy.values()) >= 0
        cost = row["cost"]  # what a token costs Redis and the workers
        assert cost["output_tokens"] == row["output_tokens"]
        assert 0 < cost["token_events_per_token"] <= 1
        assert (
            cost["redis_calls_per_token"] > 0
            and "evalsha" in cost["redis_calls_per_token_by_command"]
        )
        assert set(cost["cpu_us_per_token"]) == {"workers", "redis"}
        expected = row["output_tok_s"] / (n * rows[0]["output_tok_s"])
        assert row["scaling_efficiency"] == pytest.approx(expected)
    names = [set(row["requests_by_worker"]) for row in rows]
    assert not names[0] & names[1], "each count starts workers of its own"
    assert rows[0]["scaling_efficiency"] == 1.0
    assert record["targets"]["efficiency_at_least"] == TARGET_EFFICIENCY
    assert out.with_suffix(".png").stat().st_size > 0


def test_efficiency_target_applies_up_to_the_core_count() -> None:
    rows = [{"num_workers": n, "output_tok_s": rate} for n, rate in ((1, 100.0), (2, 190.0), (4, 200.0))]  # fmt: skip
    _add_efficiency(rows, num_cores=2)
    assert [row["scaling_efficiency"] for row in rows] == [1.0, 0.95, 0.5]
    assert [row["ideal_output_tok_s"] for row in rows] == [100.0, 200.0, 400.0]
    assert [row["target_met"] for row in rows] == [True, True, None]


def test_workers_sharing_a_gpu_split_its_memory_and_cpu_workers_its_cores() -> None:
    from engine.config_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "dummy:tiny", "--pa-memory-fraction", "0.8"])
    args.prefix = "p"
    args.worker_devices = "shared"
    gpu = fleet_workers(args, "redis://127.0.0.1:1/0", 4, "cuda", num_cores=16)
    # Each fraction counts the workers started before it: about 0.2 of the GPU each.
    fractions = [w.command[w.command.index("--pa-memory-fraction") + 1] for w in gpu]
    assert fractions == ["0.2", "0.4", "0.6", "0.8"]
    assert len({w.name for w in gpu}) == 4 and all(w.env == {} for w in gpu)
    cpu = fleet_workers(args, "redis://127.0.0.1:1/0", 2, "cpu", num_cores=16)
    assert all(w.env == {"OMP_NUM_THREADS": "8"} for w in cpu)
    assert all(w.command[w.command.index("--pa-memory-fraction") + 1] == "0.8" for w in cpu)


def test_spread_workers_get_a_gpu_each_and_its_whole_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data parallel: worker i on GPU i mod G; workers that share a GPU split its fraction."""
    from engine.config_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "dummy:tiny", "--pa-memory-fraction", "0.8"])
    args.prefix = "p"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args.worker_devices = "auto"
    two = fleet_workers(args, "redis://127.0.0.1:1/0", 2, "cuda", num_cores=16)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in two] == ["3", "5"]
    assert [w.command[w.command.index("--pa-memory-fraction") + 1] for w in two] == ["0.8"] * 2
    # auto with more workers than GPUs: all on the engine's device, as before
    four = fleet_workers(args, "redis://127.0.0.1:1/0", 4, "cuda", num_cores=16)
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in four)
    args.worker_devices = "spread"
    four = fleet_workers(args, "redis://127.0.0.1:1/0", 4, "cuda", num_cores=16)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in four] == ["3", "5", "3", "5"]
    fractions = [w.command[w.command.index("--pa-memory-fraction") + 1] for w in four]
    assert fractions == ["0.4", "0.4", "0.8", "0.8"]


def test_tensor_parallel_workers_get_gpu_groups_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TP2 x 2 workers on four GPUs: worker i on GPUs 2i and 2i+1, each with the whole
    fraction; too few GPUs or a shared GPU is refused with what it needs (``bench serve``
    refuses TP workers on a CPU: test_fleet_refuses_workers_it_does_not_spawn)."""
    from bench.fleet import worker_gpus
    from engine.config_flags import add_engine_args
    from worker.errors import CommandError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "dummy:tiny", "--tensor-parallel-size", "2",
                              "--pa-memory-fraction", "0.8"])  # fmt: skip
    args.prefix, args.worker_devices = "p", "auto"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    two = fleet_workers(args, "redis://127.0.0.1:1/0", 2, "cuda", num_cores=16)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in two] == ["4,5", "6,7"]
    assert [w.command[w.command.index("--pa-memory-fraction") + 1] for w in two] == ["0.8"] * 2
    assert all(w.command[w.command.index("--tensor-parallel-size") + 1] == "2" for w in two)
    assert worker_gpus(args, 1, "cuda") == ["4,5"]
    with pytest.raises(CommandError, match="needs 6 GPUs, 4 visible"):
        worker_gpus(args, 3, "cuda")
    assert worker_gpus(args, 2, "cpu") is None  # CPU workers start their ranks on the host
    args.worker_devices = "shared"
    with pytest.raises(CommandError, match="not --worker-devices shared"):
        worker_gpus(args, 2, "cuda")


def test_fleet_refuses_workers_it_does_not_spawn(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["bench", "serve", "--model", "dummy:tiny", "--workers", "2",
                     "--redis-url", "redis://127.0.0.1:1/0"])  # fmt: skip
    assert code == EXIT_USAGE and "--spawn-worker" in capsys.readouterr().err
    code = cli_main(["bench", "serve", "--model", "dummy:tiny", "--workers", "1,2",
                     "--tensor-parallel-size", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "tensor-parallel" in err and "CUDA only" in err


@pytest.mark.gpu
def test_two_workers_share_one_gpu_by_memory_fraction(tmp_path: Path) -> None:
    """Two workers on one GPU, started in turn with 0.25 and 0.5 of it (half of 0.5 each):
    the second one's pool fits beside the first one, and both serve the stream."""
    out = tmp_path / "fleet-gpu.json"
    code = cli_main([
        "bench", "serve", "--model", "dummy:qwen3-0.6b", "--device", "cuda", "--workers", "2",
        "--pa-memory-fraction", "0.5", "--max-model-len", "2048", "--concurrency", "16",
        "--num-prompts", "32", "--input-len", "16-64", "--output-len", "16-64",
        "--no-offline", "--vocab-size", "1000", "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["memory_fractions"] == [0.25, 0.5] and row["threads_per_worker"] is None
    assert row["num_requests"] == 2 * 32
    served = row["requests_by_worker"]
    assert len(served) == 2 and all(count > 0 for count in served.values())
    assert record["machine"]["device"].startswith("cuda")


def test_busy_cores_split_the_host_between_its_parts() -> None:
    before = CpuTimes(wall_s=0.0, host_busy_s=10.0, groups_s={"workers": 1.0, "redis": 0.0},
                      self_s=2.0)  # fmt: skip
    after = CpuTimes(wall_s=2.0, host_busy_s=13.0, groups_s={"workers": 2.5, "redis": 0.5},
                     self_s=2.5)  # fmt: skip
    # 3 s of the host's CPU in 2 s: 1.5 cores, of which 1.25 are accounted for.
    assert busy_cores(before, after) == {
        "host": 1.5, "workers": 0.75, "redis": 0.25, "client": 0.25, "other": 0.25,
    }  # fmt: skip
    now = read_cpu_times({"self": [os.getpid()], "gone": [2**22 + 1]})
    assert now is not None and now.groups_s["gone"] == 0.0 and now.groups_s["self"] >= 0
