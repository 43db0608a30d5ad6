"""The engine on a CUDA device (skipped without one): same greedy tokens as on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_cuda_fp32_matches_cpu(
    kind: str, preemption: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model_dir = str(tiny_model_dirs[kind])
    prompts = random_prompts([5, 37, 70, 16, 101], 320, seed=3)
    settings = dict(pa_block_size=16, pa_context_len=160, max_model_len=160, preemption=preemption)
    cpu = LLM(model_dir, device="cpu", **settings).generate(prompts, GREEDY, use_tqdm=False)
    gpu_llm = LLM(model_dir, device="cuda", dtype="float32", **settings)
    gpu = gpu_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.scheduler.num_preemptions > 0


def test_cuda_bf16_dummy_model_runs_and_frees_every_page() -> None:
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=2048, pa_memory_mb=512)
    prompts = random_prompts([100, 300, 700], 151936, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [32, 32, 32]
    assert llm.engine.block_manager.num_used_blocks == 0
