"""A real gateway for the tests: uvicorn on a port of its own (on a thread), a real Redis and an
in-process worker on the tiny text model, with a chat template added to its tokenizer."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from tests.redis_server import RedisServer
from tests.service_fixtures import InProcessWorker, worker_settings
from worker.gateway.app import create_app
from worker.gateway.config import GatewaySettings
from worker.local_stack import wait_until

API_KEY = "test-key"
# Words of the tiny vocabulary, so that every prompt token is known: a message `w5 w6` becomes
# `w10 w5 w6 w11 w12` (5 tokens), which shows that the worker applied this template.
CHAT_TEMPLATE = (
    "{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}"
    "{% if add_generation_prompt %}w12{% endif %}"
)
START_TIMEOUT_S = 30.0
# The tiny model's context, raised from 256 (no rope scaling: the weights mean the same) so
# that a long request runs for seconds: a cancel test must not race its natural end.
CONTEXT_LEN = 2048
LONG_MAX_TOKENS = CONTEXT_LEN - 16


@pytest.fixture(scope="session")
def chat_model_dir(text_model_dir: Path, tmp_path_factory: Any) -> Path:
    """The tiny text model with ``CHAT_TEMPLATE`` in its tokenizer and a ``CONTEXT_LEN`` context."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("chat-model") / "llama"
    shutil.copytree(text_model_dir, model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = CONTEXT_LEN
    config_path.write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    return model_dir


class GatewayThread:
    """``create_app(settings)`` under uvicorn on a thread, until ``stop``. With ``port=0`` it
    listens on a socket it binds itself (``settings.port`` becomes that socket's port), so no
    other process (the suite runs on several) can take the port between choosing and binding."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", settings.port))
        self.settings = dataclasses.replace(settings, port=self.socket.getsockname()[1])
        self.app = create_app(self.settings)
        config = uvicorn.Config(self.app, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self) -> GatewayThread:
        self._thread.start()
        wait_until(lambda: self.server.started, START_TIMEOUT_S, "the gateway")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(START_TIMEOUT_S)
        self.socket.close()


def start_gateway(redis_url: str, **overrides: Any) -> GatewayThread:
    settings = GatewaySettings(redis_url=redis_url, port=0, **overrides)
    return GatewayThread(settings).start()


@dataclass
class Stack:
    """Redis, one worker and one gateway (with ``API_KEY``)."""

    redis: RedisServer
    worker: InProcessWorker
    gateway: GatewayThread
    model: str

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}/v1"


@pytest.fixture(scope="module")
def stack(chat_model_dir: Path, tmp_path_factory: Any) -> Iterator[Stack]:
    redis = RedisServer(tmp_path_factory.mktemp("gateway-redis"), appendonly=False)
    redis.start()
    worker = InProcessWorker(chat_model_dir, worker_settings(redis, "gw-worker"))
    gateway = None
    try:
        worker.start()
        gateway = start_gateway(redis.url, api_keys=(API_KEY,))
        heartbeat = redis.client()
        wait_until(lambda: bool(heartbeat.keys("pagestream:worker:*")), START_TIMEOUT_S, "beat")
        heartbeat.close()
        yield Stack(redis, worker, gateway, str(chat_model_dir))
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        redis.stop()


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """``predicate()``'s first truthy value, or fail after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not true within {timeout_s} s")
