"""``ModelArch``: the shape of a Llama-family decoder, read from a Hugging Face config.

Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) are the same decoder with a router and
experts in place of some or all dense MLPs: their shape is ``ModelArch.moe`` (``MoeArch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError

# HF architecture name -> (family, qkv bias always on, q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeArch:
    """The experts of a mixture-of-experts model."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP width
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; Qwen norm_topk_prob)
    sparse_layers: frozenset[int]  # layers whose MLP is the experts (the rest stay dense)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (gated); 0: none

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index in self.sparse_layers


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    moe: MoeArch | None = None  # None: every MLP dense

    @property
    def num_q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        return self._count_params(active_only=False)

    @property
    def num_active_params(self) -> int:
        """Parameters a token reads: its ``top_k`` experts of each MoE layer, not all."""
        return self._count_params(active_only=True)

    def _count_params(self, active_only: bool) -> int:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        mlps = sum(self._mlp_params(index, active_only) for index in range(self.num_layers))
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * attn + mlps + norms + embed

    def _mlp_params(self, layer_index: int, active_only: bool) -> int:
        moe = self.moe
        if moe is None or not moe.is_sparse(layer_index):
            return 3 * self.hidden_size * self.intermediate_size
        experts = moe.top_k if active_only else moe.num_experts
        shared = 3 * moe.shared_intermediate_size + (1 if moe.shared_intermediate_size else 0)
        routed = experts * 3 * moe.intermediate_size + moe.num_experts  # + the router
        return self.hidden_size * (routed + shared)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {architecture!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        family, qkv_bias_always, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
        _check_activation(config, family)
        num_heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2-MoE's config says whether q, k and v have biases (dense Qwen2's always do)
        qkv_bias = bool(getattr(config, "qkv_bias", qkv_bias_always))
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=_rope_theta(config),
            rope_scaling=_rope_scaling(config),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=_sliding_window(config, family),
            moe=_moe_arch(config, family),
        )


def _moe_arch(config: Any, family: str) -> MoeArch | None:
    if family not in MOE_FAMILIES:
        return None
    num_layers = config.num_hidden_layers
    if family == "mixtral":  # every layer sparse; intermediate_size is each expert's width
        num_experts = config.num_local_experts
        return MoeArch(num_experts, config.num_experts_per_tok, config.intermediate_size,
                       True, frozenset(range(num_layers)))  # fmt: skip
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    sparse = frozenset(
        index
        for index in range(num_layers)
        if index not in dense and num_experts > 0 and (index + 1) % step == 0
    )
    shared = getattr(config, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return MoeArch(
        num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
        bool(getattr(config, "norm_topk_prob", False)), sparse, int(shared or 0),
    )  # fmt: skip


def _rope_params(config: Any) -> dict[str, Any]:
    # transformers >= 5 folds theta and scaling into `rope_parameters`; 4.x keeps them apart.
    params = getattr(config, "rope_parameters", None)
    return dict(params) if isinstance(params, dict) else {}


def _rope_theta(config: Any) -> float:
    theta = _rope_params(config).get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _rope_scaling(config: Any) -> dict[str, Any] | None:
    params = _rope_params(config) or dict(getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    return {**params, "rope_type": rope_type}


SILU_ACTIVATIONS = ("silu", "swish")  # one function, two names in HF configs


def _check_activation(config: Any, family: str) -> None:
    """The MLPs and experts compute SiLU (gated): a model made with another activation would
    load and answer wrongly, so it is refused."""
    activation = getattr(config, "hidden_act", "silu")
    if activation not in SILU_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{family} with hidden_act={activation!r} is not supported: the MLPs compute SiLU "
            "(hidden_act silu or swish)"
        )


def _sliding_window(config: Any, family: str) -> int | None:
    """The attention window of every layer, or None. Qwen's configs window the layers from
    ``max_window_layers`` on (``layer_types`` says which): none or all of them is one rule for
    the model, some of them is refused."""
    window = getattr(config, "sliding_window", None)
    if family in ("mistral", "mixtral"):
        return int(window) if window else None
    if not (window and getattr(config, "use_sliding_window", False)):
        return None
    first_windowed = getattr(config, "max_window_layers", 0)
    layer_types = getattr(config, "layer_types", None) or [
        "sliding_attention" if layer >= first_windowed else "full_attention"
        for layer in range(config.num_hidden_layers)
    ]
    if set(layer_types) == {"full_attention"}:
        return None
    if set(layer_types) == {"sliding_attention"}:
        return int(window)
    raise UnsupportedModelError(
        f"{family} with sliding windows on some layers only (use_sliding_window with "
        f"max_window_layers={first_windowed}) is not supported"
    )
