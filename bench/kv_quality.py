"""What an fp8 KV cache costs in quality, against the model-dtype cache on the same weights.

Two measures, both on the same prompts:
- greedy agreement: generate with each cache; the share of requests whose tokens are
  identical, and the mean share of each output before the first differing token;
- logit error under teacher forcing: each reference sequence (prompt + the reference cache's
  own greedy output) goes through one prefill with each cache; at every position compare the
  logits (mean and max absolute error, error relative to the logits' spread, KL divergence of
  the next-token distributions, top-1 agreement).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from bench.records import machine_info, utc_now
from engine.llm import LLM
from engine.memory import release_device_memory
from engine.sampling_params import SamplingParams

# Natural prompts for models with a tokenizer: quality is judged on text, not random ids.
TEXT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper:",
    "def fibonacci(n):",
    "The history of the printing press begins",
    "Translate to French: The weather is nice today.",
    "Q: What is 17 times 23?\nA:",
)


def measure_kv_quality(
    model: str,
    *,
    cache_type: str = "fp8_e4m3",
    num_prompts: int = 8,
    input_len: int = 128,
    output_len: int = 64,
    seed: int = 0,
    **settings: Any,
) -> dict[str, Any]:
    """The quality record (see module docstring) of ``cache_type`` against ``auto``."""
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    reference = LLM(model, **settings)
    prompts = quality_prompts(reference, num_prompts, input_len, seed)
    ref_outputs = [o.token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    sequences = [list(p) + out for p, out in zip(prompts, ref_outputs, strict=True)]
    ref_logits = [reference.engine.runner.teacher_forced_logits(s).cpu() for s in sequences]
    device, dtype = str(reference.engine.device), str(reference.engine.dtype)
    del reference
    release_device_memory()
    candidate = LLM(model, pa_cache_type=cache_type, **settings)
    outputs = [o.token_ids for o in candidate.generate(prompts, greedy, use_tqdm=False)]
    logits = [candidate.engine.runner.teacher_forced_logits(s).cpu() for s in sequences]
    del candidate
    release_device_memory()
    return {
        "kind": "kv_quality",
        "created_utc": utc_now(),
        "machine": machine_info(device),
        "settings": {
            "model": model,
            "cache_type": cache_type,
            "reference": f"auto ({dtype})",
            "num_prompts": len(prompts),
            "input_len": input_len,
            "output_len": output_len,
            "seed": seed,
            **settings,
        },
        "results": {
            **greedy_agreement(ref_outputs, outputs),
            **logit_error(ref_logits, logits, [len(p) for p in prompts]),
        },
    }


def quality_prompts(llm: LLM, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Natural text prompts for a model with a tokenizer, else random token ids."""
    tokenizer = llm.engine.tokenizer
    if tokenizer is not None:
        texts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(num_prompts)]
        return [llm.engine.encode_prompt(prompt=text) for text in texts]
    rng = np.random.default_rng(seed)
    vocab_size = llm.engine.loaded.arch.vocab_size
    return rng.integers(0, vocab_size, (num_prompts, input_len)).tolist()


def greedy_agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    """Share of identical outputs, and mean share of each before its first differing token."""
    prefix_shares = []
    for ref, out in zip(reference, outputs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out, strict=True)) if a != b), len(ref))
        prefix_shares.append(same / len(ref))
    return {
        "greedy_identical_share": sum(s == 1.0 for s in prefix_shares) / len(prefix_shares),
        "greedy_mean_prefix_share": statistics.fmean(prefix_shares),
    }


def logit_error(
    reference: list[torch.Tensor], logits: list[torch.Tensor], prompt_lens: list[int]
) -> dict[str, float]:
    """Teacher-forced logits [L, V] per sequence against the reference's, from each prompt's
    last token on: absolute and relative error, KL divergence, top-1 agreement."""
    # Positions from the last prompt token on: those predict the generated tokens.
    ref = torch.cat([r[n - 1 : -1] for r, n in zip(reference, prompt_lens, strict=True)])
    got = torch.cat([g[n - 1 : -1] for g, n in zip(logits, prompt_lens, strict=True)])
    error = (got - ref).abs()
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    return {
        "logit_mean_abs_error": float(error.mean()),
        "logit_max_abs_error": float(error.max()),
        "logit_relative_error": float(error.mean() / ref.std(dim=-1).mean()),
        "kl_divergence_mean": float(kl.mean()),
        "teacher_forced_top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "num_positions": int(ref.shape[0]),
    }
