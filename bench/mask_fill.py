"""Host time to fill one decode step's token bitmasks, through the engine's ``GrammarMasks``.

``python -m bench.mask_fill --out mask-fill.json`` builds ``--num-rows`` (256) matchers for
``bench.structured.LONG_SCHEMA`` on SmolLM2's tokenizer (``PAGESTREAM_SMOLLM2_TOKENIZER`` names
a saved copy; ``--tokenizer DIR`` another, e.g. Qwen3's), walks each to its own place in a valid
output of random records (inside a string, a number, between keys) with the engine's loop
(fill the masks, accept one token each), then times ``--num-steps`` more such steps for each
llguidance thread count and each way of making the matchers:

- ``shared``: copies of one compiled matcher (``LLMatcher.deep_copy``), as the engine made them
  before: llguidance's Python ``deep_copy`` is a shallow clone, so every copy shares one lexer
  behind one mutex, and a mask holds that mutex while it is computed.
- ``own``: a matcher compiled per request from the cached grammar (``GrammarCompiler``'s way
  now): each has its own lexer, and the masks are filled in parallel.

Per step it records the fill (``GrammarMasks.fill``) and the accepting of the step's tokens
(``GrammarMatcher.accept`` per row, as ``OutputProcessor`` does), p50 and mean in ms.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from bench.records import machine_info, utc_now
from bench.structured import LONG_SCHEMA
from engine.structured.grammars import GrammarCompiler, GrammarMatcher
from engine.structured.masks import GrammarMasks, MaskedRow
from engine.structured.params import StructuredOutputs

SOURCES = ("shared", "own")
DEFAULT_THREADS = (1, 2, 4, 8, 12, 16)
NAME_WORDS = ("ada", "bo", "cy", "dee", "eli", "fox", "gus", "hal", "ivy", "jo", "kai", "lu")
KINDS = ("alpha", "beta", "gamma")
MAX_START = 160  # tokens into its output a row may stand when the timed steps begin


def random_output(rng: random.Random, num_records: int) -> str:
    """Compact JSON valid under ``LONG_SCHEMA`` (its first records, at least)."""
    records = [
        {
            "id": rng.randrange(100_000),
            "name": " ".join(rng.choice(NAME_WORDS) for _ in range(rng.randint(1, 3)))[:12],
            "ok": rng.random() < 0.5,
            "kind": rng.choice(KINDS),
        }
        for _ in range(num_records)
    ]
    return json.dumps({"records": records}, separators=(",", ":"))


def token_paths(tokenizer: Any, num_rows: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Per row, the first ``num_tokens`` tokens of a random valid output."""
    rng = random.Random(seed)
    paths = []
    for _ in range(num_rows):
        ids = tokenizer.encode(random_output(rng, num_tokens // 4 + 4), add_special_tokens=False)
        assert len(ids) >= num_tokens, "an output shorter than the walk"
        paths.append(ids[:num_tokens])
    return paths


def make_grammars(compiler: GrammarCompiler, source: str, num_rows: int) -> list[GrammarMatcher]:
    schema = StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA))
    if source == "own":
        return [compiler.matcher_for(schema) for _ in range(num_rows)]
    template = compiler.matcher_for(schema)
    return [GrammarMatcher(template.matcher.deep_copy()) for _ in range(num_rows)]


class Walk:
    """Rows advancing along their token paths, each from its own start, step by step."""

    def __init__(self, grammars: list[GrammarMatcher], paths: list[list[int]]) -> None:
        self.grammars = grammars
        self.paths = paths
        self.positions = [0] * len(grammars)

    def rows(self, active: list[bool] | None = None) -> list[MaskedRow]:
        return [
            MaskedRow(row, grammar, [])
            for row, grammar in enumerate(self.grammars)
            if active is None or active[row]
        ]

    def accept(self, active: list[bool] | None = None) -> None:
        """Each (active) row takes its next token, as the output processor does."""
        for row, grammar in enumerate(self.grammars):
            if active is None or active[row]:
                assert grammar.accept(self.paths[row][self.positions[row]]), "off the grammar"
                self.positions[row] += 1

    def walk_to(self, masks: GrammarMasks, starts: list[int]) -> None:
        """Fill and accept until row i stands ``starts[i]`` tokens in: its lexer has seen what
        an engine's would have by then."""
        for step in range(max(starts)):
            active = [step < start for start in starts]
            masks.fill(self.rows(active))
            self.accept(active)


