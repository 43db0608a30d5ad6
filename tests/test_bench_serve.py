"""``pagestream bench serve`` at a tiny size on the CPU: embedded Redis, a spawned worker, a record.

No timing assertions: the record's shape and counts are checked, not its speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.streams import StreamTiming, _one, _stream_all, summarize
from bench.workloads import BenchPrompt
from clients import DoneEvent, TokenEvent
from clients.protocol import FinishReason, Usage
from commands import main as cli_main
from tests.test_cli import run_cli
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


class _FakeClient:
    """A client whose every stream is the given events (the worker's side of ``_one``)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    async def stream(self, **request: Any) -> AsyncIterator[Any]:
        for event in self.events:
            yield event


def _done(reason: FinishReason, num_tokens: int) -> DoneEvent:
    usage = Usage(prompt_tokens=4, completion_tokens=num_tokens)
    return DoneEvent(finish_reason=reason, usage=usage, worker="w")


@pytest.mark.parametrize(
    ("end", "failure"),
    [
        (_done(FinishReason.TIMEOUT, 1), "finish reason timeout"),
        (_done(FinishReason.LENGTH, 1), "fewer tokens than asked"),
        (None, "no done event"),
    ],
)
def test_a_stream_that_ends_short_is_failed_and_left_out_of_the_figures(
    end: DoneEvent | None, failure: str
) -> None:
    token = TokenEvent(seq=0, text="", token_ids=[7])
    events = [token] if end is None else [token, end]
    timing = asyncio.run(_one(_FakeClient(events), BenchPrompt([1, 2, 3, 4], output_len=8)))
    assert timing.failure == failure and timing.num_tokens == 1
    finished = StreamTiming(ttft_s=0.1, last_s=0.8, num_tokens=8)
    summary = summarize([finished, timing], elapsed_s=1.0)
    assert summary["num_requests"] == 1 and summary["num_failed"] == 1
    assert summary["failures"] == {failure: 1}
    assert summary["output_tokens"] == 8 and summary["ttft_s"]["p50"] == pytest.approx(0.1)


def test_a_stream_with_every_token_finishes() -> None:
    events = [TokenEvent(seq=0, text="", token_ids=[7, 8]), _done(FinishReason.LENGTH, 2)]
    timing = asyncio.run(_one(_FakeClient(events), BenchPrompt([1, 2], output_len=2)))
    assert timing.failure is None and timing.worker == "w" and timing.num_tokens == 2


def test_a_negative_count_of_warm_up_runs_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--num-prompts", "1",
            "--input-len", "4", "--output-len", "2", "--no-offline", "--vocab-size", "100",
            "--warmup-runs", "-1"]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--warmup-runs: expected an integer of 0 or more, got '-1'" in err


@pytest.mark.parametrize("timeout_s", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_of_no_time_is_a_usage_error(
    timeout_s: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a tiny load: should the flag pass, the run stays short
    args = ["bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--num-prompts", "1",
            "--input-len", "4", "--output-len", "2", "--no-offline", "--vocab-size", "100",
            "--timeout-s", timeout_s]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--timeout-s: expected a number of seconds above 0" in err


def test_bench_serve_whose_requests_time_out_fails_after_writing_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1 ms: the worker's deadline passes before a request's first step
    out = tmp_path / "serve.json"
    code, _, err = run_cli([
        "bench", "serve", "--model", "dummy:tiny", "--device", "cpu", "--concurrency", "2",
        "--num-prompts", "2", "--input-len", "4", "--output-len", "8", "--max-seqs", "4",
        "--no-offline", "--vocab-size", "100", "--timeout-s", "0.001", "--output-json", str(out),
    ], capsys)  # fmt: skip
    assert code == 1
    last_line = err.strip().splitlines()[-1]
    assert last_line.endswith("error: 2 requests failed (2 finish reason timeout): the figures "
                              "cover only the requests that finished")  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert results["num_requests"] == 0 and results["num_failed"] == 2
    assert results["output_tokens"] == 0 and results["ttft_s"]["p50"] is None


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


def test_the_timed_streams_report_each_finished_request() -> None:
    """The progress bar's feed: one call per request streamed, whichever client task took it."""
    events = [TokenEvent(seq=0, text="", token_ids=[7]), _done(FinishReason.LENGTH, 1)]
    finished: list[int] = []
    prompts = [BenchPrompt([1, 2], output_len=1) for _ in range(5)]
    timings = asyncio.run(_stream_all(_FakeClient(events), prompts, 2, finished.append))
    assert len(timings) == 5 and finished == [1] * 5


@pytest.mark.parametrize(
    ("finish_reason", "num_tokens", "failure"),
    [
        ("length", 4, None),
        ("timeout", 1, "finish reason timeout"),
        ("length", 3, "fewer tokens than asked"),
        (None, 0, "no finish reason"),
    ],
)
def test_a_gateway_stream_is_judged_as_a_client_stream_is(
    finish_reason: str | None, num_tokens: int, failure: str | None
) -> None:
    """The gateway path counts a stream that ended by its deadline, short, or without a finish
    as failed, as the client path does (it counted every stream as finished)."""
    from bench.gateway import stream_failure

    assert stream_failure(finish_reason, num_tokens, BenchPrompt([1], output_len=4)) == failure
