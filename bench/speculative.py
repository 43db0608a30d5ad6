"""Speculative decoding's speedup: the same greedy requests with and without drafts.

Each batch size runs ``batch`` requests together, once on an engine without speculative
decoding and once with it (``--speculative ngram`` unless the flags ask for a draft model), and
records time per output token, output tok/s, their ratio, the acceptance rate and whether
the greedy outputs came out the same.

The workload is the favourable case for prompt lookup, and the record says so: a model with
a chat template is asked to repeat a passage word for word, so its answer copies its prompt.
A model without a tokenizer (``dummy:``) gets token-id prompts that repeat a random run of
tokens; random weights do not copy it, so expect little acceptance there.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from bench.records import machine_info, speculative_counts
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.inputs import PromptEncoder
from engine.llm_engine import LLMEngine
from engine.memory import release_device_memory
from engine.sampling_params import SamplingParams

COPY_TASK = "Repeat the following text word for word, and nothing else.\n\n"
PASSAGES = (
    "The lighthouse keeper climbed the spiral stairs every evening at six. He trimmed the "
    "wick, polished the great lens with a soft cloth and wrote the weather in a leather "
    "book: wind from the north-west, a falling glass, two fishing boats coming home late.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add warm "
    "water a little at a time and knead the dough for ten minutes, until it is smooth. "
    "Leave it covered for an hour, shape it into a loaf and bake it for forty minutes.",
    "The committee met on Tuesday to review the budget for the coming year. It approved "
    "the repairs to the library roof, postponed the new playground until spring and asked "
    "the treasurer to report again in March on the cost of heating the town hall.",
    "A paged KV cache stores the keys and values of each sequence in fixed-size pages. A "
    "block table maps a sequence's positions to pages, so memory is taken as the sequence "
    "grows and given back when it ends, and sequences that share a prefix share its pages.",
    "On the first morning the expedition crossed the river at the ford below the mill. By "
    "noon they had reached the edge of the forest, where they rested, counted the supplies "
    "and decided to follow the old road north rather than the shorter path over the hills.",
    "Please find attached the invoice for the services provided in October. Payment is due "
    "within thirty days of the invoice date. If you have any questions about the charges, "
    "contact our accounts team, quoting the invoice number shown at the top of the page.",
    "The museum's new wing holds two hundred paintings from the northern schools, most of "
    "them landscapes and portraits. The rooms are lit from above through frosted glass, and "
    "the benches in the middle of each room face the largest picture on the far wall.",
    "When the tide went out the children ran across the wet sand to the rock pools. They "
    "found crabs, a starfish, small silver fish that darted under the weed and a shell as "
    "big as a hand, which they carried home and kept on the kitchen windowsill all summer.",
)
WARMUP_OUTPUT_LEN = 16
PASSAGES_PER_PROMPT = 3  # about 180 tokens to copy
RUN_TOKENS = 32  # token-id prompts: a random run of this many tokens ...
RUN_REPEATS = 4  # ... repeated this many times


@dataclass(frozen=True)
class SpeculativeWorkload:
    batch_sizes: tuple[int, ...] = (1, 8)
    output_len: int = 256  # at most; requests stop at EOS
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError("batch sizes must be >= 1")
        if self.output_len < 2:
            raise ConfigError("output_len must be >= 2")


def make_prompts(engine: LLMEngine, batch: int, seed: int) -> tuple[list[list[int]], str]:
    """``batch`` prompts (passages taken in turn) and what kind they are, for the record."""
    return copy_prompts(engine.prompt_encoder, engine.loaded.arch.vocab_size, batch, seed)


def copy_prompts(
    encoder: PromptEncoder, vocab_size: int, batch: int, seed: int
) -> tuple[list[list[int]], str]:
    """``make_prompts`` from a model's prompt encoder alone (what a peer engine runs)."""
    if encoder.tokenizer is not None and getattr(encoder.tokenizer, "chat_template", None):
        texts = [
            " ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(PASSAGES_PER_PROMPT))
            for i in range(batch)
        ]
        prompts = [
            encoder.encode(messages=[{"role": "user", "content": COPY_TASK + text}])
            for text in texts
        ]
        return prompts, f"chat: repeat {PASSAGES_PER_PROMPT} paragraphs word for word"
    rng = np.random.default_rng(seed + batch)
    runs = rng.integers(0, vocab_size, (batch, RUN_TOKENS)).tolist()
    return [run * RUN_REPEATS for run in runs], f"token ids: a random run repeated {RUN_REPEATS}x"


def run_speculative(
    config: EngineConfig, workload: SpeculativeWorkload, *, use_tqdm: bool = True
) -> dict[str, Any]:
    """Both engines, one after the other (one model in memory at a time); the record."""
    spec_config = config
    if config.speculative_method() == "off":
        spec_config = dataclasses.replace(config, speculative="ngram")
    plain_config = dataclasses.replace(
        config, speculative="off", speculative_model=None, num_speculative_tokens=None
    )
    created_utc = datetime.now(UTC)
    plain, plain_info = _run_engine(plain_config, workload, use_tqdm)
    spec, spec_info = _run_engine(spec_config, workload, use_tqdm)
    return {
        "kind": "speculative",
        "created_utc": created_utc.isoformat(timespec="seconds"),
        "machine": spec_info.pop("machine"),
        "settings": {
            **dataclasses.asdict(spec_config),
            **dataclasses.asdict(workload),
            "num_speculative_tokens_resolved": spec_config.speculative_tokens(),
            "async_scheduling_plain": plain_info["async_scheduling"],
            **spec_info,
        },
        "results": [_compare(p, s) for p, s in zip(plain, spec, strict=True)],
    }


