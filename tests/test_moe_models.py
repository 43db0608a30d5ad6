"""Mixture-of-experts models: greedy tokens equal transformers' generate (fp32, CPU).

Tiny random Qwen3-MoE (with a dense layer), Mixtral and Qwen2-MoE (shared expert) models,
through the torch reference path, under chunked prefill and prefix-cache hits; and the
Triton MoE path (through the interpreter) on the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from tests.conftest import TINY_MOE_ARCHS, hf_greedy, random_prompts

NUM_NEW_TOKENS = 16
PROMPT_LENGTHS = [5, 37, 70, 16]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
SETTINGS: dict[str, dict[str, Any]] = {
    "block16": dict(pa_block_size=16),
    "chunked-prefill": dict(pa_block_size=16, prefill_chunk=24, max_batched_tokens=40, max_seqs=8),
}


@pytest.fixture(scope="module")
def references(tiny_moe_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)
    return {
        kind: hf_greedy(tiny_moe_dirs[kind], prompts, NUM_NEW_TOKENS) for kind in TINY_MOE_ARCHS
    }


@pytest.mark.parametrize("kind", list(TINY_MOE_ARCHS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_moe_greedy_matches_transformers(
    kind: str,
    setting: str,
    tiny_moe_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    llm = LLM(str(tiny_moe_dirs[kind]), **SETTINGS[setting])
    outputs = llm.generate(random_prompts(PROMPT_LENGTHS, 320, seed=1), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references[kind]


def test_moe_prefix_cache_hits_keep_outputs_exact(tiny_moe_dirs: dict[str, Path]) -> None:
    model_dir = tiny_moe_dirs["qwen3_moe"]
    shared = random_prompts([40], 320, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9], 320, seed=8)]
    expected = hf_greedy(model_dir, [shared, *prompts], NUM_NEW_TOKENS)
    llm = LLM(str(model_dir), pa_block_size=16)
    outputs = llm.generate([shared], GREEDY, use_tqdm=False)
    outputs += llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == expected
    assert [out.usage.cached_prompt_tokens for out in outputs[1:] if out.usage] == [32, 32]


def test_moe_triton_path_matches_transformers(
    tiny_moe_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton kernels (interpreted on the CPU) give the reference's tokens."""
    monkeypatch.setenv("PAGESTREAM_ATTN_BACKEND", "triton")
    llm = LLM(str(tiny_moe_dirs["qwen3_moe"]), pa_block_size=16)
    prompt = random_prompts(PROMPT_LENGTHS, 320, seed=1)[0]  # 5 tokens, then 15 decodes
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references["qwen3_moe"][:1]


def test_moe_refuses_quantized_experts(tiny_moe_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"mixture of experts.*--quantization none"):
        LLM(str(tiny_moe_dirs["mixtral"]), quantization="fp8")
