"""Batch jobs through arq in the worker's loop: same texts as offline, progress, abort, retry.

One in-process worker (service + arq on one loop, tiny llama with a word tokenizer) serves the
module; the worker-death test runs workers as processes so that one can be SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from arq.connections import ArqRedis
from arq.jobs import DeserializationError, SerializationError

from clients import BatchState, BatchStatus, Client
from clients.batch import BATCH_FUNCTION, BatchKeys, deserialize_job, serialize_job
from commands import main as cli_main
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.redis_server import RedisServer
from tests.service_fixtures import FAST, STOP_TIMEOUT_S, slow_steps, spawn_worker
from tests.test_cli import MISTYPED_FIELDS, mistyped_lines
from tests.test_worker_service import random_prompts
from worker.batch import BatchSettings
from worker.batch_runner import BatchRunner, serve_with_batches
from worker.engine_thread import EngineThread
from worker.service import WorkerService
from worker.settings import WorkerSettings

LINES_IN_FLIGHT = 8
WAIT_S = 120.0


class BatchWorker:
    """``serve_with_batches`` on a thread with its own loop; ``batch`` overrides settings."""

    def __init__(self, model_dir: Path, redis_url: str, **batch: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
        self.settings = WorkerSettings(redis_url=redis_url, name="bw1", **FAST)  # type: ignore[arg-type]
        self.batch_settings = BatchSettings(
            redis_url=redis_url, worker_name="bw1", lease_s=1.5, poll_delay_s=0.05,
            max_lines_in_flight=LINES_IN_FLIGHT, **batch,
        )  # fmt: skip
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(STOP_TIMEOUT_S)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.error = exc

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        engine_thread = EngineThread(self.engine)
        self.service = WorkerService(self.settings, engine_thread)
        self.runner = BatchRunner(self.batch_settings, engine_thread)
        self._ready.set()
        await serve_with_batches(self.service, self.runner)

    def stop(self) -> None:
        for stop in (self.service.request_stop, self.runner.request_stop):
            self.loop.call_soon_threadsafe(stop)
        self._thread.join(STOP_TIMEOUT_S)
        assert not self._thread.is_alive(), "the worker did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    redis_server = RedisServer(tmp_path_factory.mktemp("batch-redis"), appendonly=False)
    redis_server.start()
    yield redis_server
    redis_server.stop()


@pytest.fixture(scope="module")
def worker(text_model_dir: Path, server: RedisServer) -> Iterator[BatchWorker]:
    batch_worker = BatchWorker(text_model_dir, server.url)
    yield batch_worker
    batch_worker.stop()


@pytest.fixture
def client(server: RedisServer) -> Iterator[Client]:
    with Client(server.url) as sync_client:
        yield sync_client


def wait_status(
    client: Client, job_id: str, until: Callable[[BatchStatus], bool], timeout_s: float = WAIT_S
) -> BatchStatus:
    """Re-read the job's status until ``until`` holds (the status hash is the event source)."""
    deadline_s = time.monotonic() + timeout_s
    while not until(status := client.batch_status(job_id)):
        assert time.monotonic() < deadline_s, f"gave up waiting; last status {status}"
        time.sleep(0.02)
    return status


def offline_texts(model_dir: Path, prompts: list[str], max_tokens: list[int]) -> list[str]:
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outputs = LLM(str(model_dir), device="cpu").generate(prompts, params, use_tqdm=False)
    return [out.text for out in outputs]


def test_100_prompt_batch_matches_offline_in_redis_and_jsonl(
    worker: BatchWorker, client: Client, text_model_dir: Path, tmp_path: Path
) -> None:
    prompts = random_prompts(100, seed=7)
    max_tokens = [2 + i % 13 for i in range(100)]
    lines = [
        json.dumps({"prompt": p, "max_tokens": n}) for p, n in zip(prompts, max_tokens, strict=True)
    ]
    output = tmp_path / "out" / "results.jsonl"
    job_id = client.submit_batch(lines=lines, output_path=str(output))
    result = client.batch_result(job_id, timeout_s=WAIT_S)
    status = result.status
    assert (status.state, status.total, status.done, status.failed) == (
        BatchState.COMPLETE, 100, 100, 0,
    )  # fmt: skip
    assert status.attempt == 1 and status.worker == "bw1"
    expected = offline_texts(text_model_dir, prompts, max_tokens)
    assert [r["text"] for r in result.records] == expected
    assert [r["id"] for r in result.records] == list(range(1, 101))
    assert all(len(r["token_ids"]) <= n for r, n in zip(result.records, max_tokens, strict=True))
    file_records = [json.loads(line) for line in output.read_text().splitlines()]
    assert file_records == result.records
    # Submitting the same id again runs nothing new.
    assert client.submit_batch(lines=lines, job_id=job_id) == job_id
    assert client.batch_status(job_id).done == 100


def test_plain_prompts_and_sampling_defaults(worker: BatchWorker, client: Client) -> None:
    job_id = client.submit_batch(["w5 w6", "w7"], max_tokens=3, ignore_eos=True)
    result = client.batch_result(job_id, timeout_s=WAIT_S)
    assert result.status.state is BatchState.COMPLETE
    assert [len(r["token_ids"]) for r in result.records] == [3, 3]
    assert [r["finish_reason"] for r in result.records] == ["length", "length"]