def _run_engine(
    config: EngineConfig, workload: SpeculativeWorkload, use_tqdm: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One result per batch size, and what the engine resolved (then it is freed)."""
    engine = LLMEngine(config)
    label = config.speculative_method()
    for batch in workload.batch_sizes:  # warm-up: kernel compiles stay out of the timing
        prompts, kind = make_prompts(engine, batch, workload.seed)
        # reversed: the timed run must not find its prompts in the prefix cache
        _run_batch(engine, [prompt[::-1] for prompt in prompts], WARMUP_OUTPUT_LEN)
    results = []
    for batch in tqdm(workload.batch_sizes, desc=label, unit="batch", disable=not use_tqdm):
        prompts, kind = make_prompts(engine, batch, workload.seed)
        before = engine.stats()
        result = _run_batch(engine, prompts, workload.output_len)
        results.append({"batch": batch, **result, **speculative_counts(before, engine.stats())})
    info = {
        "machine": machine_info(engine.device),
        "prompts": kind,
        "model_dtype": str(engine.dtype).removeprefix("torch."),
        "cuda_graphs": engine.runner.uses_cuda_graphs,
        "async_scheduling": engine.async_scheduling,
    }
    del engine
    release_device_memory()
    return results, info


def _run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Greedy requests together until every one ends (EOS or ``output_len``)."""
    sampling = SamplingParams(temperature=0, max_tokens=output_len)
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        times[f"spec-{index}"], tokens[f"spec-{index}"] = [], []
        engine.add_request(f"spec-{index}", prompt_token_ids=prompt, sampling=sampling)
    start_s = time.perf_counter()
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        now_s = time.perf_counter() - start_s
        for out in outputs:
            times[out.request_id] += [now_s] * len(out.new_token_ids)
            tokens[out.request_id] += out.new_token_ids
    elapsed_s = max(t[-1] for t in times.values())
    tpot_s = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    num_output = sum(len(t) for t in tokens.values())
    return {
        "output_tokens": num_output,
        "elapsed_s": elapsed_s,
        "output_tok_s": num_output / elapsed_s,
        "mean_tpot_s": statistics.fmean(tpot_s) if tpot_s else None,
        "num_steps": num_steps,
        "token_ids": list(tokens.values()),
    }


def _compare(plain: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """One batch size: both runs, the speedup, and how many outputs came out identical."""
    same = [a == b for a, b in zip(plain.pop("token_ids"), spec.pop("token_ids"), strict=True)]
    speedup_tpot = None
    if plain["mean_tpot_s"] and spec["mean_tpot_s"]:
        speedup_tpot = plain["mean_tpot_s"] / spec["mean_tpot_s"]
    return {
        "batch": plain["batch"],
        "plain": {k: v for k, v in plain.items() if k != "batch"},
        "speculative": {k: v for k, v in spec.items() if k != "batch"},
        "speedup_tok_s": spec["output_tok_s"] / plain["output_tok_s"],
        "speedup_tpot": speedup_tpot,
        "acceptance_rate": spec["acceptance_rate"],
        # greedy in bf16: a verify step's rounding can differ from a decode step's, so a
        # near-tie may flip a token; on the CPU in fp32 the tests demand identical outputs
        "num_identical_outputs": sum(same),
        "num_requests": len(same),
    }


def format_results(results: list[dict[str, Any]]) -> str:
    lines = ["batch  plain tok/s  spec tok/s  speedup  TPOT ms plain/spec  accepted  identical"]
    for r in results:
        plain, spec = r["plain"], r["speculative"]
        rate = r["acceptance_rate"]
        tpot = "n/a"
        if plain["mean_tpot_s"] and spec["mean_tpot_s"]:
            tpot = f"{plain['mean_tpot_s'] * 1e3:.2f}/{spec['mean_tpot_s'] * 1e3:.2f}"
        lines.append(
            f"{r['batch']:5d}  {plain['output_tok_s']:11.1f}  {spec['output_tok_s']:10.1f}  "
            f"{r['speedup_tok_s']:6.2f}x  {tpot:>18}  "
            f"{'n/a' if rate is None else f'{rate:.0%}':>8}  "
            f"{r['num_identical_outputs']}/{r['num_requests']}"
        )
    return "\n".join(lines)


def format_vllm_results(results: list[dict[str, Any]]) -> str:
    """vLLM's two runs beside the engine's (``--compare vllm``)."""
    lines = ["batch  vLLM plain tok/s  vLLM spec tok/s  its speedup  accepted  ours/theirs"]
    for r in results:
        vllm = r["vllm"]
        rate = vllm["acceptance_rate"]
        lines.append(
            f"{r['batch']:5d}  {vllm['plain']['output_tok_s']:16.1f}  "
            f"{vllm['speculative']['output_tok_s']:15.1f}  {vllm['speedup_tok_s']:10.2f}x  "
            f"{'n/a' if rate is None else f'{rate:.0%}':>8}  {vllm['ratio']:10.2f}x"
        )
    return "\n".join(lines)
