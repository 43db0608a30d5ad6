"""Which linear layers of a model hold quantized weights, in which format, and the swap of
their ``nn.Linear`` for ``QuantizedLinear`` before the weights are loaded.

A plan maps module names of the native model (``layers.3.mlp.gate_up_proj``, ``lm_head``) to
formats. Embeddings and norms always stay float; a tied LM head shares the float embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ConfigError
from engine.models.arch import ModelArch
from engine.models.moe import Fp8StackedExperts, StackedExperts
from engine.quant.linear import QuantizedLinear
from engine.quant.scratch import DequantScratch
from kernels.linear.quant import FORMATS, QuantFormat

QuantPlan = dict[str, QuantFormat]

# each linear of a decoder layer -> the HF projections it holds, in row order
LAYER_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
MOE_EXPERTS = ("mlp.w13", "mlp.w2")  # a sparse layer's stacked experts (fp8 only)
LM_HEAD = "lm_head"
# The LM head stays at 8 bits under a 4-bit scheme, as llama.cpp's quantize keeps it high.
HEAD_FORMATS = {"q4_0": "q8_0", "q4_1": "q8_0"}
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions in hardware: Ada, Hopper and later


def in_situ_plan(arch: ModelArch, format_name: str) -> QuantPlan:
    """Every decoder linear in ``format_name`` (and an untied LM head), from float weights;
    a MoE layer's experts (``mlp.w13``, ``mlp.w2``) in place of its MLP's linears (its router
    stays float)."""
    fmt = FORMATS[format_name]
    plan = {
        f"layers.{index}.{linear}": fmt
        for index in range(arch.num_layers)
        for linear in _layer_linears(arch, index)
    }
    if not arch.tie_word_embeddings:
        plan[LM_HEAD] = FORMATS[HEAD_FORMATS.get(format_name, format_name)]
    return plan


def experts_plan(arch: ModelArch, format_name: str) -> QuantPlan:
    """Every sparse layer's stacked experts (``mlp.w13``, ``mlp.w2``) in ``format_name``:
    the experts of ``in_situ_plan``, nothing else."""
    return {
        module: fmt
        for module, fmt in in_situ_plan(arch, format_name).items()
        if module.endswith(MOE_EXPERTS)
    }


def _layer_linears(arch: ModelArch, layer_index: int) -> tuple[str, ...]:
    if arch.moe is not None and arch.moe.is_sparse(layer_index):
        return ("self_attn.qkv_proj", "self_attn.o_proj", *MOE_EXPERTS)
    return tuple(LAYER_LINEARS)


def packed_plan(arch: ModelArch, tensor_formats: dict[str, str]) -> QuantPlan:
    """The linears whose HF weights all come in one block format (``tensor_formats``: HF
    weight name -> format). A fused linear whose parts differ (Q4_K_M's q/k in q4_k, v in q6_k)
    stays float: its rows could not share one set of planes."""
    plan: QuantPlan = {}
    for index in range(arch.num_layers):
        for linear, parts in LAYER_LINEARS.items():
            names = {tensor_formats.get(f"model.layers.{index}.{part}.weight") for part in parts}
            only = names.pop() if len(names) == 1 else None
            if only is not None:
                plan[f"layers.{index}.{linear}"] = FORMATS[only]
    head = tensor_formats.get(f"{LM_HEAD}.weight")
    if head is not None and not arch.tie_word_embeddings:
        plan[LM_HEAD] = FORMATS[head]
    return plan


def hf_weight_names(arch: ModelArch, plan: QuantPlan) -> set[str]:
    """The HF weight names whose rows the plan's quantized linears hold (stacked experts
    quantize float rows as they are read: none of theirs)."""
    names = set()
    for module in plan:
        if module == LM_HEAD:
            names.add(f"{LM_HEAD}.weight")
            continue
        prefix, _, linear = module.partition(".")[2].partition(".")
        if linear in MOE_EXPERTS:
            continue
        for part in LAYER_LINEARS[linear]:
            names.add(f"model.layers.{prefix}.{part}.weight")
    return names


def swap_in_quantized(model: nn.Module, plan: QuantPlan) -> None:
    """Replace each planned ``nn.Linear`` with an empty ``QuantizedLinear`` on its device,
    all sharing one float weight scratch (engine/quant/scratch.py)."""
    scratch = DequantScratch()
    for name, fmt in plan.items():
        old = model.get_submodule(name)
        new: nn.Module
        if isinstance(old, StackedExperts):
            assert fmt.name == "fp8", f"{name}: experts quantize to fp8 only"
            num_experts, num_rows, size_k = old.weight.shape
            new = Fp8StackedExperts(num_experts, num_rows, size_k, old.weight.device)
            _replace(model, name, new)
            continue
        assert isinstance(old, nn.Linear), name
        new = QuantizedLinear(
            old.in_features,
            old.out_features,
            fmt,
            old.bias is not None,
            old.weight.device,
            scratch,
        )
        _replace(model, name, new)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def check_plan_device(plan: QuantPlan, device: torch.device) -> None:
    """fp8 weights need a GPU that converts e4m3 in hardware."""
    if device.type != "cuda" or all(fmt.name != "fp8" for fmt in plan.values()):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"--quantization fp8 needs compute capability {FP8_MIN_CAPABILITY[0]}."
            f"{FP8_MIN_CAPABILITY[1]}+ (Ada, Hopper); {device} has {capability[0]}."
            f"{capability[1]}: use q8_0 instead"
        )