def test_a_line_with_n_gets_its_samples_as_choices(worker: BatchWorker, client: Client) -> None:
    lines = [
        '{"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": true, "n": 2, "temperature": 0}',
        '{"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": true, "n": 2, "best_of": 3, '
        '"temperature": 1, "seed": 4}',
        '{"prompt": "w5", "tools": []}',
    ]
    records = client.batch_result(client.submit_batch(lines=lines), timeout_s=WAIT_S).records
    greedy, best, refused = records
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert [c["token_ids"] for c in greedy["choices"]] == [greedy["token_ids"]] * 2
    assert greedy["usage"]["completion_tokens"] == 6 and greedy["usage"]["prompt_tokens"] == 2
    assert len(best["choices"]) == 2 and best["usage"]["completion_tokens"] == 9
    assert refused["error"]["field"] == "tools"


def test_bad_lines_become_error_records_and_the_job_continues(
    worker: BatchWorker, client: Client
) -> None:
    lines = [
        '{"prompt": "w5 w6", "max_tokens": 2}',
        "{not json",
        '{"prompt": "w5", "colour": "red"}',
        '{"max_tokens": 3}',
        '{"prompt": "w5", "temperature": -1}',
        '["a list"]',
        '{"prompt": "w5", "max_tokens": 1000}',  # past the context of 256 tokens
        '{"prompt": "w8 w9", "max_tokens": 2, "id": "last"}',
    ]
    result = client.batch_result(client.submit_batch(lines=lines), timeout_s=WAIT_S)
    assert (result.status.state, result.status.done, result.status.failed) == (
        BatchState.COMPLETE, 8, 6,
    )  # fmt: skip
    errors = [r["error"]["field"] if "error" in r else None for r in result.records]
    assert errors == [None, "line", "colour", "prompt", "temperature", "line", "max_tokens", None]
    assert "lower max_tokens to at most" in result.records[6]["error"]["message"]
    assert [r["id"] for r in result.records] == [1, 2, 3, 4, 5, 6, 7, "last"]
    assert result.records[-1]["text"]


def test_a_mistyped_field_is_named_with_the_type_it_should_have(
    worker: BatchWorker, client: Client
) -> None:
    lines = [*mistyped_lines(), '{"prompt": "w5 w6", "max_tokens": 2}']
    result = client.batch_result(client.submit_batch(lines=lines), timeout_s=WAIT_S)
    assert result.status.failed == len(MISTYPED_FIELDS)
    *errors, good = result.records
    got = [(r["error"]["field"], r["error"]["message"]) for r in errors]
    assert got == [(field, message) for field, _, message in MISTYPED_FIELDS]
    assert len(good["token_ids"]) == 2
    # the job's own sampling defaults are checked the same way
    job_id = client.submit_batch(["w5"], temperature="hot")
    status = client.batch_result(job_id, timeout_s=WAIT_S).status
    assert status.state is BatchState.FAILED
    assert status.error is not None
    assert 'temperature: expected a number, got str "hot"' in status.error


def test_unreadable_input_file_fails_the_job(worker: BatchWorker, client: Client) -> None:
    job_id = client.submit_batch(input_path="/nonexistent/prompts.jsonl")
    status = client.batch_result(job_id, timeout_s=WAIT_S).status
    assert status.state is BatchState.FAILED
    assert "/nonexistent/prompts.jsonl" in status.error


