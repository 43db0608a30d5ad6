"""The worker's own Prometheus ``/metrics`` (issue 31, item 4), scraped from a running worker."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients import Client, FinishReason, TokenEvent, protocol
from tests.gateway_fixtures import LONG_MAX_TOKENS
from tests.redis_server import RedisServer
from tests.service_fixtures import InProcessWorker, worker_settings
from worker.local_stack import free_port
from worker.prometheus import queue_reading

KEYS = protocol.Keys()
LONG = dict(max_tokens=LONG_MAX_TOKENS, ignore_eos=True, temperature=0)  # runs for seconds


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of every sample (comments checked to precede their samples)."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            family = key.split("{")[0].removesuffix("_bucket").removesuffix("_sum")
            assert family.removesuffix("_count") in typed, f"{key}: no # TYPE before it"
            samples[key] = float(value)
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    wanted = {"worker": "w1", **labels}
    for key, number in samples.items():
        metric, _, rest = key.partition("{")
        pairs = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair)
        if metric == f"pagestream_worker_{name}" and all(
            pairs.get(k) == f'"{v}"' for k, v in wanted.items()
        ):
            return number
    raise AssertionError(f"{name} {labels} not in {sorted(samples)}")


def wait_for_scrape(port: int, predicate: Any, timeout_s: float = 30) -> dict[str, float]:
    deadline_s = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if predicate(samples) or time.monotonic() > deadline_s:
            return samples
        time.sleep(0.1)


@pytest.fixture
def metered_worker(chat_model_dir: Path, redis_server: RedisServer) -> Iterator[InProcessWorker]:
    """One slot (so that entries wait in the stream), a 2048-token context (so that a long
    request runs until cancelled), a fast heartbeat (the queue's figures) and /metrics on."""
    settings = worker_settings(
        redis_server, "w1", max_in_flight=1, heartbeat_interval_s=0.1,
        metrics_port=free_port(), metrics_host="127.0.0.1",
    )  # fmt: skip
    worker = InProcessWorker(chat_model_dir, settings).start()
    yield worker
    worker.stop()


def test_a_running_worker_serves_its_load_queue_and_token_counters(
    metered_worker: InProcessWorker, redis_server: RedisServer
) -> None:
    worker, port = metered_worker, metered_worker.settings.metrics_port
    pool_pages = worker.engine.block_manager.num_blocks
    with Client(redis_server.url) as client:
        long_id = client.submit("w5 w6", **LONG)
        assert isinstance(next(client.resume(long_id, timeout_s=30)), TokenEvent)
        queued = [client.submit(f"w{7 + i}", max_tokens=3, ignore_eos=True) for i in range(3)]
        # one slot: the long request runs, the three wait in the stream (no worker read them)
        busy = wait_for_scrape(port, lambda s: value(s, "queue_lag") == 3)
        client.cancel(long_id)
        done = [client.result(rid, timeout_s=60) for rid in [long_id, *queued]]
    assert value(busy, "queue_lag") == 3 and value(busy, "queue_pending") == 1
    assert value(busy, "queue_depth") == 4
    assert value(busy, "requests_running") == 1 and value(busy, "requests_in_flight") == 1
    assert value(busy, "requests_max_in_flight") == 1
    assert 1 <= value(busy, "kv_pages_used") <= value(busy, "kv_pages_total") == pool_pages
    assert value(busy, "generated_tokens_total") >= 1
    assert done[0].finish_reason is FinishReason.CANCELLED
    idle = wait_for_scrape(port, lambda s: value(s, "queue_depth") == 0)
    assert (value(idle, "queue_depth"), value(idle, "queue_lag"), value(idle, "queue_pending")) == (
        0,
        0,
        0,
    )
    assert value(idle, "generated_tokens_total") == sum(len(c.token_ids) for c in done)
    assert value(idle, "requests_finished_total", finish_reason="length") == 3
    assert value(idle, "requests_finished_total", finish_reason="cancelled") == 1
    assert value(idle, "prompt_tokens_total") == sum(c.usage.prompt_tokens for c in done if c.usage)
    assert value(idle, "requests_running") == value(idle, "kv_pages_used") == 0
    assert value(idle, "engine_steps_total") > 0
    # the event loop's probe ran all along: every lag counted, up to the +Inf bucket
    probes = value(idle, "event_loop_lag_seconds_count")
    assert probes > value(busy, "event_loop_lag_seconds_count") > 0
    assert value(idle, "event_loop_lag_seconds_bucket", le="+Inf") == probes
    assert (
        idle['pagestream_worker_info{worker="w1",model="' + str(worker.engine.config.model) + '"}']
        == 1
    )
    other = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
    assert other.status_code == 404 and "/metrics" in other.text


def test_the_heartbeat_carries_the_worst_loop_lag_since_the_last_one(
    metered_worker: InProcessWorker, redis_server: RedisServer
) -> None:
    worker = metered_worker
    loop = worker._loop
    assert loop is not None
    redis = redis_server.client()

    def heartbeat() -> protocol.WorkerStatus:
        raw = redis.get(KEYS.worker("w1"))
        assert isinstance(raw, bytes)
        status: protocol.WorkerStatus = protocol.decode_struct(raw, protocol.WorkerStatus)
        return status

    deadline_s = time.monotonic() + 30
    while redis.get(KEYS.worker("w1")) is None and time.monotonic() < deadline_s:
        time.sleep(0.05)
    loop.call_soon_threadsafe(time.sleep, 0.3)  # the worker's loop held for 300 ms
    worst_ms = 0.0
    while worst_ms < 250 and time.monotonic() < deadline_s:
        worst_ms = max(worst_ms, heartbeat().loop_lag_max_ms)
        time.sleep(0.02)
    assert 250 <= worst_ms < 5000
    # heartbeats every 0.1 s: a later one's window is past the stall
    calm_ms = worst_ms
    while calm_ms >= 100 and time.monotonic() < deadline_s:
        calm_ms = heartbeat().loop_lag_max_ms
        time.sleep(0.05)
    assert calm_ms < 100


def test_the_queue_lag_is_the_depth_less_the_pending_entries() -> None:
    reading = queue_reading(9, 2)
    assert (reading.depth, reading.pending, reading.lag) == (9, 2, 7)
    assert queue_reading(0, 0).lag == 0


def test_the_port_comes_from_its_flag_or_variable_and_0_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from commands import build_parser
    from worker.settings import WorkerSettings

    def settings(*argv: str) -> WorkerSettings:
        return WorkerSettings.from_args(build_parser().parse_args(["worker", *argv]), max_seqs=8)

    off = settings()
    assert (off.metrics_port, off.metrics_host) == (0, "0.0.0.0")
    monkeypatch.setenv("PAGESTREAM_METRICS_PORT", "9400")
    assert settings().metrics_port == 9400
    assert settings("--metrics-port", "9500", "--metrics-host", "127.0.0.1").metrics_port == 9500
    with pytest.raises(ValueError, match="metrics_port"):
        settings("--metrics-port", "70000")


def test_a_taken_port_stops_the_worker_with_a_clear_error(
    text_model_dir: Path, redis_server: RedisServer
) -> None:
    from worker.prometheus import MetricsPortError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = worker_settings(redis_server, "w1", metrics_port=port, metrics_host="127.0.0.1")
        worker = InProcessWorker(text_model_dir, settings).start()
        with pytest.raises(MetricsPortError, match=f"--metrics-port {port} on 127.0.0.1"):
            worker.stop()
    assert worker.service is not None and not worker.service.engine_thread.is_running


def test_a_taken_port_is_told_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """``pagestream worker --metrics-port`` on a taken port (or an unknown host) is a one-line
    error before the model loads (minutes on a GPU), not after it."""
    from commands import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        common = ["worker", "--model", "dummy:tiny", "--device", "cpu", "--metrics-port", str(port)]
        assert main([*common, "--metrics-host", "127.0.0.1"]) == 1
        err = capsys.readouterr().err
        assert f"--metrics-port {port} on 127.0.0.1:" in err and "loading the model" not in err
        assert main([*common, "--metrics-host", "no-such-host.invalid"]) == 1
        assert "on no-such-host.invalid:" in capsys.readouterr().err
