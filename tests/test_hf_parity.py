"""Paging changes memory layout, never the math: greedy tokens equal transformers' generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, build_tiny_model, hf_greedy, random_prompts

NUM_NEW_TOKENS = 24
PROMPT_LENGTHS = [5, 37, 70, 16, 101]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)

# Settings under test: each must give the same tokens as the model run alone.
SETTINGS: dict[str, dict[str, Any]] = {
    "block16": dict(pa_block_size=16),
    "block32": dict(pa_block_size=32),
    # A pool of 160 tokens for 5 sequences of up to ~125: sequences are preempted.
    "preempt-recompute": dict(pa_block_size=16, pa_context_len=160, max_model_len=160),
    "preempt-swap": dict(
        pa_block_size=16, pa_context_len=160, max_model_len=160, preemption="swap"
    ),
    # Chunks shorter than the prompts, and a budget that splits steps unevenly.
    "chunked-prefill": dict(pa_block_size=16, prefill_chunk=24, max_batched_tokens=40, max_seqs=8),
    "paged-off": dict(paged_attn="off", max_model_len=160),
}


@pytest.fixture(scope="module")
def references(tiny_model_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)
    return {kind: hf_greedy(tiny_model_dirs[kind], prompts, NUM_NEW_TOKENS) for kind in TINY_ARCHS}


@pytest.mark.parametrize("kind", list(TINY_ARCHS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(
    kind: str,
    setting: str,
    tiny_model_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
) -> None:
    llm = LLM(str(tiny_model_dirs[kind]), **SETTINGS[setting])
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references[kind]
    assert all(out.finish_reason == "length" for out in outputs)
    if setting.startswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
    engine = llm.engine
    assert engine.block_manager.num_used_blocks == 0, "finished sequences left pages behind"


def test_prefix_cache_hits_keep_outputs_exact(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["qwen3"]
    shared = random_prompts([70], 320, seed=7)[0]
    tails = random_prompts([3, 9, 20], 320, seed=8)
    prompts = [shared + tail for tail in tails]
    expected = hf_greedy(model_dir, [shared, *prompts], NUM_NEW_TOKENS)

    llm = LLM(str(model_dir), pa_block_size=16)
    first = llm.generate([shared], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts, GREEDY, use_tqdm=False)

    assert [out.token_ids for out in first + rest] == expected
    # 70 shared tokens = 4 full pages of 16, reused by each of the three later prompts.
    assert [out.usage.cached_prompt_tokens for out in rest if out.usage] == [64, 64, 64]
    assert llm.engine.block_manager.num_prefix_hits >= 12
    assert llm.engine.stats().prefix_hit_rate > 0


@pytest.fixture(scope="module")
def shared_prefix_run(tiny_model_dirs: dict[str, Path]) -> tuple[Path, list[list[int]], Any]:
    """Three prompts that share 70 tokens (4 full pages of 16), and HF's greedy answers."""
    model_dir = tiny_model_dirs["qwen3"]
    shared = random_prompts([70], 320, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 20], 320, seed=8)]
    return model_dir, prompts, hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("budget", [(512, 512), (48, 32)], ids=["one-step", "chunked"])
def test_requests_sharing_an_uncached_prefix_compute_it_once(
    shared_prefix_run: tuple[Path, list[list[int]], Any],
    async_scheduling: bool,
    budget: tuple[int, int],
) -> None:
    """Submitted together, the first computes the shared pages and the others wait for them
    (one step, or while its chunks fill them), then read them: with the engine's next step
    scheduled while one runs (async), the pages a launched step fills count already."""
    model_dir, prompts, expected = shared_prefix_run
    max_batched_tokens, prefill_chunk = budget
    llm = LLM(
        str(model_dir), pa_block_size=16, async_scheduling=async_scheduling,
        max_batched_tokens=max_batched_tokens, prefill_chunk=prefill_chunk, max_seqs=4,
    )  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == expected
    assert [out.usage.cached_prompt_tokens for out in outputs if out.usage] == [0, 64, 64]
    assert llm.engine.stats().num_deferred_admissions >= 2


def test_whole_prompt_cached_still_computes_last_token(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["llama"]
    prompt = random_prompts([64], 320, seed=9)[0]  # exactly 4 pages of 16
    expected = hf_greedy(model_dir, [prompt], NUM_NEW_TOKENS)
    llm = LLM(str(model_dir), pa_block_size=16)
    again = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert [out.token_ids for out in again] == expected * 2
    assert again[1].usage is not None and again[1].usage.cached_prompt_tokens == 48


@pytest.mark.parametrize(
    ("max_window_layers", "windowed"), [(2, "no layer"), (0, "every layer")]
)  # the tiny models have 2 layers
def test_qwen2_sliding_windows_on_no_layer_or_every_layer_match_transformers(
    max_window_layers: int, windowed: str, tmp_path: Path
) -> None:
    """Qwen2's config windows the layers from ``max_window_layers`` on: none of them is full
    attention, all of them one window for the model (both were refused); the prompts run past
    the 16-token window."""
    overrides = dict(
        use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers
    )
    model_dir = build_tiny_model("qwen2", tmp_path / "m", overrides=overrides)
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=3)
    outputs = LLM(str(model_dir), pa_block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)


def test_qwen2_sliding_windows_on_some_layers_are_refused(tmp_path: Path) -> None:
    from engine.errors import UnsupportedModelError

    overrides = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    model_dir = build_tiny_model("qwen2", tmp_path / "m", overrides=overrides)
    with pytest.raises(UnsupportedModelError, match="sliding windows on some layers only"):
        LLM(str(model_dir))
