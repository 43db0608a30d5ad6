"""A GGUF file's metadata as a Hugging Face config: architecture, sizes, rope scaling
(llama 3.x's frequency factors folded back into ``rope_scaling``), and a mixture of experts'
routing (Qwen3-MoE, Qwen2-MoE, and Mixtral, which llama.cpp writes as ``llama`` with experts)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGUFReader

from engine.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# general.architecture -> (transformers config class, model class)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")  # a llama file with experts
# Whether llama.cpp's graph for the architecture divides the chosen experts' weights by their
# sum (its norm_w; HF's norm_topk_prob), where the file has no expert_weights_norm to say.
RENORMALISED_TOP_K = {"llama": True, "qwen3moe": True, "qwen2moe": False}
SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
# Files from before llama.cpp stacked the experts (2024-04) hold one tensor per expert.
PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
ROPE_FREQS_TENSOR_NAME = "rope_freqs.weight"  # llama 3.x rope scaling, folded into config.json


def metadata_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required_field(reader: GGUFReader, key: str) -> Any:
    value = metadata_field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata key {key!r} is missing; the file may be truncated")
    return value


def architecture_of(reader: GGUFReader) -> str:
    arch = str(required_field(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported architectures: {supported}"
        )
    _check_experts(reader, arch)
    return arch


def _check_experts(reader: GGUFReader, arch: str) -> None:
    """Refuse, before any conversion, experts this loader cannot lay out as HF's."""
    if not num_experts_of(reader, arch):
        return
    names = (tensor.name for tensor in reader.tensors)
    if old := next((name for name in names if PER_EXPERT_TENSOR.fullmatch(name)), None):
        raise UnsupportedModelError(
            f"GGUF tensor {old!r}: one tensor per expert, as llama.cpp wrote before it "
            "stacked them (2024-04); convert the model again with a current llama.cpp"
        )
    gating = metadata_field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, SOFTMAX_GATING):
        raise UnsupportedModelError(
            f"GGUF {arch!r} routes its experts with gating function {gating}; only softmax "
            f"({SOFTMAX_GATING}) is supported"
        )


def num_experts_of(reader: GGUFReader, arch: str) -> int:
    """The experts of each sparse layer (0: a dense model)."""
    return int(metadata_field(reader, f"{arch}.expert_count", 0) or 0)


def is_mixtral(reader: GGUFReader, arch: str) -> bool:
    return arch == "llama" and num_experts_of(reader, arch) > 0


def build_config(reader: GGUFReader, arch: str) -> PretrainedConfig:
    import transformers  # deferred: a cache hit should not pay for importing transformers

    classes = MIXTRAL if is_mixtral(reader, arch) else SUPPORTED_ARCHITECTURES[arch]
    config_class_name, model_class_name = classes
    config_class = getattr(transformers, config_class_name)
    moe = _moe_kwargs(reader, arch)  # first: a refusal names the experts, not a missing size
    kwargs = _config_kwargs(reader, arch) | moe
    return config_class(architectures=[model_class_name], dtype="float32", **kwargs)


