"""Native Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3.

Tokens of all sequences of a step are packed into one ``[T]`` batch (no padding); attention
finds each sequence's context through ``AttentionMetadata``. q/k/v and gate/up projections
are fused into one matmul each; weights are loaded from HF names into the fused layout.

Under tensor parallelism each rank builds its shard (``ShardPlan``): its heads and MLP
columns, its slice of the vocabulary; o_proj, down_proj and the embedding end in an
all-reduce, and the logits are gathered so that every rank holds the whole row. The layers
themselves are in ``engine.models.layers``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerCache,
    RopeInputs,
)
from engine.distributed.group import PartialSum, TensorParallelGroup
from engine.distributed.shard import ShardPlan
from engine.errors import ModelLoadError
from engine.models.arch import ModelArch
from engine.models.layers import DecoderLayer, RMSNorm
from engine.models.linears import gemv_config
from engine.models.moe import (
    Fp8StackedExperts,
    expert_target,
    rename_moe_weight,
)
from engine.quant.linear import PackedWeight, QuantizedLinear
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq
from kernels.linear.gemv_triton import default_config, gemv


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the embedding; ids outside them give
    zeros, and the all-reduce fills each row in from the rank that holds it."""

    def __init__(
        self, num_rows: int, hidden_size: int, start: int, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.group.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class LlamaForCausalLM(nn.Module):
    """One class for the whole family; ``ModelArch`` switches biases, q/k norm, windows.

    ``arch`` is the whole model's shape; ``self.arch`` is this rank's (its heads and MLP
    width under tensor parallelism, the whole vocabulary).
    """

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        plan: ShardPlan | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan or ShardPlan(arch)
        self.group = group or TensorParallelGroup()
        self.attention_backend = backend
        self.arch = local = self.plan.local_arch()
        vocab_rows = self.plan.vocab_per_rank
        self.embed_tokens = VocabParallelEmbedding(
            vocab_rows, arch.hidden_size, self.plan.vocab_start, self.group
        )
        self.layers = nn.ModuleList(
            DecoderLayer(local, index, backend, self.group) for index in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend.ops)
        self.lm_head = nn.Linear(arch.hidden_size, vocab_rows, bias=False)
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        """float32 cos/sin tables for positions ``[0, max_positions)`` (kept out of ``.to()``)."""
        inv_freq = rope_inv_freq(self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)
        cos, sin = rope_cos_sin_cache(inv_freq, max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def rope_inputs(self, positions: torch.Tensor) -> RopeInputs:  # positions [T]
        return RopeInputs(positions, self.rope_cos, self.rope_sin)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x: torch.Tensor | PartialSum = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        rope = self.rope_inputs(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        assert residual is not None
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [N, hidden] -> [N, V]
        if self.group.size == 1:
            return self._local_logits(hidden, out)
        # every rank gets the whole row: the gather is one collective all ranks take part in
        return self.group.gather_vocab(self._local_logits(hidden), self.arch.vocab_size, out)

    def _local_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [N, hidden] -> [N, this rank's vocabulary rows]
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head(hidden, out=out)
        weight = self.lm_head.weight
        # batch-1 decode: the LM head is the largest single read of the step, and the GEMV
        # streams it at the bandwidth limit where cuBLAS reached 0.93 of it (H100, bf16); on
        # GPUs where the table measured cuBLAS faster (None), cuBLAS
        config = gemv_config(hidden, self.lm_head, False, default_config(*weight.shape))
        if config is not None:
            return gemv(hidden, weight, out=out, config=config)
        if out is None:
            return self.lm_head(hidden)
        # into a caller's buffer (a CUDA graph's one static logits tensor); lm_head has no bias
        return torch.mm(hidden, weight.t(), out=out)

    # -- weights ------------------------------------------------------------------------------

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """Copy HF-named tensors into the fused layout; every weight must be covered.

        A quantized linear takes packed rows as they are, and float rows quantized on the way.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        quantized = self._quantized_weights()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = self._fused_target(hf_name)
            if target is None:
                continue
            name, rows = target
            if name in quantized:
                module = quantized[name]
                start, end = rows if rows is not None else (0, module.out_features)
                module.load_rows(start, end, tensor)
            elif isinstance(tensor, PackedWeight) or name not in params:
                raise ModelLoadError(f"weight {hf_name!r} has no place in {self.arch.architecture}")
            else:
                _copy_rows(hf_name, params[name].data, rows, tensor)
            loaded.add(name if rows is None else f"{name}[{rows[0]}:{rows[1]}]")
        self._check_all_loaded(loaded)

    def _quantized_weights(self) -> dict[str, QuantizedLinear | Fp8StackedExperts]:
        """``<module>.weight`` -> its quantized module (the weight is no parameter there)."""
        return {
            f"{name}.weight": module
            for name, module in self.named_modules()
            if isinstance(module, QuantizedLinear | Fp8StackedExperts)
        }

    def _fused_target(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """HF name -> (parameter name, row range inside a fused parameter or None)."""
        if "rotary_emb" in hf_name:
            return None
        name = rename_moe_weight(hf_name.removeprefix("model."))
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return None
        arch = self.arch
        expert = expert_target(name, arch)
        if expert is not None:
            return expert
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        shared = arch.moe.shared_intermediate_size if arch.moe is not None else 0
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size, q_size + kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, q_size + 2 * kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, arch.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", arch.intermediate_size, 2 * arch.intermediate_size),
            "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0, shared),
            "shared_expert.up_proj": ("shared_expert.gate_up_proj", shared, 2 * shared),
        }
        for part, (whole, start, end) in fused.items():
            if f".{part}." in name:
                return name.replace(part, whole), (start, end)
        return name, None

    def _check_all_loaded(self, loaded: set[str]) -> None:
        expected = {name: _num_rows(param) for name, param in self.named_parameters()}
        expected |= {name: m.out_features for name, m in self._quantized_weights().items()}
        missing = []
        for name, num_rows in expected.items():
            if name in loaded or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
                continue
            rows = sum(_row_count(key) for key in loaded if key.startswith(name + "["))
            if rows != num_rows:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} weights: {shown}")


def _copy_rows(
    hf_name: str, param: torch.Tensor, rows: tuple[int, int] | None, tensor: torch.Tensor
) -> None:
    if param.dim() == 3:  # stacked experts: rows of the [E * rows, cols] view (expert_target)
        param = param.flatten(0, 1)
    dest = param if rows is None else param[rows[0] : rows[1]]
    if dest.shape != tensor.shape:
        raise ModelLoadError(
            f"weight {hf_name!r}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def _num_rows(param: torch.Tensor) -> int:
    """Rows a checkpoint fills: a stacked experts' parameter counts each expert's."""
    return param.shape[0] * param.shape[1] if param.dim() == 3 else param.shape[0]


def _row_count(key: str) -> int:
    start, end = key[key.index("[") + 1 : -1].split(":")
    return int(end) - int(start)
