"""``--quantization``: which linears a load keeps quantized, and where their rows come from.

* ``auto``: a GGUF file's block-quantized linears stay packed on CUDA (on the CPU, which has
  no kernels for them, they are dequantized to float as before); float checkpoints stay float.
  A mixture of experts' stacked experts are never packed: they are dequantized at conversion.
* ``none``: everything float (a GGUF file dequantized at conversion).
* ``gguf``: a GGUF file's blocks stay packed on every device (the CPU dequantizes them per
  matmul: the reference path).
* ``q8_0``, ``q4_0``, ``q4_1``, ``fp8``: float weights quantized at load (in-situ). A mixture
  of experts from a GGUF file under ``fp8``: its experts (float from the conversion) in fp8,
  its block linears packed as ``gguf`` serves them: no block is quantized twice.

Tensor parallelism (``--tensor-parallel-size`` > 1) takes float weights only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import ConfigError
from engine.models.arch import ModelArch
from engine.quant.linear import PackedWeight
from engine.quant.plan import (
    QuantPlan,
    check_plan_device,
    experts_plan,
    hf_weight_names,
    in_situ_plan,
)
from engine.quant.plan import packed_plan as plan_from_formats
from kernels.linear.quant import FORMATS, IN_SITU_FORMATS, planes_from_ggml

if TYPE_CHECKING:
    from gguf import GGUFReader

PACKED_MODES = ("auto", "gguf")
BLOCK_FORMAT_NAMES = ", ".join(name for name in FORMATS if name != "fp8")


@dataclass(frozen=True)
class QuantLoad:
    """The plan, and the GGUF file whose blocks fill it (None: quantize float rows)."""

    plan: QuantPlan
    reader: GGUFReader | None = None

    def packed_names(self, arch: ModelArch) -> set[str]:
        """HF weight names read packed from the GGUF rather than as float."""
        return hf_weight_names(arch, self.plan) if self.reader is not None else set()


def resolve_quant_load(
    mode: str,
    model_name: str,
    gguf_path: Path | None,
    arch: ModelArch,
    device: torch.device,
    tensor_parallel_size: int = 1,
) -> QuantLoad:
    """The plan for ``--quantization mode``; a mode that cannot apply to the model fails.
    Under tensor parallelism weights stay float (``auto``) or the mode is refused: a shard
    would cut o_proj and down_proj's rows through their blocks."""
    if arch.moe is not None and mode not in ("auto", "none", "fp8", "gguf"):
        raise ConfigError(
            f"--quantization {mode}: {arch.architecture} is a mixture of experts, whose expert "
            "weights quantize to fp8 only; use --quantization fp8, or none"
        )  # a GGUF's packed linears (gguf, auto) are its attention's: its experts come as float
    if tensor_parallel_size > 1 and mode not in ("auto", "none"):
        raise ConfigError(
            f"--quantization {mode} needs --tensor-parallel-size 1 (quantized weights are not "
            "sharded yet); use --quantization none or auto (float weights) with tensor parallelism"
        )
    if tensor_parallel_size > 1 or mode == "none":
        load = QuantLoad({})
    elif mode in PACKED_MODES:
        load = _packed_load(mode, model_name, gguf_path, arch, device)
    elif mode == "fp8" and gguf_path is not None and arch.moe is not None:
        load = _gguf_experts_in_fp8(gguf_path, arch)
    elif mode in IN_SITU_FORMATS:
        _check_float_source(mode, model_name, gguf_path)
        load = QuantLoad(in_situ_plan(arch, mode))
    else:
        raise ConfigError(f"quantization: {mode!r} is not a known mode")
    check_plan_device(load.plan, device)
    return load


def _packed_load(
    mode: str, model_name: str, gguf_path: Path | None, arch: ModelArch, device: torch.device
) -> QuantLoad:
    if mode == "gguf" and gguf_path is None:
        raise ConfigError(
            f"--quantization gguf serves a GGUF file's quantized blocks; {model_name} is not a "
            "GGUF file (quantize float weights at load with q8_0, q4_0, q4_1 or fp8)"
        )
    if gguf_path is None or (mode == "auto" and device.type != "cuda"):
        return QuantLoad({})
    from engine.loader.gguf import block_formats, open_gguf

    reader = open_gguf(gguf_path)
    plan = plan_from_formats(arch, block_formats(reader))
    if mode == "gguf" and not plan:
        raise ConfigError(
            f"--quantization gguf: {model_name} has no linear weights in a block format served "
            f"packed ({BLOCK_FORMAT_NAMES}); use --quantization none"
        )
    return QuantLoad(plan, reader)


def _gguf_experts_in_fp8(gguf_path: Path, arch: ModelArch) -> QuantLoad:
    """A mixture of experts' GGUF under fp8: the file's block linears packed (``gguf``'s plan),
    its experts, float from the conversion, quantized to fp8 as they are read."""
    from engine.loader.gguf import block_formats, open_gguf

    reader = open_gguf(gguf_path)
    return QuantLoad(
        plan_from_formats(arch, block_formats(reader)) | experts_plan(arch, "fp8"), reader
    )


def _check_float_source(mode: str, model_name: str, gguf_path: Path | None) -> None:
    """In-situ quantization takes float weights, not a GGUF's already quantized ones."""
    if gguf_path is None:
        return
    from engine.loader.gguf import block_formats, open_gguf

    formats = block_formats(open_gguf(gguf_path))
    formats = {name: f for name, f in formats.items() if "embed_tokens" not in name}
    if formats:
        kinds = ", ".join(sorted(set(formats.values())))
        raise ConfigError(
            f"--quantization {mode}: {model_name} is already quantized ({kinds}); use "
            "--quantization auto or gguf to serve its blocks, or none to dequantize them"
        )


def iter_packed(load: QuantLoad, arch: ModelArch) -> Iterator[tuple[str, PackedWeight]]:
    """HF name -> packed rows, for every weight of the plan that the GGUF holds packed."""
    if load.reader is None:
        return
    from engine.loader.gguf import iter_blocks

    for name, format_name, blocks in iter_blocks(load.reader, load.packed_names(arch)):
        fmt = FORMATS[format_name]
        yield name, PackedWeight(fmt, planes_from_ggml(blocks, fmt))