def _moe_kwargs(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """The routing of a mixture of experts, as transformers' config names it: experts, how many
    a token takes, each one's width, whether their weights are renormalised, and which layers
    are dense (those without a router)."""
    num_experts = num_experts_of(reader, arch)
    if not num_experts:
        return {}
    names = {tensor.name for tensor in reader.tensors}
    renormalise = bool(
        metadata_field(reader, f"{arch}.expert_weights_norm", RENORMALISED_TOP_K[arch])
    )
    num_layers = int(required_field(reader, f"{arch}.block_count"))
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    used = int(required_field(reader, f"{arch}.expert_used_count"))
    if arch == "llama":  # Mixtral: every layer sparse, experts feed_forward_length wide
        if dense or not renormalise:
            raise UnsupportedModelError(
                f"GGUF llama with {num_experts} experts: Mixtral routes every layer and "
                "renormalises the chosen experts' weights; this file "
                + (f"has dense layers {dense}" if dense else "does not renormalise")
            )
        return {"num_local_experts": num_experts, "num_experts_per_tok": used,
                "sliding_window": None}  # fmt: skip
    kwargs: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": required_field(reader, f"{arch}.expert_feed_forward_length"),
        "norm_topk_prob": renormalise,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
    if arch == "qwen2moe":
        kwargs["shared_expert_intermediate_size"] = required_field(
            reader, f"{arch}.expert_shared_feed_forward_length"
        )
    return kwargs


def _config_kwargs(reader: GGUFReader, arch: str) -> dict[str, Any]:
    tensor_names = {tensor.name for tensor in reader.tensors}
    kwargs: dict[str, Any] = {
        "vocab_size": _vocab_size(reader),
        "hidden_size": required_field(reader, f"{arch}.embedding_length"),
        "num_hidden_layers": required_field(reader, f"{arch}.block_count"),
        "intermediate_size": required_field(reader, f"{arch}.feed_forward_length"),
        "num_attention_heads": required_field(reader, f"{arch}.attention.head_count"),
        "num_key_value_heads": num_kv_heads(reader, arch),
        "rms_norm_eps": required_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": metadata_field(reader, f"{arch}.rope.freq_base", 10_000.0),
        "max_position_embeddings": required_field(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # o_proj's bias: HF's attention_bias (qwen2 has q/k/v biases without it)
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
        "bos_token_id": metadata_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata_field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata_field(reader, "tokenizer.ggml.padding_token_id"),
    }
    # all three architectures rotate the full head, so the rotary width is the head size too
    head_dim = metadata_field(reader, f"{arch}.attention.key_length") or metadata_field(
        reader, f"{arch}.rope.dimension_count"
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    rope_scaling = _rope_scaling(reader, arch, kwargs)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return kwargs


def _vocab_size(reader: GGUFReader) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF dims are reversed: [hidden, vocab]
    return len(required_field(reader, "tokenizer.ggml.tokens"))


def num_kv_heads(reader: GGUFReader, arch: str) -> int:
    num_heads = required_field(reader, f"{arch}.attention.head_count")
    return int(metadata_field(reader, f"{arch}.attention.head_count_kv", num_heads))


def _rope_scaling(reader: GGUFReader, arch: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from GGUF metadata, or from llama 3's ``rope_freqs`` tensor."""
    kind = metadata_field(reader, f"{arch}.rope.scaling.type")
    factor = metadata_field(reader, f"{arch}.rope.scaling.factor") or metadata_field(
        reader, f"{arch}.rope.scale_linear"
    )
    if kind in ("linear", "yarn") and factor is None:
        raise ModelLoadError(f"GGUF rope scaling type {kind!r} has no {arch}.rope.scaling.factor")
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original_length = metadata_field(reader, f"{arch}.rope.scaling.original_context_length")
        if original_length is not None:
            scaling["original_max_position_embeddings"] = original_length
        return scaling
    if kind == "linear" or (kind is None and factor not in (None, 1.0)):
        return {"rope_type": "linear", "factor": factor}
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported")
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR_NAME), None)
    if rope_freqs is None:
        return None
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return llama3_rope_scaling(np.asarray(rope_freqs.data), kwargs["rope_theta"], head_dim)


def llama3_rope_scaling(rope_freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's per-frequency factor tensor.

    llama.cpp bakes the scaling into ``rope_freqs``; every llama 3.x release uses the
    parameters below except ``factor``, which is the largest entry. Anything else is refused
    rather than silently approximated.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(rope_freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_rope_factors(scaling, rope_theta, head_dim), rope_freqs, rtol=1e-4):
        raise UnsupportedModelError(
            f"the GGUF's {ROPE_FREQS_TENSOR_NAME} tensor does not match llama 3 rope scaling"
        )
    return scaling


def _llama3_rope_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    # same recipe as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelens = 2 * math.pi / freqs
    old_length = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (old_length / wavelens - low) / (high - low)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelens < old_length / high, 1.0, factors)
    return np.where(wavelens > old_length / low, factor, factors)


# -- tensors
