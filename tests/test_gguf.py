"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import engine.loader.gguf as gguf_loader
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.gguf import (
    BUNDLED_INSTALL_COMMAND,
    COMPLETE_MARKER_NAME,
    convert_gguf,
    default_cache_root,
    gguf_cache_dir,
    unpermute_rotary,
)
from engine.loader.gguf import bundled_gguf_path as find_bundled_gguf
from engine.loader.gguf_config import llama3_rope_scaling

TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_LAYERS, TINY_FFN = 32, 4, 2, 2, 64
TINY_TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
TINY_TOKENS += ["Ġ", "ab", "cd", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


# -- fixtures


@pytest.fixture(scope="module")
def bundled_gguf_path() -> Path:
    try:
        return find_bundled_gguf()
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def converted_dir(bundled_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(bundled_gguf_path, tmp_path_factory.mktemp("gguf-cache"))


@pytest.fixture(scope="module")
def reference_model(bundled_gguf_path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        str(bundled_gguf_path.parent), gguf_file=bundled_gguf_path.name, dtype=torch.float32
    )


def assert_same_state_dict(reference: PreTrainedModel, converted: PreTrainedModel) -> None:
    expected, actual = reference.state_dict(), converted.state_dict()
    assert sorted(actual) == sorted(expected)
    mismatched = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert mismatched == []


# -- the bundled SmolLM2 (llama arch, Q4_1, permuted q/k)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(
    converted_dir: Path, reference_model: PreTrainedModel
) -> None:
    converted = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert_same_state_dict(reference_model, converted)


@pytest.mark.slow
def test_greedy_generation_knows_paris(converted_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    completion = tokenizer.decode(output[0, inputs.input_ids.shape[1] :])
    assert "Paris" in completion


@pytest.mark.slow
def test_tokenizer_matches_gguf_tokenizer(converted_dir: Path, bundled_gguf_path: Path) -> None:
    converted = AutoTokenizer.from_pretrained(converted_dir)
    reference = AutoTokenizer.from_pretrained(
        str(bundled_gguf_path.parent), gguf_file=bundled_gguf_path.name
    )
    texts = ["The capital of France is", "Héllo,  wörld!\n\t42 <|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert converted(text).input_ids == reference(text).input_ids
    messages = [{"role": "user", "content": "Hi there"}]
    assert converted.chat_template
    assert converted.apply_chat_template(messages, tokenize=False) == (
        reference.apply_chat_template(messages, tokenize=False)
    )
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert converted.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]


@pytest.mark.slow
def test_second_convert_is_a_cache_hit(
    converted_dir: Path, bundled_gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached model was converted again")

    monkeypatch.setattr(gguf_loader, "_write_hf_dir", no_conversion)
    again = convert_gguf(bundled_gguf_path, converted_dir.parent)
    assert again == converted_dir
    assert (converted_dir / COMPLETE_MARKER_NAME).is_file()
    assert [p.name for p in converted_dir.parent.iterdir()] == [converted_dir.name]  # no temp left


# -- synthetic GGUFs: qwen2 (qkv bias), qwen3 (q/k norm, head_dim != hidden / heads), llama


def tiny_head_dim(arch: str) -> int:
    # transformers reads qwen3's head_dim from its default (128), not from attention.key_length
    return 128 if arch == "qwen3" else TINY_HIDDEN // TINY_HEADS


def write_tiny_metadata(writer: gguf.GGUFWriter, arch: str) -> None:
    writer.add_block_count(TINY_LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(TINY_HIDDEN)
    writer.add_feed_forward_length(TINY_FFN)
    writer.add_head_count(TINY_HEADS)
    writer.add_head_count_kv(TINY_KV_HEADS)
    writer.add_key_length(tiny_head_dim(arch))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10_000.0)
    write_tiny_tokenizer(writer)


def write_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary of ``TINY_TOKENS`` with a chat template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([1] * (len(TINY_TOKENS) - 3) + [3, 3, 3])  # last 3 are control
    # Two merges at least: transformers <= 5.17 reads a one-element array as a scalar.
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(TINY_TOKENS.index("<|endoftext|>"))
    writer.add_eos_token_id(TINY_TOKENS.index("<|endoftext|>"))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def tiny_tensor_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    q_rows, kv_rows = TINY_HEADS * tiny_head_dim(arch), TINY_KV_HEADS * tiny_head_dim(arch)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (len(TINY_TOKENS), TINY_HIDDEN)}
    for layer in range(TINY_LAYERS):
        block = {
            "attn_norm.weight": (TINY_HIDDEN,),
            "attn_q.weight": (q_rows, TINY_HIDDEN),
            "attn_k.weight": (kv_rows, TINY_HIDDEN),
            "attn_v.weight": (kv_rows, TINY_HIDDEN),
            "attn_output.weight": (TINY_HIDDEN, q_rows),
            "ffn_norm.weight": (TINY_HIDDEN,),
            "ffn_gate.weight": (TINY_FFN, TINY_HIDDEN),
            "ffn_up.weight": (TINY_FFN, TINY_HIDDEN),
            "ffn_down.weight": (TINY_HIDDEN, TINY_FFN),
        }
        if arch == "qwen2":
            block |= {
                "attn_q.bias": (q_rows,),
                "attn_k.bias": (kv_rows,),
                "attn_v.bias": (kv_rows,),
            }
        if arch == "qwen3":
            head_dim = tiny_head_dim(arch)
            block |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
        shapes |= {f"blk.{layer}.{name}": shape for name, shape in block.items()}
    return shapes | {
        "output_norm.weight": (TINY_HIDDEN,),
        "output.weight": (len(TINY_TOKENS), TINY_HIDDEN),
    }


def write_tiny_gguf(path: Path, arch: str) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    write_tiny_metadata(writer, arch)
    for name, shape in tiny_tensor_shapes(arch).items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_model_matches_transformers_gguf_loader(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    hf_dir = convert_gguf(gguf_path, tmp_path / "cache", progress=True)
    assert "converting GGUF" in capsys.readouterr().err
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert type(converted) is type(reference)
    assert converted.config.head_dim == tiny_head_dim(arch)
    assert not converted.config.tie_word_embeddings
    assert_same_state_dict(reference, converted)
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    end_ids = [TINY_TOKENS.index("<|endoftext|>"), TINY_TOKENS.index("<|im_end|>")]
    assert generation["eos_token_id"] == end_ids


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_engine_on_a_tiny_gguf_gives_transformers_tokens(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loads each architecture from the ``.gguf`` (qwen2's q/k/v biases without
    an o_proj bias) and decodes as transformers does on the converted weights."""
    from engine import LLM, SamplingParams
    from tests.conftest import hf_greedy

    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    prompts = [[3, 7, 11, 2, 5], [30, 1, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outputs = LLM(str(gguf_path), pa_block_size=16).generate(prompts, greedy, use_tqdm=False)
    converted = convert_gguf(gguf_path, tmp_path / "cache" / "gguf")
    assert [out.token_ids for out in outputs] == hf_greedy(converted, prompts, 8)


# -- llama.cpp's rotary permutation and rope scaling


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    weights = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(weights, num_heads=3)
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_rotary(permuted, num_heads=3), weights)


def test_unpermute_moves_interleaved_pairs_to_halves() -> None:
    # GGUF rows of a 4-dim head: (re0, im0, re1, im1) -> HF: (re0, re1, im0, im1)
    interleaved = np.array([0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 3.0, 13.0])
    expected = [0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0]
    assert unpermute_rotary(interleaved, num_heads=2).tolist() == expected


def llama_cpp_rope_freqs(factor: float, rope_theta: float, head_dim: int) -> np.ndarray:
    # llama.cpp's loop (LlamaModel.generate_extra_tensors) with llama 3.1's parameters
    old_length, low, high = 8192, 1.0, 4.0
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (i / head_dim)
        if wavelen < old_length / high:
            factors.append(1.0)
        elif wavelen > old_length / low:
            factors.append(factor)
        else:
            smooth = (old_length / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs() -> None:
    rope_freqs = llama_cpp_rope_freqs(factor=32.0, rope_theta=500_000.0, head_dim=64)
    scaling = llama3_rope_scaling(rope_freqs, rope_theta=500_000.0, head_dim=64)
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == 32.0
    with pytest.raises(UnsupportedModelError, match="rope"):
        llama3_rope_scaling(rope_freqs[::-1].copy(), rope_theta=500_000.0, head_dim=64)


# -- errors and paths


def test_missing_file_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="not found") as info:
        convert_gguf(missing, tmp_path / "cache")
    assert str(missing) in str(info.value)


def test_non_gguf_file_raises(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as info:
        convert_gguf(not_gguf, tmp_path / "cache")
    assert str(not_gguf) in str(info.value)


def test_unsupported_quantization_raises(tmp_path: Path) -> None:
    gguf_path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), arch="llama")
    write_tiny_metadata(writer, "llama")
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # gguf-py has no dequantizer for it
    block_size, type_size_bytes = gguf.GGML_QUANT_SIZES[q8_1]
    raw = np.zeros((len(TINY_TOKENS), TINY_HIDDEN // block_size * type_size_bytes), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="Q8_1"):
        convert_gguf(gguf_path, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the temp dir was cleaned up


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    gguf_path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), arch="phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError, match=r"'phi3'.*llama, qwen2, qwen2moe, qwen3, qwen3moe"
    ):
        convert_gguf(gguf_path, tmp_path / "cache")


def test_bundled_model_missing_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelLoadError) as info:
        find_bundled_gguf()
    assert BUNDLED_INSTALL_COMMAND in str(info.value)


def test_cache_dir_is_deterministic_and_tracks_mtime(tmp_path: Path) -> None:
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"GGUF")
    first = gguf_cache_dir(gguf_path, tmp_path / "cache")
    assert first == gguf_cache_dir(gguf_path, tmp_path / "cache")
    assert first.parent == tmp_path / "cache"
    assert first.name.startswith("m-")
    os.utime(gguf_path, ns=(0, 1_000_000_000))
    assert gguf_cache_dir(gguf_path, tmp_path / "cache") != first


def test_default_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGESTREAM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "pagestream" / "gguf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "pagestream" / "gguf"
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_root() == tmp_path / "explicit" / "gguf"


def test_converters_of_one_file_take_turns_and_the_second_finds_it_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers sharing a cache start on one GGUF at once: one converts, the other waits
    on the lock and reads its directory; no lock or temporary file is left."""
    import threading
    import time

    gguf_path = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")
    write_hf_dir = gguf_loader._write_hf_dir
    conversions: list[str] = []

    def slow_write(*args: object, **kwargs: object) -> None:
        conversions.append(threading.current_thread().name)
        time.sleep(0.5)  # the other thread reaches the lock meanwhile
        write_hf_dir(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_loader, "_write_hf_dir", slow_write)
    results: dict[str, Path] = {}

    def convert(name: str) -> None:
        results[name] = convert_gguf(gguf_path, tmp_path / "cache")

    threads = [threading.Thread(target=convert, args=(f"w{i}",), name=f"w{i}") for i in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(conversions) == 1 and results["w1"] == results["w2"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results["w1"].name]
