"""Mixtures of experts from GGUF: Qwen3-MoE, Qwen2-MoE and Mixtral (llama with experts).

Each tiny random MoE model of tests/conftest.py is written as llama.cpp lays it out (stacked
``ffn_*_exps`` experts, the router as ``ffn_gate_inp``, Qwen2-MoE's ``*_shexp`` shared expert,
Mixtral's q/k rows permuted for llama.cpp's rotary), then loaded from the ``.gguf``: the
engine's greedy tokens must equal transformers' on the original weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.loader.gguf import SHARD_BYTES, WEIGHTS_INDEX_NAME, convert_gguf
from engine.models.moe import SparseMoeBlock
from engine.quant.linear import QuantizedLinear
from tests.conftest import hf_greedy, random_prompts
from tests.test_gguf import llama_cpp_permute, write_tiny_tokenizer

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
PROMPTS = random_prompts([6, 29], 320, seed=3)
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0

# HF name after "model.layers.N." -> llama.cpp's role in blk.N (experts and routers below)
LAYER_ROLES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
EXPERT_ROLES = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}  # fmt: skip


def hf_state(model_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by their Hub names (per-expert), as float32 arrays."""
    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            state |= {name: file.get_tensor(name).float().numpy() for name in file.keys()}  # noqa: SIM118 (not a dict)
    return state


def gguf_tensors(kind: str, config: Any, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of the HF ``state``: experts stacked [E, rows, cols] per layer."""
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}  # fmt: skip
    if "lm_head.weight" in state:
        tensors["output.weight"] = state["lm_head.weight"]
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in state.items():
        if not name.startswith("model.layers."):
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, suffix = rest.rsplit(".", 1)
        if ".experts." in module:  # mlp.experts.3.up_proj / block_sparse_moe.experts.3.w3
            expert, part = module.split(".experts.")[1].split(".")
            experts.setdefault(f"blk.{layer}.{EXPERT_ROLES[part]}.{suffix}", {})[int(expert)] = (
                value
            )
            continue
        if kind == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in module else config.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        tensors[f"blk.{layer}.{LAYER_ROLES[module]}.{suffix}"] = value
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def assert_same_weights(converted: Path, original: Path) -> None:
    expected, actual = hf_state(original), hf_state(converted)
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if not np.array_equal(expected[name], actual[name])] == []


def write_moe_gguf(kind: str, model_dir: Path, path: Path, expert_type: Any = F32,
                   linear_type: Any = F32) -> Path:  # fmt: skip
    """The tiny model of ``model_dir`` as a GGUF: experts in ``expert_type``, the attention
    linears in ``linear_type``, everything else F32."""
    config = AutoConfig.from_pretrained(model_dir)
    arch = GGUF_ARCH[kind]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(config.norm_topk_prob)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    write_tiny_tokenizer(writer)
    for name, value in gguf_tensors(kind, config, hf_state(model_dir)).items():
        role = name.split(".")[-2]
        qtype = expert_type if role.endswith("_exps") else F32
        if role in ("attn_q", "attn_k", "attn_v", "attn_output") and name.endswith(".weight"):
            qtype = linear_type
        if qtype == F32:
            writer.add_tensor(name, value.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_moe_gguf_gives_transformers_tokens_on_the_original_weights(
    kind: str, tiny_moe_dirs: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    path = write_moe_gguf(kind, tiny_moe_dirs[kind], tmp_path / f"{kind}.gguf")
    llm = LLM(str(path), pa_block_size=16)
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.runner.model.layers)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_moe_dirs[kind], PROMPTS,
                                                            NUM_NEW_TOKENS)  # fmt: skip
    # the converted checkpoint holds the original weights, by their Hub names
    (converted,) = cache.iterdir()
    assert_same_weights(converted, tiny_moe_dirs[kind])
    config = json.loads((converted / "config.json").read_text())
    original = json.loads((tiny_moe_dirs[kind] / "config.json").read_text())
    assert config["architectures"] == original["architectures"]
    if kind == "qwen3_moe":  # its second layer is dense: a layer without a router
        assert config["mlp_only_layers"] == original["mlp_only_layers"] == [1]


def test_q8_0_experts_are_dequantized_to_bfloat16_and_serve_like_transformers(
    tiny_moe_dirs: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    """Block-quantized experts: each expert's weight is the dequantized stack's slice in
    bfloat16; the attention stays packed under --quantization gguf (on the CPU, dequantized
    per matmul), and the engine gives transformers' tokens on the converted checkpoint."""
    kind = "qwen3_moe"
    path = write_moe_gguf(kind, tiny_moe_dirs[kind], tmp_path / "q8.gguf", Q8_0, Q8_0)
    converted = convert_gguf(path, cache)
    reader = gguf.GGUFReader(path)
    stack = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    expected = gguf.dequantize(stack.data, stack.tensor_type).reshape(8, 32, 64)
    with safe_open(str(converted / "model.safetensors"), "pt") as file:
        expert = file.get_tensor("model.layers.0.mlp.experts.5.up_proj.weight")
        router = file.get_tensor("model.layers.0.mlp.gate.weight")
    assert expert.dtype == torch.bfloat16 and router.dtype == torch.float32
    assert torch.equal(expert, torch.from_numpy(expected[5]).to(torch.bfloat16))
    llm = LLM(str(path), quantization="gguf", pa_block_size=16)
    attention = llm.engine.runner.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, QuantizedLinear) and attention.qkv_proj.fmt.name == "q8_0"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == hf_greedy(converted, PROMPTS, NUM_NEW_TOKENS)


