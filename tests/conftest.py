"""Shared fixtures: tiny random Hugging Face models of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Parity with transformers is defined on the CPU in fp32: engines built with device=auto run
# there even on a GPU host. GPU tests (marked `gpu`) ask for cuda explicitly.
os.environ.setdefault("PAGESTREAM_DEVICE", "cpu")
# Without a GPU the Triton kernels run on the CPU through Triton's interpreter. @triton.jit
# reads this when a kernel module is imported, which is after conftest.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each test process takes its share of the cores for torch's intra-op
# threads: two processes of two threads each on two cores spin against each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    num_test_processes = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_test_processes))
pytest_plugins = [
    "tests.redis_server",
    "tests.redis_cluster",
    "tests.service_fixtures",
    "tests.gateway_fixtures",
    "tests.structured_fixtures",
    "tests.chaos.plugin",
    "tests.chaos.target",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skipped without CUDA; ``interpreted`` ones (Triton kernels on CPU tensors)
    skipped where the interpreter is off, as on a CUDA host, where their kernels compile for
    the GPU and a CPU tensor cannot reach them."""
    has_cuda, interpreted = torch.cuda.is_available(), os.environ.get("TRITON_INTERPRET") == "1"
    needs_cuda = pytest.mark.skip(reason="needs a CUDA device")
    needs_interpreter = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (set without CUDA)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(needs_cuda)
        if "interpreted" in item.keywords and not interpreted:
            item.add_marker(needs_interpreter)


TINY_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama31": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=24)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, num_attention_heads=4, num_key_value_heads=1)),
}


# Mixtures of experts (tests/test_moe_models.py): uneven, peaked routing from the widened
# router weights; Qwen3-MoE with a dense layer (mlp_only_layers), Qwen2-MoE with its shared expert.
TINY_MOE_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, norm_topk_prob=False),
    ),
}  # fmt: skip


def build_tiny_model(
    kind: str, directory: Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """A tiny random model of ``kind`` (``overrides``: config fields changed) saved in
    ``directory``."""
    import transformers

    config_name, extra = {**TINY_ARCHS, **TINY_MOE_ARCHS}[kind]
    config = getattr(transformers, config_name)(**{**TINY_COMMON, **extra, **(overrides or {})})
    model_class = getattr(transformers, config_name.replace("Config", "ForCausalLM"))
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Random init at std 0.02 gives near-uniform logits; widen it so greedy choices are
    # clear-cut and a wrong attention mask or rope shows up as different tokens.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25 if "embed" in name else 0.12)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)  # Qwen3's per-head norms: a weight left out shows
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny_model(kind, root / kind) for kind in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe-models")
    return {kind: build_tiny_model(kind, root / kind) for kind in TINY_MOE_ARCHS}


@pytest.fixture(scope="session")
def perturbed_llama(
    tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny llama with noise on every weight: a draft model that is often, not always,
    right about the llama's next token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    directory = tmp_path_factory.mktemp("perturbed-llama")
    model.save_pretrained(directory)
    return directory


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference continuations from transformers' own generate (fp32, CPU, no EOS stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
