"""The sparse MLP of mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (``gate``: hidden -> one logit per expert) picks each token's ``top_k`` experts; the
experts' weights are stacked, ``w13 [E, 2 * I, H]`` (each expert's gate rows, then its up
rows: fused as the dense MLP's gate_up_proj) and ``w2 [E, H, I]``, and the backend's
``fused_moe`` runs route, align and the grouped GEMMs (kernels/moe/). Qwen2-MoE adds a
shared expert, a dense MLP whose output a sigmoid gate scales, on every token.

Tensor parallelism splits each expert along its intermediate size, as the dense MLP: w13's
gate and up rows and w2's columns; the router is replicated, so every rank routes alike,
and one all-reduce sums the experts' (and the shared expert's) partial outputs.

``--quantization fp8`` swaps each ``StackedExperts`` for ``Fp8StackedExperts`` (float8 e4m3
with a float32 scale per row, engine/quant/plan.py), filled row by row as the checkpoint is
read: a model never sits whole in 16 bits on the device.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.attention import LayerOps
from engine.distributed.group import PartialSum, TensorParallelGroup
from engine.errors import ModelLoadError
from engine.models.arch import ModelArch
from engine.models.linears import ROUTER_GEMV_CONFIG, input_linear
from engine.quant.linear import PackedWeight
from kernels.linear.quant import FORMATS, quantize

# HF expert weight names (after "model."): Qwen's gate/up/down_proj, Mixtral's w1/w3/w2.
EXPERT_WEIGHT = re.compile(
    r"^(?P<layer>layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
GATE_PARTS, UP_PARTS = ("gate_proj", "w1"), ("up_proj", "w3")


class StackedExperts(nn.Module):
    """One projection of all experts of a layer, float: ``weight [E, N, K]``."""

    scale: torch.Tensor | None = None

    def __init__(self, num_experts: int, num_rows: int, size_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, num_rows, size_k))


class Fp8StackedExperts(nn.Module):
    """One projection of all experts in float8 e4m3, ``weight [E, N, K]``, with a float32
    ``scale [E, N]`` per row; rows count as in the ``[E * N, K]`` view (``expert_target``)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, num_experts: int, num_rows: int, size_k: int, device: torch.device | str
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = size_k, num_experts * num_rows
        shape = (num_experts, num_rows, size_k)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.ones(shape[:2], dtype=torch.float32, device=device))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def load_rows(self, start: int, end: int, value: torch.Tensor | PackedWeight) -> None:
        """Rows ``[start, end)`` of the ``[E * N, K]`` view, quantized from float rows here."""
        if isinstance(value, PackedWeight):
            raise ModelLoadError(f"expert rows {start}:{end} come packed ({value.fmt.name}); "
                                 "experts take float rows only")  # fmt: skip
        dest = self.weight.view(-1, self.in_features)[start:end]
        if tuple(value.shape) != tuple(dest.shape):
            raise ModelLoadError(
                f"expert rows {start}:{end}: shape {tuple(value.shape)} != {tuple(dest.shape)}"
            )
        planes = quantize(value.to(self.device), FORMATS["fp8"])
        dest.copy_(planes["w"])
        self.scale.view(-1)[start:end].copy_(planes["scale"].view(-1))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense gated MLP (this rank's columns), not all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> partial [T, hidden]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ a gated shared expert) in place of a dense MLP."""

    def __init__(self, arch: ModelArch, ops: LayerOps, group: TensorParallelGroup) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None, "a sparse block needs the model's MoeArch"
        hidden, inter = arch.hidden_size, moe.intermediate_size  # this rank's expert width
        self.ops, self.group = ops, group
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.w13: StackedExperts | Fp8StackedExperts = StackedExperts(
            moe.num_experts, 2 * inter, hidden
        )
        self.w2: StackedExperts | Fp8StackedExperts = StackedExperts(moe.num_experts, hidden, inter)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden, moe.shared_intermediate_size, ops)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @property
    def input_linear(self) -> nn.Module:
        """The first linear to read the block's input (the router)."""
        return self.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSum:  # [T, hidden]
        # [T, E], in the model's dtype (as HF computes them): at a decode row the GEMV (its
        # launch shape from bench.gemv's table where it has one), else cuBLAS
        router_logits = input_linear(x, self.gate, default=ROUTER_GEMV_CONFIG)
        out = self.ops.fused_moe(
            x, self.w13.weight, self.w2.weight, router_logits, self.top_k, self.renormalize,
            w13_scale=self.w13.scale, w2_scale=self.w2.scale,
        )  # fmt: skip
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce_for_norm(out)  # summed, or left to the norm after it


def expert_target(name: str, arch: ModelArch) -> tuple[str, tuple[int, int]] | None:
    """An HF expert weight (``name`` without ``model.``) -> (stacked weight, its rows in the
    weight flattened to 2-D); None for any other weight.

    ``w13`` flattens to ``[E * 2I, H]``: expert e's gate rows start at ``e * 2I``, its up rows
    at ``e * 2I + I``; ``w2`` to ``[E * H, I]``: expert e's rows start at ``e * H``.
    """
    match = EXPERT_WEIGHT.match(name)
    if match is None or arch.moe is None:
        return None
    layer, expert, part = match["layer"], int(match["expert"]), match["part"]
    inter, hidden = arch.moe.intermediate_size, arch.hidden_size
    if part in GATE_PARTS or part in UP_PARTS:
        start = expert * 2 * inter + (inter if part in UP_PARTS else 0)
        return f"{layer}.mlp.w13.weight", (start, start + inter)
    return f"{layer}.mlp.w2.weight", (expert * hidden, (expert + 1) * hidden)


def rename_moe_weight(name: str) -> str:
    """Mixtral's ``block_sparse_moe`` is this model's ``mlp`` (its router is ``gate`` in both)."""
    return name.replace(".block_sparse_moe.", ".mlp.")
