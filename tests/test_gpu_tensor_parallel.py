"""Tensor parallelism on two GPUs (NCCL; skipped with fewer): the tokens of one GPU, CUDA
graphs with the all-reduces captured inside them, and a rank that dies ends the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
PROMPTS = random_prompts([5, 37, 70, 16, 101], 320, seed=3)
ROOT = Path(__file__).resolve().parent.parent


def _tokens(model: str, **settings: object) -> tuple[list[list[int]], bool]:
    """Greedy tokens of ``PROMPTS``, and whether decode steps replayed CUDA graphs."""
    with LLM(model, device="cuda", **settings) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [out.token_ids for out in outputs], llm.engine.runner.uses_cuda_graphs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: its one KV head on both ranks
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_two_gpus_fp32_give_the_tokens_of_one(
    kind: str, cuda_graphs: bool, tiny_model_dirs: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs[kind])
    settings = dict(dtype="float32", pa_block_size=16, pa_context_len=160, max_model_len=160)
    expected, _ = _tokens(model, **settings)
    sharded, graphed = _tokens(model, tensor_parallel_size=2, cuda_graphs=cuda_graphs, **settings)
    assert sharded == expected
    assert graphed == cuda_graphs


def test_swapped_pages_come_back_on_both_ranks(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    settings = dict(
        dtype="float32", pa_block_size=16, pa_context_len=160, max_model_len=160, preemption="swap"
    )
    assert _tokens(model, tensor_parallel_size=2, **settings)[0] == _tokens(model, **settings)[0]


def test_a_dead_rank_ends_the_engine_process_without_a_hang(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """NCCL waits for a dead peer inside the step: rank 0 must still end, on its own."""
    script = textwrap.dedent(f"""
        import os, signal
        from engine import EngineConfig, LLMEngine, SamplingParams
        engine = LLMEngine(EngineConfig(model={str(tiny_model_dirs["llama"])!r},
                                        device="cuda", tensor_parallel_size=2))
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        engine.add_request("r", prompt_token_ids=[5, 6, 7], sampling=params)
        for _ in range(3):
            engine.step()
        os.kill(engine.ranks.children[0].pid, signal.SIGKILL)
        while True:
            engine.step()
    """)
    start_s = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "EngineDeadError" in done.stderr or "exiting" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start_s < 90
