"""Tensor parallelism on the CPU (gloo): shard plans, the collectives, and whole engines of
two ranks giving the same greedy tokens as one; a rank that dies ends the engine, no hang."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.distributed.ranks import TIMEOUT_ENV, check_devices
from engine.distributed.shard import ShardPlan
from engine.errors import ConfigError, EngineDeadError
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from tests.conftest import TINY_COMMON, random_prompts

NUM_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
PROMPT_LENGTHS = [14, 30, 46, 60]  # each crosses a 16-token page while it decodes


def tiny_arch(**fields: object) -> ModelArch:
    base = ModelArch.from_hf_config(dummy_hf_config("tiny"))  # 4 heads, 2 KV heads, dim 16
    return ModelArch(**{**base.__dict__, **fields})


# -- shard plans ------------------------------------------------------------------------------


def test_plan_splits_heads_mlp_and_vocabulary() -> None:
    arch = tiny_arch(vocab_size=10)
    head_dim = arch.head_dim
    plan = ShardPlan.for_arch(arch, rank=1, size=2)
    assert (plan.num_heads, plan.num_kv_heads, plan.intermediate_size) == (2, 1, 64)
    prefix = "model.layers.0."
    assert plan.split_of(prefix + "self_attn.q_proj.weight") == (0, 2 * head_dim, 4 * head_dim)
    assert plan.split_of(prefix + "self_attn.k_proj.bias") == (0, head_dim, 2 * head_dim)
    assert plan.split_of(prefix + "self_attn.o_proj.weight") == (1, 2 * head_dim, 4 * head_dim)
    assert plan.split_of(prefix + "mlp.up_proj.weight") == (0, 64, 128)
    assert plan.split_of(prefix + "mlp.down_proj.weight") == (1, 64, 128)
    assert plan.split_of(prefix + "input_layernorm.weight") is None
    assert plan.split_of("model.embed_tokens.weight") == (0, 5, 10)
    # a row-parallel bias is added once: by rank 0
    assert plan.takes_zeros(prefix + "self_attn.o_proj.bias")
    assert not ShardPlan.for_arch(arch, 0, 2).takes_zeros(prefix + "self_attn.o_proj.bias")


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    arch = tiny_arch()  # 4 query heads on 2 KV heads: query heads 0-1 read KV head 0
    kv_heads = [ShardPlan.for_arch(arch, rank, 4).first_kv_head for rank in range(4)]
    assert kv_heads == [0, 0, 1, 1]
    plan = ShardPlan.for_arch(arch, 3, 4)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_replicas) == (1, 1, 2)


def test_last_vocab_shard_is_padded_and_only_slices_are_read() -> None:
    arch = tiny_arch(vocab_size=10)
    plan = ShardPlan.for_arch(arch, rank=3, size=4)  # rows 9..11 of 10: one real, two padding
    full = torch.arange(10 * 64, dtype=torch.float32).view(10, 64)
    read: list[tuple[slice, ...]] = []

    def read_slice(index: tuple[slice, ...]) -> torch.Tensor:
        read.append(index)
        return full[index]

    part = plan.read("lm_head.weight", tuple(full.shape), read_slice)
    assert read == [(slice(9, 10), slice(None))]
    assert part.shape == (3, 64)
    assert torch.equal(part[0], full[9]) and not part[1:].any()


@pytest.mark.parametrize(
    ("fields", "size", "words"),
    [
        (dict(), 3, "4 attention heads"),
        (dict(num_heads=6, num_kv_heads=3), 2, "3 KV heads"),
        (dict(intermediate_size=130), 4, "MLP width 130"),
    ],
)
def test_plan_refuses_sizes_that_do_not_split(
    fields: dict[str, int], size: int, words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        ShardPlan.for_arch(tiny_arch(**fields), 0, size)


def test_config_refuses_size_below_one() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_each_rank_needs_a_gpu_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(EngineConfig(device="cuda", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="from cuda:1 needs 2 GPUs; 2 are visible"):
        check_devices(EngineConfig(device="cuda:1", tensor_parallel_size=2))


def test_engine_refuses_a_size_that_does_not_split_the_model_before_starting_ranks() -> None:
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        LLMEngine(EngineConfig(model="dummy:tiny", tensor_parallel_size=3))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(("shape", "billions"), [("llama3-70b", 70.6), ("qwen2.5-32b", 32.8)])
def test_large_dummy_shapes(shape: str, billions: float) -> None:
    arch = ModelArch.from_hf_config(dummy_hf_config(shape))
    assert arch.num_params / 1e9 == pytest.approx(billions, abs=0.1)
    local = ShardPlan.for_arch(arch, 0, 8).local_arch()
    assert (local.num_heads * 8, local.num_kv_heads) == (arch.num_heads, 1)


# -- whole engines ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose every part splits unevenly or once: 321 tokens (the last vocabulary
    shard padded), one KV head (replicated on both ranks), o_proj and down_proj biases (added
    by rank 0 alone)."""
    import transformers

    config = transformers.LlamaConfig(
        **{**TINY_COMMON, "vocab_size": 321, "num_key_value_heads": 1},
        attention_bias=True,
        mlp_bias=True,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # wide weights: clear-cut greedy picks (as tests/conftest.py)
        for param in model.parameters():
            param.normal_(0.0, 0.12)
    directory = tmp_path_factory.mktemp("odd-llama")
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("qwen2", dict()),  # q/k/v biases, tied embeddings; one KV head per rank
        # and a pool that runs out: swaps go to both ranks
        ("odd", dict(pa_block_size=16, pa_context_len=160, max_model_len=160, preemption="swap")),
    ],
)
def test_two_ranks_give_the_tokens_of_one(
    kind: str,
    settings: dict[str, object],
    tiny_model_dirs: dict[str, Path],
    odd_llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "pagestream.engine")
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=3)
    model = str(odd_llama_dir if kind == "odd" else tiny_model_dirs[kind])
    with LLM(model, **settings) as single:
        expected = [out.token_ids for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, tensor_parallel_size=2, **settings) as sharded:
        outputs = sharded.generate(prompts, GREEDY, use_tqdm=False)
        kv_heads = sharded.engine.kv_cache.spec.num_kv_heads
        num_preemptions = sharded.engine.scheduler.num_preemptions
    assert [out.token_ids for out in outputs] == expected
    assert kv_heads == 1
    assert re.search(r"KV pool per rank of 2: rank 0 \d+ pages .*, rank 1 \d+ pages", caplog.text)
    if "preemption" in settings:
        assert num_preemptions > 0, "the pool was meant to run out"


