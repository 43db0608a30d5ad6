"""Find a model by name, build the native model and its tokenizer.

Names: a local HF directory, a hub id, a ``.gguf`` file (converted once into a cached HF
directory), ``dummy:<shape>`` random weights, or the bundled default ``smollm2-135m``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionBackend
from engine.errors import ModelLoadError
from engine.loader.dummy import DUMMY_PREFIX, dummy_hf_config, init_dummy_weights
from engine.loader.quantized import QuantLoad, iter_packed, resolve_quant_load
from engine.models.arch import ModelArch
from engine.models.llama import LlamaForCausalLM
from engine.quant.plan import QuantPlan, swap_in_quantized

HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    name: str
    model: LlamaForCausalLM
    arch: ModelArch
    tokenizer: Any | None  # a transformers tokenizer; None for dummy models
    eos_token_ids: frozenset[int]
    weights_bytes: int
    load_s: float


def resolve_model_dir(name: str) -> Path:
    """The HF-format directory that holds ``name`` (converting or downloading as needed)."""
    from engine.loader.gguf import (
        BUNDLED_MODEL_NAME,
        bundled_gguf_path,
        convert_gguf,
        default_cache_root,
    )

    if name == BUNDLED_MODEL_NAME:
        return convert_gguf(bundled_gguf_path(), default_cache_root(), progress=True)
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return convert_gguf(path, default_cache_root(), progress=True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return path
    if HUB_ID_PATTERN.match(name) and not path.exists():
        return _download_from_hub(name)
    raise ModelLoadError(
        f"model {name!r} not found: expected a local HF directory, a .gguf file, a hub id "
        f"(org/name), dummy:<shape>, or {BUNDLED_MODEL_NAME}"
    )


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise ModelLoadError(f"could not fetch {repo_id!r} from the hub: {exc}") from exc


def load_model(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_positions: int | None = None,
    seed: int = 0,
    quantization: str = "auto",
) -> LoadedModel:
    """Build the model for ``name`` on ``device`` in ``dtype`` with its tokenizer; its linears
    quantized as ``quantization`` (engine/loader/quantized.py) says."""
    start_s = time.perf_counter()
    if name.startswith(DUMMY_PREFIX):
        hf_config, model_dir = dummy_hf_config(name.removeprefix(DUMMY_PREFIX)), None
    else:
        from transformers import AutoConfig

        model_dir = resolve_model_dir(name)
        hf_config = AutoConfig.from_pretrained(model_dir)
    arch = ModelArch.from_hf_config(hf_config)
    quant = resolve_quant_load(quantization, name, _gguf_source(name), arch, device)
    model = _build(arch, backend, dtype, device, max_positions, quant.plan)
    if model_dir is None:
        init_dummy_weights(model, seed)
        tokenizer, eos_ids = None, _eos_ids_from(hf_config, None, None)
    else:
        with torch.no_grad():
            model.load_weights(_iter_weights(model_dir, quant, arch))
        tokenizer = _load_tokenizer(model_dir)
        eos_ids = _eos_ids_from(hf_config, _read_generation_config(model_dir), tokenizer)
    model.tie_weights()
    weights_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    weights_bytes += sum(t.numel() * t.element_size() for t in model.buffers())
    return LoadedModel(
        name, model, arch, tokenizer, eos_ids, weights_bytes, time.perf_counter() - start_s
    )


def _gguf_source(name: str) -> Path | None:
    """The GGUF file behind ``name``, if it names one."""
    from engine.loader.gguf import BUNDLED_MODEL_NAME, bundled_gguf_path

    if name == BUNDLED_MODEL_NAME:
        return bundled_gguf_path()
    return Path(name).expanduser() if name.endswith(".gguf") else None


def _build(
    arch: ModelArch,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None,
    plan: QuantPlan,
) -> LlamaForCausalLM:
    # Build on the meta device: no time spent on random init that loading overwrites.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend)
        swap_in_quantized(model, plan)
    model = model.to_empty(device=device)
    # parameters only: a quantized linear's planes (buffers) keep their own dtypes
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.init_rope(max_positions or arch.max_position_embeddings, device)
    return model.eval().requires_grad_(False)


def _iter_weights(model_dir: Path, quant: QuantLoad, arch: ModelArch) -> Any:
    """HF-named float tensors from the directory, then the plan's packed rows from the GGUF."""
    packed_names = quant.packed_names(arch)
    yield from _iter_safetensors(model_dir, skip=packed_names)
    yield from iter_packed(quant, arch)


def _iter_safetensors(model_dir: Path, skip: set[str] | None = None) -> Any:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key not in (skip or ()):
                    yield key, handle.get_tensor(key)


def _load_tokenizer(model_dir: Path) -> Any | None:
    from transformers import AutoTokenizer

    has_files = any(
        (model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )
    return AutoTokenizer.from_pretrained(model_dir) if has_files else None


def _read_generation_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _eos_ids_from(
    hf_config: Any, generation_config: dict[str, Any] | None, tokenizer: Any | None
) -> frozenset[int]:
    ids: set[int] = set()
    for value in (
        (generation_config or {}).get("eos_token_id"),
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