def test_a_large_conversion_is_written_in_shards_with_an_index(
    tiny_moe_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.loader.gguf as gguf_loader

    path = write_moe_gguf("mixtral", tiny_moe_dirs["mixtral"], tmp_path / "mixtral.gguf")
    monkeypatch.setattr(gguf_loader, "SHARD_BYTES", 64 * 1024)
    assert SHARD_BYTES > 64 * 1024
    converted = convert_gguf(path, tmp_path / "cache")
    files = sorted(converted.glob("*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((converted / WEIGHTS_INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert_same_weights(converted, tiny_moe_dirs["mixtral"])


def test_refusals_name_what_is_not_supported(tmp_path: Path) -> None:
    def write(name: str, tensor: str, arch: str = "qwen3moe", **keys: Any) -> Path:
        """Two layers of 4 experts, with the one ``tensor``."""
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), arch=arch)
        writer.add_block_count(2)
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)
        for key, value in keys.items():
            getattr(writer, f"add_{key}")(value)
        writer.add_tensor(tensor, np.zeros((4, 32), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    router = "blk.0.ffn_gate_inp.weight"
    with pytest.raises(UnsupportedModelError, match=r"one tensor per expert.*current llama\.cpp"):
        convert_gguf(write("old", "blk.0.ffn_gate.0.weight"), tmp_path / "cache")
    sigmoid = gguf.ExpertGatingFuncType.SIGMOID
    with pytest.raises(UnsupportedModelError, match=r"gating function 2; only softmax"):
        convert_gguf(write("sigmoid", router, expert_gating_func=sigmoid), tmp_path / "cache")
    with pytest.raises(
        UnsupportedModelError, match=r"Mixtral routes every layer.*dense layers \[1\]"
    ):
        convert_gguf(write("mixtral", router, arch="llama"), tmp_path / "cache")


def test_fp8_experts_from_a_gguf_keep_its_blocks_packed(
    tiny_moe_dirs: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    """--quantization fp8 on a MoE GGUF: its experts (float from the conversion) in fp8 and
    its block linears packed as they are, never quantized twice. The experts lie on their
    per-row e4m3 grid already, so the engine must give transformers' tokens."""
    from transformers import AutoModelForCausalLM

    from engine.models.moe import Fp8StackedExperts
    from kernels.linear.quant import FORMATS, quantize

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dirs["qwen3_moe"], dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                planes = quantize(param.reshape(-1, param.shape[-1]), FORMATS["fp8"])
                param.copy_((planes["w"].float() * planes["scale"]).view(param.shape))
    model.save_pretrained(tmp_path / "on-grid")
    path = write_moe_gguf("qwen3_moe", tmp_path / "on-grid", tmp_path / "fp8.gguf", F32, Q8_0)
    llm = LLM(str(path), quantization="fp8", pa_block_size=16)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
    assert layer.self_attn.qkv_proj.fmt.name == "q8_0"
    assert isinstance(layer.mlp, SparseMoeBlock) and isinstance(layer.mlp.w13, Fp8StackedExperts)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    (converted,) = cache.iterdir()
    assert [out.token_ids for out in outputs] == hf_greedy(converted, PROMPTS, NUM_NEW_TOKENS)


def test_a_moe_gguf_over_two_ranks_gives_transformers_tokens(
    tiny_moe_dirs: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    """Tensor parallelism takes the converted float weights (q8_0 attention dequantized),
    each rank its slice of every expert."""
    path = write_moe_gguf("mixtral", tiny_moe_dirs["mixtral"], tmp_path / "mixtral.gguf", F32, Q8_0)
    with LLM(str(path), tensor_parallel_size=2, pa_block_size=16) as sharded:
        outputs = sharded.generate(PROMPTS, GREEDY, use_tqdm=False)
    (converted,) = cache.iterdir()
    assert [out.token_ids for out in outputs] == hf_greedy(converted, PROMPTS, NUM_NEW_TOKENS)


@pytest.mark.gpu
def test_a_moe_gguf_served_on_the_gpu_with_packed_attention(
    tiny_moe_dirs: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    """On CUDA, auto keeps the q8_0 attention packed and serves the bfloat16 experts through
    the fused MoE kernels and CUDA graphs: the logits stay those of the float attention."""
    path = str(write_moe_gguf("qwen3_moe", tiny_moe_dirs["qwen3_moe"], tmp_path / "q8.gguf",
                              Q8_0, Q8_0))  # fmt: skip
    settings = dict(device="cuda", max_seqs=16, max_model_len=128, pa_memory_mb=256)
    tokens = list(range(1, 25))
    float_llm = LLM(path, quantization="none", **settings)
    expected = float_llm.engine.runner.teacher_forced_logits(tokens).cpu()
    del float_llm
    packed = LLM(path, **settings)
    assert isinstance(packed.engine.runner.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    got = packed.engine.runner.teacher_forced_logits(tokens).cpu()
    assert ((got - expected).abs().mean() / expected.std(dim=-1).mean()).item() < 0.05
    outputs = packed.generate([tokens[:5], tokens[5:12]], GREEDY, use_tqdm=False)
    assert all(len(out.token_ids) == NUM_NEW_TOKENS for out in outputs)
