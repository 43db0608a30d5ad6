"""Host-side cost of the two grammar libraries on one tokenizer: why pagestream uses llguidance.

For each library: the tokenizer's one-time setup, the time to make a matcher for a JSON schema
never seen before (the "compile"), and the time to fill one token bitmask at each step while
the matcher walks a valid output, token by token. Run on the CPU that would do this work next
to the GPU: ``python -m bench.grammar_libs --out grammar-libs.json`` (xgrammar must be
installed for its half; pagestream itself needs only llguidance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.records import machine_info

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
SAMPLE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@engine.org",
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
    "kind": "person",
}


def schema_variant(index: int) -> str:
    """SCHEMA with a distinct description: a cache miss every time."""
    return json.dumps({**SCHEMA, "description": f"variant {index}"})


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1000, value


def summary(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    return {
        "mean_ms": statistics.fmean(ordered),
        "p50_ms": ordered[len(ordered) // 2],
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": ordered[-1],
    }


def measure_llguidance(tokenizer: Any, tokens: list[int], num_schemas: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    setup_ms, ll_tokenizer = timed_ms(lambda: llguidance.hf.from_tokenizer(tokenizer))
    compile_ms = []
    for index in range(num_schemas):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_variant(index))
        start_s = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        elapsed = (time.perf_counter() - start_s) * 1000
        compile_ms.append(elapsed)
    mask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    fill_ms = []
    for token in tokens:
        elapsed, _ = timed_ms(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0))
        fill_ms.append(elapsed)
        assert matcher.consume_token(token), matcher.get_error()
    return {
        "version": version("llguidance"),
        "tokenizer_setup_ms": setup_ms,
        "compile": summary(compile_ms),
        "first_compile_ms": compile_ms[0],
        "mask_fill": summary(fill_ms),
        "num_tokens": len(tokens),
    }


def measure_xgrammar(tokenizer: Any, tokens: list[int], num_schemas: int) -> dict[str, Any]:
    import xgrammar

    setup_ms, info = timed_ms(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_ms = []
    for index in range(num_schemas):
        start_s = time.perf_counter()
        compiled = compiler.compile_json_schema(schema_variant(index))
        elapsed = (time.perf_counter() - start_s) * 1000
        compile_ms.append(elapsed)
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    fill_ms = []
    for token in tokens:
        elapsed, _ = timed_ms(lambda: matcher.fill_next_token_bitmask(mask, 0))
        fill_ms.append(elapsed)
        assert matcher.accept_token(token)
    return {
        "version": version("xgrammar"),
        "tokenizer_setup_ms": setup_ms,
        "compile": summary(compile_ms),
        "first_compile_ms": compile_ms[0],
        "mask_fill": summary(fill_ms),
        "num_tokens": len(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    parser.add_argument("--num-schemas", type=int, default=10, help="distinct schemas compiled")
    args = parser.parse_args()
    from engine.structured.tokenizers import bundled_tokenizer

    tokenizer = bundled_tokenizer()
    # one valid output, as compact JSON, tokenized the way a model could have produced it
    tokens = tokenizer.encode(json.dumps(SAMPLE, separators=(",", ":")), add_special_tokens=False)
    record: dict[str, Any] = {
        "kind": "grammar-libs",
        "machine": machine_info(None),
        "tokenizer": "SmolLM2-135M-Instruct (bundled GGUF), vocab 49152",
        "schema": SCHEMA,
        "results": {},
    }
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            record["results"][name] = measure(tokenizer, tokens, args.num_schemas)
        except ImportError as exc:
            record["results"][name] = {"error": f"not installed: {exc}"}
    text = json.dumps(record, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