def test_ranks_outwait_an_idle_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # collectives may wait 3 s (a loaded CI box can stall a rank for a second); an idle
    # engine, longer
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with LLM("dummy:tiny", tensor_parallel_size=2, pa_memory_mb=16) as llm:
        time.sleep(4.5)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert llm.engine.group.sums == "gloo"  # what benchmarks record of the path
    assert len(out.token_ids) == 4


def test_a_rank_that_fails_to_start_is_an_error_not_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the rank's process exits at once
    start_s = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code 1"):
        LLMEngine(EngineConfig(model="dummy:tiny", tensor_parallel_size=2))
    assert time.monotonic() - start_s < 10
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_ends_the_engine(tiny_model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), tensor_parallel_size=2))
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        engine.add_request("r", prompt_token_ids=[5, 6, 7], sampling=params)
        for _ in range(3):
            engine.step()
        assert engine.ranks is not None
        child = engine.ranks.children[0]
        os.kill(child.pid, signal.SIGKILL)
        start_s = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start_s < 10
    finally:
        engine.shutdown()


def test_bench_throughput_runs_two_sharded_engines_one_after_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_cli import BENCH_ARGS, run_cli

    path = tmp_path / "record.json"
    args = [
        *BENCH_ARGS,
        "--num-prompts",
        "3",
        "--tensor-parallel-size",
        "2",
        "--compare",
        "paged-off",
    ]
    code, _, err = run_cli([*args, "--output-json", str(path)], capsys)
    assert code == 0, err
    record = json.loads(path.read_text())
    assert record["settings"]["tensor_parallel_size"] == 2
    # per-rank dummy weights differ from the unsharded model's, not between these two runs
    assert record["baselines"]["paged_off"]["output_tokens"] == record["results"]["output_tokens"]


def test_host_tier_copies_run_on_every_rank(tiny_model_dirs: dict[str, Path]) -> None:
    from tests.test_kv_offload import VOCAB_SIZE, run_in_order

    # as test_kv_offload: the shared prefix leaves the device pool and comes back from the host
    prefix, first, flush_a, flush_b, second = random_prompts([48, 10, 100, 100, 12], VOCAB_SIZE, 3)
    prompts = [prefix + first, flush_a, flush_b, prefix + second]
    settings: dict[str, Any] = dict(
        model=str(tiny_model_dirs["llama"]), pa_block_size=16, pa_context_len=128, max_model_len=128
    )
    expected = run_in_order(LLMEngine(EngineConfig(**settings)), prompts, 8)
    sharded = LLMEngine(EngineConfig(**settings, kv_offload_mb=1, tensor_parallel_size=2))
    try:
        assert run_in_order(sharded, prompts, 8) == expected
        assert sharded.stats().num_host_hit_tokens == 48
    finally:
        sharded.shutdown()


def test_samples_copy_their_shared_page_on_every_rank(tiny_model_dirs: dict[str, Path]) -> None:
    # n > 1: the samples' copy-on-write of the prompt's partial last page runs on both ranks
    prompts = random_prompts([10, 13], 320, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    model = str(tiny_model_dirs["qwen2"])
    with LLM(model, pa_block_size=4) as single:
        expected = [
            [s.token_ids for s in out.outputs]
            for out in single.generate(prompts, params, use_tqdm=False)
        ]
    with LLM(model, pa_block_size=4, tensor_parallel_size=2) as sharded:
        outputs = sharded.generate(prompts, params, use_tqdm=False)
    assert [[s.token_ids for s in out.outputs] for out in outputs] == expected
