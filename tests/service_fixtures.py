"""Worker-service test helpers: a tiny model with a tokenizer, workers in-process and as processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from engine import EngineConfig, LLMEngine
from tests.redis_server import RedisServer
from worker.engine_thread import EngineThread
from worker.service import WorkerService
from worker.settings import WorkerSettings

NUM_WORDS = 320  # every token id of the tiny models decodes to a word
WORDS = ["<pad>", "<s>", "</s>", "<unk>", *(f"w{i}" for i in range(4, NUM_WORDS))]
STOP_TIMEOUT_S = 60.0
# Short leases and block times keep takeover tests fast.
FAST = dict(lease_s=1.5, read_block_ms=200, heartbeat_interval_s=0.5, grace_s=10.0)


@pytest.fixture(scope="session")
def text_model_dir(tiny_model_dirs: dict[str, Path], tmp_path_factory: Any) -> Path:
    """The tiny llama with a word-level tokenizer over its whole vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path_factory.mktemp("service-model") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(model_dir)
    return model_dir


class InProcessWorker:
    """A ``WorkerService`` on a thread with its own event loop (so tests keep theirs)."""

    def __init__(self, model_dir: Path, settings: WorkerSettings, **engine: Any) -> None:
        config = EngineConfig(model=str(model_dir), device="cpu", **engine)
        self.engine = LLMEngine(config)
        self.settings = settings
        self.service: WorkerService | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> InProcessWorker:
        self._thread.start()
        assert self._ready.wait(STOP_TIMEOUT_S)
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by stop()
            self.error = exc

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.service = WorkerService(self.settings, EngineThread(self.engine))
        self._ready.set()
        await self.service.run()

    def stop(self) -> None:
        if self._loop is not None and self.service is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.service.request_stop)
        self._thread.join(STOP_TIMEOUT_S)
        assert not self._thread.is_alive(), "the worker did not stop"
        if self.error is not None:
            raise self.error


def slow_steps(
    engine: LLMEngine, delay_s: float = 0.02, monkeypatch: pytest.MonkeyPatch | None = None
) -> None:
    """Every later step of ``engine`` first sleeps ``delay_s`` (until ``monkeypatch`` undoes
    it, if given: for an engine that outlives the test). The tiny CPU models write hundreds
    of tokens a second, so a stop, cancel or Redis fault that a test sends once the first
    token arrives could land after the request ended (a CI run lost that race); at 20 ms a
    step, 200 tokens take 4 s and the request is still running when it lands."""
    step = engine.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return step(*args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(engine, "step", slow_step)
    else:
        engine.step = slow_step  # type: ignore[method-assign]


def worker_settings(server: RedisServer, name: str, **overrides: Any) -> WorkerSettings:
    return replace(WorkerSettings(redis_url=server.url, name=name, **FAST), **overrides)


@pytest.fixture
def start_worker(text_model_dir: Path, redis_server: RedisServer) -> Iterator[Any]:
    """``start_worker(name, **settings)``: an in-process worker, stopped after the test."""
    workers: list[InProcessWorker] = []

    def start(
        name: str = "w1", engine: dict[str, Any] | None = None, **overrides: Any
    ) -> InProcessWorker:
        settings = worker_settings(redis_server, name, **overrides)
        worker = InProcessWorker(text_model_dir, settings, **(engine or {})).start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


class HasRedisUrl(Protocol):
    """A Redis to point a worker at: a ``RedisServer``, a cluster, the chaos suite's target."""

    @property
    def url(self) -> str: ...


def spawn_worker(
    model_dir: Path, server: HasRedisUrl, name: str, log_dir: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """``python -m commands worker ...`` as a child process (for SIGKILL and SIGTERM)."""
    args = [
        sys.executable, "-m", "commands", "worker", "--redis-url", server.url, "--name", name,
        "--model", str(model_dir), "--device", "cpu", "--lease-s", "1.5", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (log_dir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
