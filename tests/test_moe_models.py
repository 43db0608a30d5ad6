"""Mixture-of-experts models: greedy tokens equal transformers' generate (fp32, CPU).

Tiny random Qwen3-MoE (with a dense layer), Mixtral and Qwen2-MoE (shared expert) models,
through the torch reference path, under chunked prefill and prefix-cache hits; and the
Triton MoE path (through the interpreter) on the same model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.shard import ShardPlan
from engine.errors import ConfigError
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from engine.models.moe import Fp8StackedExperts, SparseMoeBlock
from engine.quant.linear import QuantizedLinear
from kernels.linear.quant import FORMATS, quantize
from tests.conftest import TINY_MOE_ARCHS, build_tiny_model, hf_greedy, random_prompts

CUDA = torch.cuda.is_available()
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


def test_qwen2_moe_without_qkv_biases_matches_transformers(tmp_path: Path) -> None:
    """Qwen2-MoE's config says whether q, k and v have biases: without them the model loads and
    answers as transformers' does (the engine assumed dense Qwen2's biases, and refused the
    checkpoint for lacking them)."""
    model_dir = build_tiny_model("qwen2_moe", tmp_path / "m", overrides=dict(qkv_bias=False))
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)
    outputs = LLM(str(model_dir), pa_block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize(
    ("config_name", "extra"),
    [
        ("LlamaConfig", {}),
        ("Qwen2Config", {}),
        ("Qwen3MoeConfig", TINY_MOE_ARCHS["qwen3_moe"][1]),
        ("MixtralConfig", TINY_MOE_ARCHS["mixtral"][1]),
    ],
)
def test_an_activation_other_than_silu_is_refused(config_name: str, extra: dict[str, Any]) -> None:
    """The MLPs and experts compute SiLU: a model made with GELU loaded and gave other tokens
    than transformers'. "swish" is SiLU's other name."""
    import transformers

    from engine.errors import UnsupportedModelError
    from tests.conftest import TINY_COMMON

    def config(activation: str) -> Any:
        made = getattr(transformers, config_name)(
            **{**TINY_COMMON, **extra, "hidden_act": activation}
        )
        made.architectures = [config_name.replace("Config", "ForCausalLM")]
        return made

    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu' is not supported"):
        ModelArch.from_hf_config(config("gelu"))
    for silu in ("silu", "swish"):
        ModelArch.from_hf_config(config(silu))


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


@pytest.mark.skipif(CUDA, reason="the interpreter on CPU tensors; on a GPU the cuda test runs it")
def test_moe_triton_path_matches_transformers(
    tiny_moe_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton kernels (interpreted on the CPU) give the reference's tokens."""
    monkeypatch.setenv("PAGESTREAM_ATTN_BACKEND", "triton")
    llm = LLM(str(tiny_moe_dirs["qwen3_moe"]), pa_block_size=16)
    # 16 tokens (32 pairs: the sorted path), then decodes of one token (the direct path)
    prompt = random_prompts(PROMPT_LENGTHS, 320, seed=1)[3]
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references["qwen3_moe"][3:4]


def test_moe_refuses_block_formats_for_experts(tiny_moe_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"mixture of experts.*--quantization fp8"):
        LLM(str(tiny_moe_dirs["mixtral"]), quantization="q8_0")


