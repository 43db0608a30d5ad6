"""The layers of the Llama-family decoder (``engine.models.llama``): RMSNorm, attention, the
MLP and the decoder layer that joins them, and which path each linear takes (the Triton GEMV
at one row, int8 rows, cuBLAS; a plain linear's path is in ``engine.models.linears``).

Under tensor parallelism o_proj's and down's outputs are this rank's share of a sum. Where
the sum can run in one kernel with the residual add and RMSNorm after it, the layer hands the
norm the share unsummed (``PartialSum``), and the norm sums it.
"""

from __future__ import annotations

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
from engine.models.arch import ModelArch
from engine.models.linears import LAYER_GEMV_CONFIG, gemv_config, input_linear
from engine.models.moe import SparseMoeBlock
from engine.quant.linear import QuantizedLinear
from kernels.linear.gemv_triton import gemv
from kernels.linear.int8_rows_triton import Int8Rows


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
        out: torch.Tensor | None = None,  # [T, (Hq + 2 * Hkv) * D]: where the projection goes
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        """The new tokens' queries, keys and values, not yet normed (Qwen3) nor rotated:
        attention does both to q and k, fused with the KV write (one kernel launch where the
        two norms, rotary and the write were four). All three are views of one row block
        (``out`` where given), strided across rows, as attention takes them."""
        num_tokens = x.shape[0]
        q, k, v = input_linear(x, self.qkv_proj, out).split(
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
        qkv_out: torch.Tensor | None = None,  # [T, (Hq + 2 * Hkv) * D]: q, k, v's rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v, residual
        qkv_proj = self.self_attn.qkv_proj
        normed: torch.Tensor | Int8Rows
        if residual is None:  # the embeddings: summed by their own all-reduce
            residual = summed(x)
            normed = self.input_layernorm.norm_for(residual, qkv_proj)
        else:
            normed, residual = self.input_layernorm.add_and_norm_for(x, residual, qkv_proj)
        return (*self.self_attn.project(normed, qkv_out), residual)

    def post_attention(
        self,
        attn: torch.Tensor,  # [T, Hq * D]
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor | PartialSum, torch.Tensor]:  # the layer's output, the new residual
        x, residual = self.post_attention_layernorm.add_and_norm_for(
            self.self_attn.output(attn), residual, self.mlp.input_linear
        )
        return self.mlp(x), residual
