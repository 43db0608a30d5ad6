"""What the engine builds per stepping thread (``LLMEngine.prepare_thread``): cuDNN keeps its
attention graphs per thread in torch, so they are built on the thread that steps, once, and
before a worker's first request waits on it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine_thread import EngineThread


@pytest.fixture
def engine_and_builds() -> tuple[LLMEngine, list[str]]:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu", max_model_len=128))
    builds: list[str] = []

    def record() -> int:
        builds.append(threading.current_thread().name)
        return 0

    engine._build_shapes = record  # type: ignore[assignment]
    return engine, builds


def test_each_stepping_thread_builds_once(engine_and_builds: tuple[LLMEngine, list[str]]) -> None:
    engine, builds = engine_and_builds
    engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
    engine.step()
    engine.step()
    assert builds == [threading.current_thread().name]
    other = threading.Thread(target=engine.step, name="another-stepper")
    other.start()
    other.join()
    engine.step()
    assert builds == [threading.current_thread().name, "another-stepper"]


def test_the_worker_s_engine_thread_builds_before_any_request(
    engine_and_builds: tuple[LLMEngine, list[str]],
) -> None:
    engine, builds = engine_and_builds

    async def start_and_stop() -> None:
        thread = EngineThread(engine)
        thread.start()
        await thread.stop()

    asyncio.run(start_and_stop())
    assert builds == ["pagestream-engine"]


def test_the_cpu_backends_build_nothing(engine_and_builds: tuple[LLMEngine, list[str]]) -> None:
    engine, _ = engine_and_builds
    arch = engine.loaded.model.arch
    built = engine.attention_backend.build_prefill_shapes(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, engine.dtype, engine.device, 32768,
        4096,
    )  # fmt: skip
    assert built == 0
