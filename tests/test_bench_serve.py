"""``pagestream bench serve`` at a tiny size on the CPU: embedded Redis, a spawned worker, a record.

No timing assertions: the record's shape and counts are checked, not its speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.streams import StreamTiming, summarize
from commands import main as cli_main
from worker.local_stack import engine_flags

NUM_PROMPTS = 12


def test_bench_serve_writes_a_valid_record_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = cli_main([
        "bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--concurrency", "4",
        "--num-prompts", str(NUM_PROMPTS), "--input-len", "4-8", "--output-len", "3-6",
        "--max-seqs", "8", "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "serve" and record["settings"]["redis"] == "embedded"
    results, offline = record["results"], record["offline"]
    assert results["num_requests"] == NUM_PROMPTS
    # Greedy, EOS ignored: both runs produce exactly the drawn output lengths.
    assert results["output_tokens"] == offline["output_tokens"]
    assert 3 * NUM_PROMPTS <= results["output_tokens"] <= 6 * NUM_PROMPTS
    for name in ("ttft_s", "tpot_s"):
        cells = results[name]
        assert set(cells) == {"p50", "p90", "p99", "mean"}
        assert 0 < cells["p50"] <= cells["p90"] <= cells["p99"]
    assert results["ratio_to_offline"] > 0
    assert offline["tpot_s"]["p50"] > 0 and results["added_tpot_p50_ms"] is not None
    # The worker's own step counters, read from its heartbeats around the timed run: every
    # output token but the first of each request needs a step of its own.
    workers = results["workers"]
    assert workers["num_steps"] >= max(results["output_tokens"] // NUM_PROMPTS, 1)
    assert workers["step_s"] > 0 and 0 < workers["busy_fraction"] <= 1
    assert set(results["targets"]) >= {"ratio_met", "added_tpot_met"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_summarize_percentiles_and_tpot() -> None:
    timings = [StreamTiming(ttft_s=0.1 * i, last_s=0.1 * i + 0.9, num_tokens=10) for i in (1, 2)]
    timings.append(StreamTiming(ttft_s=0.5, last_s=0.5, num_tokens=1))  # no TPOT of one token
    summary = summarize(timings, elapsed_s=2.0)
    assert summary["output_tokens"] == 21 and summary["output_tok_s"] == 10.5
    assert abs(summary["tpot_s"]["p50"] - 0.1) < 1e-9
    assert abs(summary["ttft_s"]["p50"] - 0.2) < 1e-9


def test_engine_flags_round_trip_through_the_worker_parser() -> None:
    from engine.config_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    given = ["--model", "dummy:tiny", "--device", "cpu", "--prefix-caching", "off",
             "--tenant-quota", "a=3", "--max-seqs", "8"]  # fmt: skip
    args = parser.parse_args(given)
    assert vars(parser.parse_args(engine_flags(args))) == vars(args)


def test_bench_serve_through_the_gateway_records_both_paths(tmp_path: Path) -> None:
    """The same load through Redis and through a spawned gateway: both runs' counts, and the
    gateway's ratio to the client path (no speed is asserted on this shared CPU)."""
    out = tmp_path / "serve-gateway.json"
    num_prompts = 6
    code = cli_main([
        "bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--concurrency", "3",
        "--num-prompts", str(num_prompts), "--input-len", "4-8", "--output-len", "3-6",
        "--max-seqs", "8", "--no-offline", "--vocab-size", "100", "--through", "gateway",
        "--output-json", str(out),
    ])  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    results = record["results"]
    client_path, gateway = results["client_path"], results["gateway"]
    assert record["settings"]["through"] == "gateway" and gateway["url"] == "spawned"
    # Greedy, EOS ignored: both paths produce exactly the drawn output lengths.
    assert results["num_requests"] == client_path["num_requests"] == num_prompts
    assert results["output_tokens"] == client_path["output_tokens"]
    assert 3 * num_prompts <= results["output_tokens"] <= 6 * num_prompts
    assert 0 < results["tpot_s"]["p50"] <= results["tpot_s"]["p99"]
    ratio = results["output_tok_s"] / client_path["output_tok_s"]
    assert gateway["ratio_to_client_path"] == ratio and gateway["target_ratio_at_least"] == 0.9
    assert gateway["added_tpot_p50_ms"] is not None
