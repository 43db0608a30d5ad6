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
from engine.distributed.group import TensorParallelGroup
from engine.distributed.shard import ShardPlan
from engine.errors import ModelLoadError
from engine.loader.dummy import DUMMY_PREFIX, dummy_hf_config, init_dummy_weights
from engine.loader.quantized import QuantLoad, iter_packed, resolve_quant_load
from engine.models.arch import ModelArch
from engine.models.llama import LlamaForCausalLM
from engine.quant.plan import QuantPlan, swap_in_quantized

HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DUMMY_RANK_SEED_STRIDE = 1_000_003  # rank r of a sharded dummy model draws from seed + r * this


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
    from engine.loader.gguf import BUNDLED_MODEL_NAME, convert_gguf, default_cache_root

    gguf_path = _gguf_source(name)
    if gguf_path is not None:
        return convert_gguf(gguf_path, default_cache_root(), progress=True)
    path = Path(name).expanduser()
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


@dataclass(frozen=True)
class ModelSource:
    """A found model: its shape and where its weights are. What every tensor-parallel rank
    needs to build its shard; rank 0 finds it and hands it to the others (they never import
    transformers)."""

    name: str
    arch: ModelArch
    model_dir: Path | None  # None: dummy weights
    config_eos_ids: frozenset[int] = frozenset()  # config.json's eos_token_id(s)


def find_model(name: str) -> ModelSource:
    """Resolve ``name`` (downloading or converting it as needed) and read its shape."""
    if name.startswith(DUMMY_PREFIX):
        hf_config, model_dir = dummy_hf_config(name.removeprefix(DUMMY_PREFIX)), None
    else:
        from transformers import AutoConfig

        model_dir = resolve_model_dir(name)
        hf_config = AutoConfig.from_pretrained(model_dir)
    eos_ids = _token_ids(getattr(hf_config, "eos_token_id", None))
    return ModelSource(name, ModelArch.from_hf_config(hf_config), model_dir, eos_ids)


def load_model(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_positions: int | None = None,
    seed: int = 0,
    group: TensorParallelGroup | None = None,
    source: ModelSource | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Build the model for ``name`` on ``device`` in ``dtype`` with its tokenizer; its linears
    quantized as ``quantization`` says (engine/loader/quantized.py).

    With a tensor-parallel ``group`` of more than one rank, only this rank's shard is built
    and read: each checkpoint tensor is sliced as it is read, never held whole. Dummy
    weights are drawn per shard (``seed`` + rank), so they differ from the unsharded model's.
    Only rank 0 loads the tokenizer and EOS ids (``source``: ``find_model(name)`` already
    done).
    """
    group = group or TensorParallelGroup()
    start_s = time.perf_counter()
    source = source or find_model(name)
    arch, model_dir = source.arch, source.model_dir
    plan = ShardPlan.for_arch(arch, group.rank, group.size)
    quant = resolve_quant_load(quantization, name, _gguf_source(name), arch, device, group.size)
    model = _build(arch, backend, dtype, device, max_positions, plan, group, quant.plan)
    if model_dir is None:
        init_dummy_weights(model, seed + DUMMY_RANK_SEED_STRIDE * group.rank)
    else:
        with torch.no_grad():
            model.load_weights(_iter_weights(model_dir, plan, quant, arch))
    model.tie_weights()
    tokenizer, eos_ids = _tokenizer_and_eos(source) if group.is_driver else (None, frozenset())
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


def _tokenizer_and_eos(source: ModelSource) -> tuple[Any | None, frozenset[int]]:
    """The tokenizer and every EOS id: config.json's (read by ``find_model``), the generation
    config's and the tokenizer's."""
    if source.model_dir is None:
        return None, source.config_eos_ids
    tokenizer = _load_tokenizer(source.model_dir)
    generation_config = _read_generation_config(source.model_dir) or {}
    return tokenizer, (
        source.config_eos_ids
        | _token_ids(generation_config.get("eos_token_id"))
        | _token_ids(getattr(tokenizer, "eos_token_id", None))
    )


def _build(
    arch: ModelArch,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None,
    plan: ShardPlan,
    group: TensorParallelGroup,
    quant_plan: QuantPlan,
) -> LlamaForCausalLM:
    # Build on the meta device: no time spent on random init that loading overwrites. The
    # parameters take their dtype there, so the device holds them once, in that dtype: made
    # in float32 first, a 30B model would need 122 GB before its cast.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend, plan, group)
        swap_in_quantized(model, quant_plan)
        # parameters only: a quantized linear's planes (buffers) keep their own dtypes
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model = model.to_empty(device=device)
    model.init_rope(max_positions or arch.max_position_embeddings, device)
    return model.eval().requires_grad_(False)


def _iter_weights(model_dir: Path, plan: ShardPlan, quant: QuantLoad, arch: ModelArch) -> Any:
    """HF-named float tensors from the directory, then the plan's packed rows from the GGUF."""
    yield from _iter_safetensors(model_dir, plan, skip=quant.packed_names(arch))
    yield from iter_packed(quant, arch)


def _iter_safetensors(model_dir: Path, plan: ShardPlan, skip: set[str] | None = None) -> Any:
    """(HF name, this rank's part of the tensor), reading from disk only that part; the
    names in ``skip`` (held packed elsewhere) are not read."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key in (skip or ()):
                    continue
                if plan.size == 1:
                    yield key, handle.get_tensor(key)
                    continue
                part = handle.get_slice(key)
                yield key, plan.read(key, tuple(part.get_shape()), part.__getitem__)


def _load_tokenizer(model_dir: Path) -> Any | None:
    from transformers import AutoTokenizer

    has_files = any(
        (model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )
    return AutoTokenizer.from_pretrained(model_dir) if has_files else None


def _read_generation_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _token_ids(value: Any) -> frozenset[int]:
    """An ``eos_token_id`` setting (an id, a list of ids, or none) as a set."""
    if isinstance(value, int):
        return frozenset([value])
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int))
    return frozenset()
