"""Native Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3.

Tokens of all sequences of a step are packed into one ``[T]`` batch (no padding); attention
finds each sequence's context through ``AttentionMetadata``. q/k/v and gate/up projections
are fused into one matmul each; weights are loaded from HF names into the fused layout.

Under tensor parallelism each rank builds its shard (``ShardPlan``): its heads and MLP
columns, its slice of the vocabulary; o_proj, down_proj and the embedding end in an
all-reduce, and the logits are gathered so that every rank holds the whole row. Where o_proj's
and down's sums can run in one kernel with the residual add and RMSNorm after them, the layer
hands the norm this rank's share unsummed (``PartialSum``), and the norm sums it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    HeadNorms,
    LayerCache,
    LayerOps,
    RopeInputs,
)
from engine.distributed.group import PartialSum, TensorParallelGroup, summed
from engine.distributed.shard import ShardPlan
from engine.errors import ModelLoadError
from engine.models.arch import ModelArch
from engine.models.moe import (
    Fp8StackedExperts,
    SparseMoeBlock,
    expert_target,
    rename_moe_weight,
)
from engine.quant.linear import PackedWeight, QuantizedLinear
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq
from kernels.linear.gemv_triton import GemvConfig, default_config, gemv
from kernels.linear.gemv_tuning import tuned_config
from kernels.linear.int8_rows_triton import Int8Rows

GEMV_MAX_ROWS = 1  # rows that take the Triton GEMV instead of cuBLAS (measured at one)
GEMV_DTYPES = (torch.bfloat16, torch.float16)
# o_proj's and down's GEMV launch shape (the LM head keeps gemv's default). H100, llama3-8b,
# one row, weights not in L2: o_proj 13.9-14.8 us against cuBLAS's 16.0, down 42.3 against
# 44.4 (and the activation kernel folds into it); the batch-1 decode step 6.26 -> 6.10 ms.
LAYER_GEMV_CONFIG = GemvConfig(block_n=8, block_k=1024)


def takes_gemv(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether ``linear(x)`` streams through the GEMV: a decode row (at most GEMV_MAX_ROWS)
    in bf16/fp16 on CUDA, and a plain linear without bias (quantized ones have their own)."""
    return (
        x.is_cuda
        and x.shape[0] <= GEMV_MAX_ROWS
        and isinstance(linear, nn.Linear)
        and linear.bias is None
        and linear.weight.dtype in GEMV_DTYPES
    )


def gemv_config(
    x: torch.Tensor | Int8Rows, linear: nn.Module, silu_mul: bool, default: GemvConfig | None
) -> GemvConfig | None:
    """The GEMV launch shape that runs ``linear(x)`` (``silu_mul``: x is a gate_up row),
    or None for cuBLAS: where ``x`` takes the GEMV at all, the tuned table's choice for this
    GPU and shape (``bench.gemv --install``), else ``default``."""
    if not (isinstance(x, torch.Tensor) and takes_gemv(x, linear)):
        return None
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return tuned_config(weight, x.shape[0], silu_mul, default)


def input_linear(x: torch.Tensor | Int8Rows, linear: nn.Module) -> torch.Tensor:
    """``linear(x)`` for qkv and gate_up: cuBLAS, or the GEMV where ``bench.gemv --install``
    measured a launch shape of it faster than cuBLAS on this GPU (one rank's shard of a
    tensor-parallel layer is a narrower matrix, which cuBLAS streams less well)."""
    config = gemv_config(x, linear, False, None)
    if config is not None:
        assert isinstance(x, torch.Tensor) and isinstance(linear.weight, torch.Tensor)
        return gemv(x, linear.weight, config=config)
    result: torch.Tensor = linear(x)
    return result