@pytest.fixture(scope="module")
def fp8_exact_qwen3_moe(
    tiny_moe_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Qwen3-MoE with every weight that --quantization fp8 quantizes (linears and
    experts; not the router, norms or embeddings) already on its per-row e4m3 grid: rounding
    it again changes nothing, so the fp8 engine must give transformers' tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dirs["qwen3_moe"], dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2 or "embed" in name or name.endswith("mlp.gate.weight"):
                continue
            rows = param.reshape(-1, param.shape[-1])
            planes = quantize(rows, FORMATS["fp8"])
            param.copy_((planes["w"].float() * planes["scale"]).view(param.shape))
    directory = tmp_path_factory.mktemp("fp8-qwen3-moe")
    model.save_pretrained(directory)
    return directory


def test_moe_fp8_experts_give_transformers_tokens_on_their_grid(fp8_exact_qwen3_moe: Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS[1:2], 320, seed=2)
    expected = hf_greedy(fp8_exact_qwen3_moe, prompts, NUM_NEW_TOKENS)
    llm = LLM(str(fp8_exact_qwen3_moe), quantization="fp8", pa_block_size=16)
    block = llm.engine.runner.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and isinstance(block.w13, Fp8StackedExperts)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == expected


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_moe_two_ranks_give_the_tokens_of_transformers(
    kind: str, tiny_moe_dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    """Experts (and Qwen2-MoE's shared expert) split along their width over two gloo ranks."""
    with LLM(str(tiny_moe_dirs[kind]), tensor_parallel_size=2, pa_block_size=16) as sharded:
        prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)
        outputs = sharded.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references[kind]


def test_plan_splits_experts_along_their_width() -> None:
    arch = ModelArch.from_hf_config(dummy_hf_config("qwen3-30b-a3b"))
    assert arch.moe is not None and arch.moe.intermediate_size == 768
    assert arch.num_params / 1e9 == pytest.approx(30.5, abs=0.1)
    assert arch.num_active_params / 1e9 == pytest.approx(3.35, abs=0.05)
    plan = ShardPlan.for_arch(arch, rank=1, size=4)
    prefix = "model.layers.3.mlp."
    assert plan.split_of(prefix + "experts.17.gate_proj.weight") == (0, 192, 384)
    assert plan.split_of(prefix + "experts.17.down_proj.weight") == (1, 192, 384)
    assert plan.split_of(prefix + "gate.weight") is None  # the router: every rank routes alike
    local = plan.local_arch()
    assert local.moe is not None and local.moe.intermediate_size == 192
    mixtral = ModelArch.from_hf_config(dummy_hf_config("mixtral-8x7b"))
    mixtral_plan = ShardPlan.for_arch(mixtral, rank=1, size=2)
    moe_prefix = "model.layers.0.block_sparse_moe."
    assert mixtral_plan.split_of(moe_prefix + "experts.7.w3.weight") == (0, 7168, 14336)
    assert mixtral_plan.split_of(moe_prefix + "experts.7.w2.weight") == (1, 7168, 14336)
    # heads and the dense width split ten ways, the experts' 768 does not
    odd = dataclasses.replace(arch, num_heads=10, num_kv_heads=5, intermediate_size=10)
    with pytest.raises(ConfigError, match="expert width 768"):
        ShardPlan.for_arch(odd, 0, 10)


def test_moe_ngram_speculation_keeps_greedy_tokens(tiny_moe_dirs: dict[str, Path]) -> None:
    """Verify chunks (several tokens of one sequence) route through the experts like decodes."""
    model_dir = tiny_moe_dirs["mixtral"]
    runs = random_prompts([6], 320, seed=5)
    prompts = [random_prompts([10], 320, seed=4)[0] + run * 3 for run in runs]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    expected = hf_greedy(model_dir, prompts, 20)
    llm = LLM(str(model_dir), pa_block_size=16, speculative="ngram", num_speculative_tokens=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == expected
    assert llm.engine.stats().num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_on_cuda_with_graphs_matches_transformers(
    kind: str, tiny_moe_dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    """fp32 on the GPU, the Triton MoE kernels, decode steps replayed from CUDA graphs."""
    llm = LLM(str(tiny_moe_dirs[kind]), device="cuda", dtype="float32", pa_block_size=16)
    assert llm.engine.runner.uses_cuda_graphs
    outputs = llm.generate(random_prompts(PROMPT_LENGTHS, 320, seed=1), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references[kind]


def test_fp8_dummy_experts_are_the_float_dummy_quantized() -> None:

    from kernels.moe.moe import quantize_experts_fp8

    float_llm = LLM("dummy:tiny-moe", pa_memory_mb=4)
    fp8_llm = LLM("dummy:tiny-moe", pa_memory_mb=4, quantization="fp8")
    float_block = float_llm.engine.runner.model.layers[0].mlp
    fp8_block = fp8_llm.engine.runner.model.layers[0].mlp
    assert isinstance(float_block, SparseMoeBlock) and isinstance(fp8_block, SparseMoeBlock)
    dense = fp8_llm.engine.runner.model.layers[1].mlp  # mlp_only_layers: a quantized dense MLP
    assert isinstance(dense.down_proj, QuantizedLinear) and dense.down_proj.fmt.name == "fp8"
    weight, scale = quantize_experts_fp8(float_block.w2.weight)
    assert torch.equal(fp8_block.w2.weight.view(torch.uint8), weight.view(torch.uint8))
    assert fp8_block.w2.scale is not None and torch.equal(fp8_block.w2.scale, scale)
    outputs = fp8_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(outputs[0].token_ids) == NUM_NEW_TOKENS


def test_moe_sharded_checkpoint_loads_every_expert(
    tiny_moe_dirs: dict[str, Path], references: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """Experts spread over several safetensors files (an expert's w1 and w3 apart)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dirs["mixtral"], dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 4
    llm = LLM(str(tmp_path), pa_block_size=16)
    prompts = random_prompts(PROMPT_LENGTHS, 320, seed=1)[:2]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == references["mixtral"][:2]


def test_decode_weight_bytes_count_the_experts_a_batch_reads() -> None:
    from bench.latency import decode_weight_bytes

    arch = ModelArch.from_hf_config(dummy_hf_config("qwen3-30b-a3b"))
    total = arch.num_params * 2  # bf16
    one, many = decode_weight_bytes(arch, total, 1), decode_weight_bytes(arch, total, 4096)
    assert one == pytest.approx(arch.num_active_params * 2, rel=1e-6)  # the active weights
    assert one < decode_weight_bytes(arch, total, 8) < many <= total
    assert many == pytest.approx(total, rel=1e-6)  # every expert read
    dense = ModelArch.from_hf_config(dummy_hf_config("qwen3-0.6b"))
    assert decode_weight_bytes(dense, 12345, 1) == 12345