def test_progress_is_readable_while_running_and_abort_stops_the_job(
    worker: BatchWorker, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_steps(worker.engine, 0.005, monkeypatch)  # the job runs for seconds: the abort lands
    lines = [json.dumps({"prompt": f"w{5 + i}", "max_tokens": 48, "ignore_eos": True})
             for i in range(200)]  # fmt: skip
    job_id = client.submit_batch(lines=lines)
    running = wait_status(client, job_id, lambda s: s.done >= LINES_IN_FLIGHT)
    assert running.state is BatchState.RUNNING and running.total == 200
    assert running.done < running.total and running.failed == 0
    partial = client.batch_result(job_id, wait=False)
    assert len(partial.records) >= LINES_IN_FLIGHT
    status = client.abort_batch(job_id, timeout_s=WAIT_S)
    assert status.state is BatchState.ABORTED
    assert status.done < 200
    # Nothing of the job is left in the engine, and no record comes in after the abort.
    pending = asyncio.run_coroutine_threadsafe(_batch_requests_left(worker), worker.loop)
    assert pending.result(timeout=WAIT_S) == 0
    assert client.batch_status(job_id).done == status.done
    assert len(client.batch_result(job_id, wait=False).records) == status.done


async def _batch_requests_left(worker: BatchWorker) -> int:
    while worker.engine.has_unfinished_requests():  # aborted requests end with the next step
        await asyncio.sleep(0.01)
    return 0


def test_serializer_round_trip_and_pickle_refused(worker: BatchWorker, server: RedisServer) -> None:
    job = {"t": 1, "f": BATCH_FUNCTION, "a": [{"job_id": "x", "prompts": ["w5"]}], "k": {},
           "et": 1234}  # fmt: skip
    assert deserialize_job(serialize_job(job)) == job
    with pytest.raises(DeserializationError, match="pickle is refused"):
        deserialize_job(pickle.dumps(job))
    with pytest.raises(SerializationError):
        serialize_job({"a": [object()]})
    failed = deserialize_job(serialize_job({"s": False, "r": ValueError("bad line")}))
    assert "ValueError: bad line" in str(failed["r"])

    # A pickled job (arq's default serializer) on the batch queue is refused, never run.
    async def enqueue_pickled() -> None:
        arq = ArqRedis.from_url(server.url)  # job_serializer None: arq pickles
        await arq.enqueue_job(
            BATCH_FUNCTION, {"job_id": "pickled"}, _job_id="pickled", _queue_name=BatchKeys().queue
        )
        await arq.aclose()

    asyncio.run(enqueue_pickled())
    redis = server.client()
    deadline_s = time.monotonic() + WAIT_S
    while redis.zscore(BatchKeys().queue, "pickled") is not None:  # until arq gives up on it
        assert time.monotonic() < deadline_s
        time.sleep(0.02)
    assert not redis.exists(BatchKeys().status("pickled")), "the job function ran"
    assert msgspec.msgpack.decode(redis.get("arq:result:pickled"))["s"] is False
    redis.close()


def test_cli_submit_status_result_abort(
    worker: BatchWorker, server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "w5 w6", "max_tokens": 3}\n\n{"prompt": "w7", "id": "b"}\n')
    common = ["--redis-url", server.url]
    assert cli_main(["batch", "submit", "--input", str(source), "--id", "cli-1",
                     "--max-tokens", "2", *common]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == "cli-1"
    out = tmp_path / "result.jsonl"
    assert cli_main(["batch", "result", "cli-1", "--output", str(out), *common]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [1, "b"]
    assert [len(r["token_ids"]) <= n for r, n in zip(records, [3, 2], strict=True)] == [True, True]
    capsys.readouterr()
    assert cli_main(["batch", "status", "cli-1", "--json", *common]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["state"], status["done"], status["total"]) == ("complete", 2, 2)
    assert cli_main(["batch", "status", "no-such-job", *common]) == 1
    assert cli_main(["batch", "abort", "cli-1", *common]) == 0  # already complete: stays so
    assert "complete" in capsys.readouterr().out


def test_job_of_a_killed_worker_is_retried_and_completes_once(
    text_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    prompts = random_prompts(24, seed=3)
    lines = [json.dumps({"prompt": p, "max_tokens": 40, "ignore_eos": True}) for p in prompts]
    output = tmp_path / "killed.jsonl"
    extra = ("--batch-lines-in-flight", "2")
    first = spawn_worker(text_model_dir, redis_server, "doomed", tmp_path, *extra)
    second = None
    try:
        with Client(redis_server.url) as client:
            job_id = client.submit_batch(lines=lines, output_path=str(output))
            wait_status(client, job_id, lambda s: s.done >= 4)
            first.send_signal(signal.SIGKILL)
            first.wait(STOP_TIMEOUT_S)
            before = client.batch_status(job_id)
            assert before.state is BatchState.RUNNING and before.done < 24
            second = spawn_worker(text_model_dir, redis_server, "heir", tmp_path, *extra)
            result = client.batch_result(job_id, timeout_s=WAIT_S)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(STOP_TIMEOUT_S)
    status = result.status
    assert (status.state, status.done, status.total) == (BatchState.COMPLETE, 24, 24)
    assert status.attempt == 2 and status.worker == "heir"
    expected = offline_texts(text_model_dir, prompts, [40] * 24)
    assert [r["text"] for r in result.records] == expected
    file_ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert file_ids == list(range(1, 25)), "results missing or duplicated"


def test_a_job_whose_engine_stops_mid_job_goes_back_on_the_queue(
    text_model_dir: Path, redis_server: RedisServer
) -> None:
    """The engine's step raising (the thread then stops) is the worker's failure, not the
    job's: the job is put back on the queue for a worker whose engine runs, not failed."""
    server = redis_server
    stopping = BatchWorker(text_model_dir, server.url)
    real_step, num_steps = stopping.engine.step, 0

    def fails_at_the_fifth(*args: Any, **kwargs: Any) -> Any:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 5:
            raise RuntimeError("a step that fails")
        return real_step(*args, **kwargs)

    stopping.engine.step = fails_at_the_fifth  # type: ignore[method-assign]
    try:
        with Client(server.url) as client:
            prompts = random_prompts(6, seed=5)
            job_id = client.submit_batch(prompts, max_tokens=20, ignore_eos=True)
            seen = wait_status(client, job_id, lambda s: s.state is not BatchState.RUNNING
                               and num_steps >= 5)  # fmt: skip
            assert seen.state is BatchState.QUEUED, seen
    finally:
        with contextlib.suppress(RuntimeError):  # the worker ends with its engine's failure
            stopping.stop()
