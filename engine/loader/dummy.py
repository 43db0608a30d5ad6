"""``dummy:<shape>``: random weights of named real model shapes, for tests and benchmarks."""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.models.moe import Fp8StackedExperts
from engine.quant.linear import QuantizedLinear

# HF config fields of each shape; architecture chooses the transformers config class.
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    "qwen2.5-32b": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=5120, intermediate_size=27648,
        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None,
    ),
    # mixtures of experts
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=10000.0,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None,
    ),
}  # fmt: skip

DUMMY_PREFIX = "dummy:"
DUMMY_INIT_STD = 0.02


def dummy_hf_config(shape: str) -> Any:
    """A transformers config object for ``shape``."""
    import transformers

    if shape not in DUMMY_SHAPES:
        raise ModelLoadError(
            f"unknown dummy shape {shape!r}; known: {', '.join(sorted(DUMMY_SHAPES))}"
        )
    fields = dict(DUMMY_SHAPES[shape])
    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    }[fields["architectures"][0]]
    return config_class(**fields)


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Norm weights 1, biases 0, everything else N(0, 0.02), reproducible from ``seed``.

    A quantized linear draws its float weight where the float model draws it (same order,
    dtype and shape), then quantizes it: a quantized dummy is the float dummy, quantized.
    """
    generators: dict[torch.device, torch.Generator] = {}

    def normal_(tensor: torch.Tensor) -> None:
        if tensor.device not in generators:
            generators[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
        tensor.normal_(0.0, DUMMY_INIT_STD, generator=generators[tensor.device])

    float_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if isinstance(module, QuantizedLinear | Fp8StackedExperts):
                weight = torch.empty(module.out_features, module.in_features,
                                     dtype=float_dtype, device=module.device)  # fmt: skip
                normal_(weight)
                module.load_rows(0, module.out_features, weight)
            for name, param in module.named_parameters(recurse=False):
                full_name = f"{module_name}.{name}" if module_name else name
                if full_name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name == "bias":
                    param.zero_()
                else:
                    normal_(param)
