"""Structured outputs on a CUDA device (skipped without one): the engine's CUDA defaults
(asynchronous scheduling, CUDA graphs, the Triton mask kernel) give the CPU's greedy outputs,
and every output validates."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputs
from tests.test_structured_outputs import PROMPTS, SCHEMA, check_json, params, structured

pytestmark = pytest.mark.gpu


def test_cuda_defaults_give_the_cpus_constrained_outputs(smollm2_vocab_model: Path) -> None:
    sampling = params(structured(json_schema=SCHEMA), len(PROMPTS) * 4)
    prompts = PROMPTS * 4
    settings = dict(max_model_len=512, dtype="float32", pa_memory_mb=256)
    gpu_llm = LLM(str(smollm2_vocab_model), device="cuda", **settings)
    assert gpu_llm.engine.async_scheduling and gpu_llm.engine.runner.uses_cuda_graphs
    gpu = gpu_llm.generate(prompts, sampling, use_tqdm=False)
    for out in gpu:
        check_json(out.text)
    assert gpu_llm.engine.runner.grammar_masks.num_fills > 0
    del gpu_llm
    cpu = LLM(str(smollm2_vocab_model), device="cpu", **settings)
    greedy = [i for i, p in enumerate(sampling) if p.is_greedy]
    expected = cpu.generate(
        [prompts[i] for i in greedy], [sampling[i] for i in greedy], use_tqdm=False
    )
    assert [gpu[i].token_ids for i in greedy] == [o.token_ids for o in expected]


def test_cuda_bf16_with_prompt_lookup_drafts(smollm2_vocab_model: Path) -> None:
    prompts = ['{"name":"ab","age":3,"tags":["a"],"kind":"cat"} ' * 2 + p for p in PROMPTS]
    llm = LLM(str(smollm2_vocab_model), device="cuda", max_model_len=512, pa_memory_mb=256,
              speculative="ngram", num_speculative_tokens=4)  # fmt: skip
    outs = llm.generate(
        prompts, params(structured(json_schema=SCHEMA), len(prompts)), use_tqdm=False
    )
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.stats().num_accepted_tokens > 0


def test_the_mask_kernel_at_a_real_vocabulary() -> None:
    from kernels.sampling.token_bitmask import apply_token_bitmask_ref
    from kernels.sampling.token_bitmask_triton import apply_token_bitmask

    vocab_size, num_rows = 151936, 256
    logits = torch.randn(num_rows, vocab_size, device="cuda", dtype=torch.bfloat16)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (200, vocab_size // 32), dtype=torch.int32, device="cuda"
    )
    rows = torch.randperm(num_rows, device="cuda")[:200]
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_choice_under_cuda_graphs_ends_at_the_choice(smollm2_vocab_model: Path) -> None:
    llm = LLM(str(smollm2_vocab_model), device="cuda", max_model_len=512, pa_memory_mb=256)
    choices = ("north", "south", "east west")
    sampling = SamplingParams(
        max_tokens=16, temperature=1.0, structured=StructuredOutputs(choice=choices)
    )
    outs = llm.generate(PROMPTS * 8, sampling, use_tqdm=False)
    assert all(o.text in choices and o.finish_reason.value == "stop" for o in outs)