def time_steps(masks: GrammarMasks, walk: Walk, num_steps: int) -> dict[str, Any]:
    """``num_steps`` engine steps: accept the previous step's tokens, then fill."""
    fill_ms, accept_ms = [], []
    for _ in range(num_steps):
        accept_ms.append(timed_ms(walk.accept))
        rows = walk.rows()
        fill_ms.append(timed_ms(functools.partial(masks.fill, rows)))
    return {"fill_ms": summary_ms(fill_ms), "accept_ms": summary_ms(accept_ms)}


def measure(
    compiler: GrammarCompiler,
    paths: list[list[int]],
    starts: list[int],
    source: str,
    num_threads: int,
    num_steps: int,
) -> dict[str, Any]:
    masks = GrammarMasks(compiler.vocab_size, torch.device("cpu"), num_threads=num_threads)
    start_s = time.perf_counter()
    grammars = make_grammars(compiler, source, len(paths))
    make_ms = (time.perf_counter() - start_s) * 1000 / len(paths)
    walk = Walk(grammars, paths)
    walk.walk_to(masks, starts)
    return {
        "source": source,
        "num_threads": num_threads,
        "make_ms_per_matcher": make_ms,  # a request's cost at admission, off the step's path
        **time_steps(masks, walk, num_steps),
    }


def run(
    hf_tokenizer: Any,
    num_rows: int,
    threads: list[int],
    num_steps: int,
    seed: int = 0,
    sources: tuple[str, ...] = SOURCES,
) -> dict[str, Any]:
    eos = hf_tokenizer.eos_token_id
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), frozenset([eos]))
    max_start = min(MAX_START, 8 * num_steps)
    rng = random.Random(seed)
    starts = [rng.randint(0, max_start) for _ in range(num_rows)]
    paths = token_paths(hf_tokenizer, num_rows, max_start + num_steps, seed)
    results = [
        measure(compiler, paths, starts, source, num_threads, num_steps)
        for source in sources
        for num_threads in threads
    ]
    return {
        "kind": "mask-fill",
        "created_utc": utc_now(),
        "machine": machine_info("cpu"),
        "settings": {
            "num_rows": num_rows,
            "num_steps": num_steps,
            "vocab_size": compiler.vocab_size,
            "tokenizer": getattr(hf_tokenizer, "name_or_path", None),
            "llguidance": version("llguidance"),
            "schema": LONG_SCHEMA,
            "seed": seed,
        },
        "results": results,
    }


def timed_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds ``fn()`` took."""
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1000


def summary_ms(values_ms: list[float]) -> dict[str, float]:
    """p50 and mean of per-step times."""
    return {"p50": statistics.median(values_ms), "mean": statistics.fmean(values_ms)}


def _threads(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-rows", type=int, default=256, help="constrained rows a step")
    parser.add_argument("--num-steps", type=int, default=32, help="timed steps per setting")
    parser.add_argument("--threads", type=_threads, default=list(DEFAULT_THREADS))
    parser.add_argument("--sources", default=",".join(SOURCES), help="shared, own or both")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from engine.structured.tokenizers import bundled_tokenizer

        hf_tokenizer = bundled_tokenizer()
    sources = tuple(args.sources.split(","))
    record = run(hf_tokenizer, args.num_rows, args.threads, args.num_steps, sources=sources)
    for result in record["results"]:
        fill, accept = result["fill_ms"], result["accept_ms"]
        print(f"{result['source']:>6} threads {result['num_threads']:>2}: fill p50 "
              f"{fill['p50']:.2f} ms mean {fill['mean']:.2f}; accept p50 {accept['p50']:.2f} ms")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
