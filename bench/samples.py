"""n > 1 against n separate requests: the prompt prefilled once, and what that buys.

The same work two ways on one engine: ``num_prompts`` random prompts asked for ``n`` samples
each (one request per prompt), then as many other prompts of the same length (none of them in
the prefix cache yet) sent as ``n`` separate requests each
(prefix caching on, as it is by default: the fair baseline, and how vLLM 0.26 runs ``n``).
Sampled at temperature 1 with EOS ignored, so every sample makes ``output_len`` tokens. Each
run records wall time, output tokens/s and the engine's ``num_prefill_tokens`` (prompt tokens
run through the forward). A correctness check first: greedy ``n`` samples equal one greedy
request, on this device's kernels and CUDA graphs.

``python -m bench.samples --model dummy:qwen3-0.6b --out samples.json``
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.records import machine_info
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def run_samples(
    engine: LLMEngine, num_prompts: int, input_len: int, output_len: int, n: int
) -> dict[str, Any]:
    """The benchmark record (see the module)."""
    rng = random.Random(0)
    vocab_size = engine.loaded.arch.vocab_size

    def random_prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(count)]

    # three sets: a run must not find the prompts of the one before in the prefix cache
    warmup, prompts, others = (
        random_prompts(4),
        random_prompts(num_prompts),
        random_prompts(num_prompts),
    )
    check = _greedy_check(engine, warmup[0], n)
    sampled: dict[str, Any] = dict(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    _timed(engine, [(p, SamplingParams(**sampled, n=n, seed=i)) for i, p in enumerate(warmup)])
    together = _timed(engine, [(p, SamplingParams(**sampled, n=n, seed=i))
                               for i, p in enumerate(prompts)])  # fmt: skip
    separate = _timed(engine, [(p, SamplingParams(**sampled, seed=i * n + k))
                               for i, p in enumerate(others) for k in range(n)])  # fmt: skip
    return {
        "kind": "samples",
        "machine": machine_info(engine.device),
        "settings": {
            "model": engine.config.model,
            "num_prompts": num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "n": n,
        },
        "greedy_samples_equal_one_request": check,
        "n_per_request": together,
        "separate_requests": separate,
        "speedup": separate["wall_s"] / together["wall_s"],
    }


def _greedy_check(engine: LLMEngine, prompt: list[int], n: int) -> bool:
    greedy: dict[str, Any] = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    one = _outputs(engine, [(prompt, SamplingParams(**greedy))])
    many = _outputs(engine, [(prompt, SamplingParams(**greedy, n=n))])
    return all(tokens == one[(0, 0)] for tokens in many.values()) and len(many) == n


def _outputs(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]
) -> dict[tuple[int, int], list[int]]:
    """(request, sample) -> token ids, after running ``requests`` to the end."""
    ids = {
        engine.add_request(prompt_token_ids=p, sampling=s): i for i, (p, s) in enumerate(requests)
    }
    tokens: dict[tuple[int, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((ids[out.request_id], out.index), []).extend(out.new_token_ids)
    return tokens


def _timed(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    prefill_before = engine.stats().num_prefill_tokens
    start_s = time.perf_counter()
    tokens = _outputs(engine, requests)
    wall_s = time.perf_counter() - start_s
    num_output = sum(len(t) for t in tokens.values())
    return {
        "num_requests": len(requests),
        "wall_s": wall_s,
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / wall_s,
        "prefill_tokens": engine.stats().num_prefill_tokens - prefill_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model))
    record = run_samples(engine, args.num_prompts, args.input_len, args.output_len, args.n)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
