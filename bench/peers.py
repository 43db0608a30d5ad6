"""Hugging Face transformers as the peer in benchmarks: same prompts, process and device.

``generate_batch`` is transformers' continuous-batching generation (paged KV, sdpa); plain
``generate`` is its static-batch path. Both run on the same weights shape as the engine's
model: a ``dummy:<shape>`` becomes a randomly initialised transformers model of that config,
a real model is loaded from its directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.loader import resolve_model_dir
from engine.loader.dummy import DUMMY_PREFIX, dummy_hf_config


@dataclass(frozen=True)
class PeerResult:
    name: str  # e.g. "hf_generate_batch"
    elapsed_s: float
    num_requests: int
    output_tokens: int
    settings: dict[str, Any]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_record(self) -> dict[str, Any]:
        return {
            "peer": self.name,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "settings": self.settings,
        }


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The transformers model for an engine model name (sdpa attention, eval mode)."""
    import transformers

    auto: Any = transformers.AutoModelForCausalLM  # its stubs do not describe from_config
    if model.startswith(DUMMY_PREFIX):
        config = dummy_hf_config(model.removeprefix(DUMMY_PREFIX))
        with torch.device(device):
            hf_model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        hf_model = auto.from_pretrained(
            resolve_model_dir(model), dtype=dtype, attn_implementation="sdpa"
        )
        hf_model.to(device)
    # No EOS: every request generates exactly max_new_tokens, as in the engine's benchmarks.
    hf_model.generation_config.eos_token_id = None
    return hf_model.eval()


def _greedy_config(max_new_tokens: int) -> Any:
    import transformers

    return transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def run_hf_generate_batch(
    hf_model: Any, prompts: list[list[int]], max_new_tokens: int
) -> PeerResult:
    """transformers' continuous batching over every prompt at once; timed after a warm-up."""
    # No inference_mode here: generate_batch runs the model on its own thread and manages
    # grad mode there; tensors made under inference_mode on this thread would break it.
    hf_model.generate_batch(inputs=prompts[:2], generation_config=_greedy_config(4))
    _synchronize()
    start_s = time.perf_counter()
    outputs = hf_model.generate_batch(
        inputs=prompts, generation_config=_greedy_config(max_new_tokens)
    )
    _synchronize()
    elapsed_s = time.perf_counter() - start_s
    failed = [out.error for out in outputs.values() if out.error]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"transformers generate_batch failed: {failed[:1] or 'missing outputs'}")
    num_tokens = sum(len(out.generated_tokens) for out in outputs.values())
    settings = {"attn_implementation": "sdpa", "max_new_tokens": max_new_tokens}
    return PeerResult("hf_generate_batch", elapsed_s, len(prompts), num_tokens, settings)


def run_hf_generate(hf_model: Any, prompts: list[list[int]], max_new_tokens: int) -> PeerResult:
    """transformers' static-batch ``generate`` (all prompts padded into one batch)."""
    device = next(hf_model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    config = _greedy_config(max_new_tokens)
    with torch.inference_mode():
        hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(2))
        _synchronize()
        start_s = time.perf_counter()
        out = hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        _synchronize()
        elapsed_s = time.perf_counter() - start_s
    num_tokens = (out.shape[1] - width) * len(prompts)
    settings = {
        "attn_implementation": "sdpa",
        "max_new_tokens": max_new_tokens,
        "batch": len(prompts),
    }
    return PeerResult("hf_generate", elapsed_s, len(prompts), num_tokens, settings)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
