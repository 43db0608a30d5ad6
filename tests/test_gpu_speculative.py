"""Speculative decoding on a CUDA device (skipped without one): the Triton kernels verify
drafts as one decode row per position over paged context, replayed from decode graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from tests.test_speculative import TIGHT, repetitive_prompts, run

pytestmark = pytest.mark.gpu

CUDA_TIGHT = {**TIGHT, "device": "cuda", "dtype": "float32"}


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_cuda_fp32_speculative_tokens_equal_plain_decoding_on_the_cpu(
    tiny_model_dirs: dict[str, Path], cuda_graphs: bool, preemption: str
) -> None:
    model = tiny_model_dirs["llama"]
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40 + i, ignore_eos=True) for i in range(6)]
    cpu, _ = run(model, prompts, params, **{**TIGHT, "preemption": preemption})
    settings = {**CUDA_TIGHT, "preemption": preemption, "cuda_graphs": cuda_graphs}
    gpu, engine = run(
        model, prompts, params, speculative="ngram", num_speculative_tokens=3, **settings
    )
    assert gpu == cpu
    stats = engine.stats()
    assert stats.num_preemptions > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.runner.uses_cuda_graphs is cuda_graphs


def test_cuda_verify_steps_replay_decode_graphs(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of decodes and verifications is a decode step: one graph replay whose rows are
    every draft position, not piecewise graphs around eager attention."""
    replayed_rows: list[int] = []
    replay = DecodeGraphs.replay

    def counting_replay(self: DecodeGraphs, input_ids: torch.Tensor, *args: object) -> object:
        replayed_rows.append(input_ids.shape[0])
        return replay(self, input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "replay", counting_replay)
    prompts = repetitive_prompts(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    _, engine = run(
        tiny_model_dirs["llama"], prompts, params, speculative="ngram",
        num_speculative_tokens=3, **{**CUDA_TIGHT, "cuda_graphs": True},
    )  # fmt: skip
    assert engine.stats().num_accepted_tokens > 0
    assert max(replayed_rows) > len(prompts)  # more rows than sequences: draft positions


def test_cuda_bf16_sampled_speculation_is_seeded_and_frees_every_page() -> None:
    # A draft model drafts at every step; prompt lookup on a random model's sampled tokens
    # may find no match at all (the CPU tests cover it with tokens that repeat).
    settings = dict(
        device="cuda", max_model_len=1024, pa_memory_mb=256, speculative_model="dummy:qwen3-0.6b"
    )
    prompts = [run_ids * 6 for run_ids in ([11, 5000, 77, 123, 9, 42, 7, 1000],) * 4]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, seed=i, ignore_eos=True)
        for i in range(4)
    ]
    outputs = []
    for _ in range(2):
        llm = LLM("dummy:qwen3-0.6b", **settings)
        outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        engine = llm.engine
        assert engine.block_manager.num_used_blocks == 0
        assert engine.stats().num_draft_tokens > 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 64 for tokens in outputs[0])


def test_cuda_fp32_draft_model_gives_plain_tokens_and_its_own_drafts_all_pass(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """The model as its own draft on the GPU: the draft's decode graphs and pool follow the
    sequences exactly, so (but for a rounding near-tie between the decode and the verify
    kernels) every greedy draft is accepted."""
    model = tiny_model_dirs["llama"]
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40 + i, ignore_eos=True) for i in range(6)]
    cpu, _ = run(model, prompts, params, **TIGHT)
    settings = {**CUDA_TIGHT, "speculative_model": str(model), "num_speculative_tokens": 3}
    gpu, engine = run(model, prompts, params, **settings)
    assert gpu == cpu
    stats = engine.stats()
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95