def takes_int8_rows(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether the kernel producing ``linear``'s input ``x`` should round it to int8 blocks
    itself (where its kernel family has an int8 variant): a quantized linear that multiplies
    these rows by an int8 kernel, which would otherwise launch a rounding kernel of its own
    (the int8 GEMV: q4_0/q4_1 at 1-4 rows, q8_0 at 2-7; int8 tensor cores: q8_0 at 8-32)."""
    return isinstance(linear, QuantizedLinear) and linear.takes_int8_rows(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self,
        x: torch.Tensor | PartialSum,  # [T, hidden]; a PartialSum is summed in the same kernel
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, PartialSum):
            return x.add_rms_norm(residual, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def norm_for(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor | Int8Rows:
        """``forward(x)``, rounded to int8 blocks where ``linear`` takes them."""
        rounding = self.ops.rms_norm_int8
        if rounding is not None and takes_int8_rows(x, linear):
            return rounding(x, self.weight, self.eps)
        return self.forward(x)

    def add_and_norm_for(
        self, x: torch.Tensor | PartialSum, residual: torch.Tensor, linear: nn.Module
    ) -> tuple[torch.Tensor | Int8Rows, torch.Tensor]:
        """``add_and_norm``, the normed rows rounded to int8 blocks where ``linear`` takes them
        (after a sum of its own: the fused sum has no int8 variant)."""
        rounding = self.ops.fused_add_rms_norm_int8
        rows = x.local if isinstance(x, PartialSum) else x
        if rounding is not None and takes_int8_rows(rows, linear):
            return rounding(summed(x), residual, self.weight, self.eps)
        return self.add_and_norm(x, residual)


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,  # this rank's shape: its heads
        layer_index: int,
        backend: AttentionBackend,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.group = group
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, arch.o_bias)
        # Qwen3's per-head norms: their weights load as any module's; attention applies them
        # with rotary (``head_norms``), in the Triton backend's one kernel with the KV write
        ops = backend.ops
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5
        self.sliding_window = arch.sliding_window
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeInputs,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor | PartialSum:
        q, k, v = self.project(x)
        return self.output(self.attend(q, k, v, rope, kv_cache, meta).flatten(1))

    def output(self, attn: torch.Tensor) -> torch.Tensor | PartialSum:  # [T, Hq * D] -> [T, H]
        """o_proj, summed over the ranks' heads (or left for the norm after it to sum)."""
        config = gemv_config(attn, self.o_proj, False, LAYER_GEMV_CONFIG)
        if config is not None:  # None: cuBLAS (more rows, or measured faster on this GPU)
            return self.group.all_reduce_for_norm(gemv(attn, self.o_proj.weight, config=config))
        return self.group.all_reduce_for_norm(self.o_proj(attn))

    def project(
        self,
        x: torch.Tensor | Int8Rows,  # [T, hidden]: rounded where qkv_proj takes int8 rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        """The new tokens' queries, keys and values, not yet normed (Qwen3) nor rotated:
        attention does both to q and k, fused with the KV write (one kernel launch where the
        two norms, rotary and the write were four)."""
        num_tokens = x.shape[0]
        q, k, v = input_linear(x, self.qkv_proj).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def head_norms(self) -> HeadNorms | None:
        """Qwen3's q_norm and k_norm, for attention to apply before rotary; None without."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeInputs,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, Hq, D]
    ) -> torch.Tensor:  # [T, Hq, D]
        """Norm (Qwen3) and rotate q and k, store the new K/V in the pages, attend each query
        over its context."""
        return self.backend.forward(
            q, k, v, rope, kv_cache, meta, self.scale, self.sliding_window,
            head_norms=self.head_norms(), out=out,
        )  # fmt: skip


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, ops: LayerOps, group: TensorParallelGroup) -> None:
        super().__init__()
        self.ops = ops
        self.group = group
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias)

    @property
    def input_linear(self) -> nn.Module:
        """The first linear to read the MLP's input (the norm rounds for it where it takes
        int8 rows)."""
        return self.gate_up_proj

    def forward(
        self,
        x: torch.Tensor | Int8Rows,  # [T, hidden]: rounded where gate_up_proj takes int8 rows
    ) -> torch.Tensor | PartialSum:  # [T, hidden], summed over the ranks or left to the norm
        gate_up = input_linear(x, self.gate_up_proj)
        rounding = self.ops.silu_and_mul_int8
        config = gemv_config(gate_up, self.down_proj, True, LAYER_GEMV_CONFIG)
        if config is not None:  # the activation in the GEMV's prologue
            down = gemv(gate_up, self.down_proj.weight, silu_mul=True, config=config)
        elif rounding is not None and takes_int8_rows(gate_up, self.down_proj):
            down = self.down_proj(rounding(gate_up))  # the activation rounds for the int8 kernel
        else:
            down = self.down_proj(self.ops.silu_and_mul(gate_up))
        return self.group.all_reduce_for_norm(down)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_index: int,
        backend: AttentionBackend,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        ops = backend.ops
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, layer_index, backend, group)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp: MLP | SparseMoeBlock
        if arch.moe is not None and arch.moe.is_sparse(layer_index):
            self.mlp = SparseMoeBlock(arch, ops, group)
        else:
            self.mlp = MLP(arch, ops, group)

    def forward(
        self,
        x: torch.Tensor | PartialSum,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | PartialSum, torch.Tensor]:
        q, k, v, residual = self.pre_attention(x, residual)
        attn = self.self_attn.attend(q, k, v, rope, kv_cache, meta)
        return self.post_attention(attn.flatten(1), residual)

    # The two halves around attention: the parts a piecewise CUDA graph captures.

    def pre_attention(
        self,
        x: torch.Tensor | PartialSum,  # [T, hidden]: the last layer's output, or the embeddings
        residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        qkv_proj = self.self_attn.qkv_proj
        normed: torch.Tensor | Int8Rows
        if residual is None:  # the embeddings: summed by their own all-reduce
            residual = summed(x)
            normed = self.input_layernorm.norm_for(residual, qkv_proj)
        else:
            normed, residual = self.input_layernorm.add_and_norm_for(x, residual, qkv_proj)
        return (*self.self_attn.project(normed), residual)

    def post_attention(
        self,
        attn: torch.Tensor,  # [T, Hq * D]
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor | PartialSum, torch.Tensor]:  # the layer's output, the new residual
        x, residual = self.post_attention_layernorm.add_and_norm_for(
            self.self_attn.output(attn), residual, self.mlp.input_linear
        )
        return self.mlp(x), residual


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
