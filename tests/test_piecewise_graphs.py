"""The piecewise forward (graph pieces around eager attention) equals the model's forward.

On the CPU the pieces run eagerly through the same static buffers, padding rows and cuts that
CUDA graphs replay on a GPU (test_gpu.py checks the captured graphs there), so these tests
pin down the cut itself: every layer's halves, the padding, the hand-off buffers.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.piecewise_graphs import PiecewiseGraphs, token_buckets
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
# Chunked prefill beside decodes: most steps are mixed, with token counts off the buckets.
SETTINGS = dict(device="cpu", pa_block_size=16, max_seqs=4, max_batched_tokens=64, prefill_chunk=40)


def test_token_buckets_cover_every_count_with_little_padding() -> None:
    buckets = token_buckets(8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == 16 and buckets[-1] == 8192
    assert all(size % 16 == 0 for size in buckets)
    for smaller, larger in itertools.pairwise(buckets):
        assert larger - smaller <= max(16, smaller // 8)  # at most ~12% padding above 128
    assert token_buckets(100)[-1] == 100 and token_buckets(8)[-1] == 8


def _with_piecewise(llm: LLM, max_tokens: int) -> list[int]:
    """Give ``llm``'s runner uncaptured piecewise graphs; returns the token counts it ran."""
    runner = llm.engine.runner
    piecewise = PiecewiseGraphs(runner.model, runner.kv_cache.layers, max_tokens, runner.device)
    seen: list[int] = []
    forward = piecewise.forward

    def counting_forward(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(input_ids.shape[0])
        return forward(input_ids, *args)  # type: ignore[arg-type]

    piecewise.forward = counting_forward  # type: ignore[method-assign]
    runner.piecewise = piecewise
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_piecewise_engine_gives_the_plain_engines_tokens(
    kind: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs[kind])
    prompts = random_prompts([45, 7, 30, 19], 320, seed=21)
    prompts.append([*prompts[0][:32], 9, 8])  # a prefix-cache hit: attention reads old pages
    plain = LLM(model, **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model, **SETTINGS)
    seen = _with_piecewise(llm, max_tokens=64)
    pieced = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in pieced] == [o.token_ids for o in plain]
    assert any(count not in token_buckets(64) for count in seen)  # padded steps ran
    assert any(count > 4 for count in seen)  # prefill chunks went through the pieces


def test_piecewise_hidden_states_equal_the_models(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dirs["qwen3"]), **SETTINGS)
    runner = llm.engine.runner
    seqs = llm.engine.scheduler
    for index, prompt in enumerate(random_prompts([20, 9], 320, seed=2)):
        llm.engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=GREEDY)
    llm.engine._apply_inbox()
    batch = seqs.schedule(0.0)
    inputs = runner.prepare_inputs(batch)  # 29 tokens: a bucket of 32 with 3 padding rows
    expected = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta)
    piecewise = PiecewiseGraphs(runner.model, runner.kv_cache.layers, 64, runner.device)
    hidden = piecewise.forward(inputs.input_ids, inputs.positions, inputs.meta)
    assert hidden.shape == expected.shape == (29, runner.model.arch.hidden_size)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_a_step_over_the_largest_bucket_runs_eagerly(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    prompts = random_prompts([45, 30], 320, seed=5)
    plain = LLM(model, **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model, **SETTINGS)
    seen = _with_piecewise(llm, max_tokens=32)  # the 40-token chunks do not fit
    pieced = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in pieced] == [o.token_ids for o in plain]
    assert seen and max(seen) <= 32
