"""Structured outputs on the GPU: the standard throughput workload with every request under a
JSON schema, against the same prompts unconstrained in the same run, then a validity check.

``python -m bench.structured --model dummy:qwen3-0.6b --out $OUT/structured-qwen3-0.6b.json``

1. Throughput: 256 random-token prompts, 100-1024 tokens in and out, greedy, all at once;
   first unconstrained (ignore EOS), then each under ``LONG_SCHEMA``: an object holding at
   least ``MIN_RECORDS`` records, longer than any output, so both runs put out the same tokens
   and differ only by the masks (filled on the host while the GPU runs, applied on the GPU).
   The record holds both runs, their ratio and the host time spent filling masks.
   ``--repeat N`` runs N such pairs one after another (each run on prompts of its own) and
   records each pair's ratio and their median: where the host sets the pace, one pair's
   ratio moves from run to run by more than the gaps worth measuring.
2. Validity: ``NUM_CHECKED`` requests (greedy and sampled) under the bounded ``CHECK_SCHEMA``;
   every output must parse and validate (CUDA graphs, asynchronous scheduling and the Triton
   mask kernel are the engine's defaults on CUDA).

``--compare-vllm`` runs the same workload through vLLM in a subprocess, unconstrained and under
the same schema (``bench/vllm_peer.py --json-schema``), and records both beside the engine's.

A ``dummy:`` model has no tokenizer: SmolLM2's (bundled) maps its first 49,152 ids to text, and
the masks forbid the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.records import machine_info, utc_now
from bench.throughput import _measure, resolved_settings
from bench.workloads import BenchPrompt, ThroughputWorkload, make_random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputs
from engine.structured.grammars import GrammarCompiler
from engine.structured.tokenizers import bundled_tokenizer

PROFILE_ROWS = 128  # the decode batch --profile-steps profiles

MIN_RECORDS = 80  # ~20 tokens each: past the workload's 1024 output tokens
RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["id", "name", "ok", "kind"],
    "additionalProperties": False,
}
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": MIN_RECORDS, "items": RECORD}},
    "required": ["records"],
    "additionalProperties": False,
}
CHECK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "maxItems": 3, "items": RECORD}},
    "required": ["records"],
    "additionalProperties": False,
}
NUM_CHECKED = 64
CHECK_MAX_TOKENS = 256


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=_range, default=(100, 1024), help="MIN-MAX tokens")
    parser.add_argument("--output-len", type=_range, default=(100, 1024), help="MIN-MAX tokens")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present) or cpu")
    parser.add_argument("--compare-vllm", action="store_true", help="vLLM on the same runs")
    parser.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer directory for a dummy: model (default SmolLM2's)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then profile this many decode steps of 128 rows, unconstrained and constrained: "
        "the ops by device time per step, in the record and printed (0: none)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="pairs of timed runs (unconstrained, then constrained); the ratio is their median",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    workload = ThroughputWorkload(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    # vLLM first, in its subprocesses: the engine then has the GPU to itself
    vllm = _vllm_runs(args, workload) if args.compare_vllm else None
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device))
    tokenizer = _grammar_tokenizer(engine, args.tokenizer)
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    pairs = _engine_runs(engine, prompts, args.repeat)
    free, constrained = pairs[0]  # the first pair in full; each pair's figures in "pairs"
    summaries = [_pair_summary(f, c) for f, c in pairs]
    ratios = [summary["output_tok_s_ratio"] for summary in summaries]
    record: dict[str, Any] = {
        "kind": "structured",
        "created_utc": utc_now(),
        "machine": machine_info(engine.device),
        "settings": {
            **dataclasses.asdict(engine.config),
            **dataclasses.asdict(workload),
            "resolved": resolved_settings(engine),
            "schema": LONG_SCHEMA,
        },
        "results": {
            "unconstrained": free,
            "json_schema": constrained,
            # the median of the pairs' ratios (one pair: its ratio)
            "output_tok_s_ratio": statistics.median(ratios),
            "pairs": summaries,
            "validity": _check_validity(engine, tokenizer),
        },
    }
    if args.profile_steps > 0:
        record["results"]["decode_profile"] = _profiles(engine, prompts, args.profile_steps)
    if vllm is not None:
        record["results"]["vllm"] = vllm
        record["results"]["vs_vllm_json_schema"] = (
            statistics.median(c["output_tok_s"] for _, c in pairs)
            / vllm["output_tok_s"]["json_schema"]
        )
    text = json.dumps(record, indent=2)
    summary = {k: record["results"][k] for k in ("output_tok_s_ratio", "validity")}
    print(json.dumps(summary, indent=2))
    for summary in summaries:
        print(f"unconstrained {summary['unconstrained_tok_s']:.0f} out tok/s, json_schema "
              f"{summary['json_schema_tok_s']:.0f} ({summary['mask_fill_ms_per_step']:.2f} ms "
              f"mask fill per step, {summary['mask_wait_ms_per_step']:.2f} waited for)")  # fmt: skip
    if len(pairs) > 1:
        print(f"ratio: median {statistics.median(ratios):.3f} of {len(pairs)} pairs "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip
    if args.out is not None:
        args.out.write_text(text + "\n")


def _engine_runs(
    engine: LLMEngine, prompts: list[BenchPrompt], repeat: int = 1
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``repeat`` pairs of timed runs of ``prompts``: unconstrained, then under
    ``LONG_SCHEMA``. Each run takes the prompts rotated by a count of its own (the same
    lengths, other tokens): an earlier run's prompts, and its warm-up's (reversed), are in
    the prefix cache and would spare a later run their prefill."""
    long_schema = StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA))
    engine.grammars.matcher_for(long_schema)  # the tokenizer's grammar view, once (~1 s)
    masks = engine.runner.grammar_masks
    pairs = []
    for index in range(repeat):
        free = _measure(engine, _rotated_prompts(prompts, 2 * index), use_tqdm=False)
        fill_s_before, wait_s_before, fills_before = masks.fill_s, masks.wait_s, masks.num_fills
        constrained = _measure(
            engine, _rotated_prompts(prompts, 2 * index + 1), use_tqdm=False,
            structured=long_schema,
        )  # fmt: skip
        num_fills = max(masks.num_fills - fills_before, 1)
        constrained["mask_fill_ms_per_step"] = (masks.fill_s - fill_s_before) * 1000 / num_fills
        # the part of the fill that the step waited for (the rest overlapped its other work)
        constrained["mask_wait_ms_per_step"] = (masks.wait_s - wait_s_before) * 1000 / num_fills
        pairs.append((free, constrained))
    return pairs


def _pair_summary(free: dict[str, Any], constrained: dict[str, Any]) -> dict[str, Any]:
    return {
        "unconstrained_tok_s": free["output_tok_s"],
        "json_schema_tok_s": constrained["output_tok_s"],
        "output_tok_s_ratio": constrained["output_tok_s"] / free["output_tok_s"],
        "mask_fill_ms_per_step": constrained["mask_fill_ms_per_step"],
        "mask_wait_ms_per_step": constrained["mask_wait_ms_per_step"],
    }


def _rotated_prompts(prompts: list[BenchPrompt], by: int) -> list[BenchPrompt]:
    return [BenchPrompt(_rotated(p.token_ids, by), p.output_len) for p in prompts]


def _rotated(token_ids: list[int], by: int = 1) -> list[int]:
    """The same tokens, another prompt: the first ``by`` moved to the end, so the prefix
    cache holds none of its pages from a run on another rotation."""
    by %= len(token_ids)
    return token_ids[by:] + token_ids[:by]


def _profiles(
    engine: LLMEngine, prompts: list[BenchPrompt], steps: int, rows: int = PROFILE_ROWS
) -> dict[str, Any]:
    """A decode window of ``rows`` of the prompts, profiled unconstrained then under
    ``LONG_SCHEMA`` (other tokens: the first is in the prefix cache), printed as it goes."""
    from bench.step_kernels import format_profile, profile_decode_steps

    batch = [prompt.token_ids for prompt in prompts[:rows]]
    long_schema = StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA))
    profiles = {
        "unconstrained": profile_decode_steps(engine, batch, steps),
        "json_schema": profile_decode_steps(
            engine, [_rotated(ids) for ids in batch], steps, long_schema
        ),
    }
    for name, profile in profiles.items():
        print(format_profile(name, profile))
    return profiles


def _vllm_runs(args: argparse.Namespace, workload: ThroughputWorkload) -> dict[str, Any]:
    """vLLM's output tok/s on the same prompts, unconstrained and under ``LONG_SCHEMA``."""
    import tempfile

    from bench.vllm_peer import run_vllm_peer, throughput_peer_args

    peer_args = throughput_peer_args(EngineConfig(model=args.model), [workload])
    runs = {"unconstrained": run_vllm_peer("throughput", peer_args)}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as schema_file:
        schema_file.write(json.dumps(LONG_SCHEMA))
        schema_file.flush()
        runs["json_schema"] = run_vllm_peer(
            "throughput", [*peer_args, "--json-schema", schema_file.name]
        )
    rates = {name: run["results"][0]["output_tok_s"] for name, run in runs.items()}
    return {**runs, "output_tok_s": rates}


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _grammar_tokenizer(engine: LLMEngine, directory: str | None) -> Any:
    """The model's tokenizer, or for a ``dummy:`` model ``directory``'s or SmolLM2's (set on
    its grammar compiler)."""
    if engine.tokenizer is not None:
        return engine.tokenizer
    if directory is None:
        tokenizer = bundled_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
    eos = frozenset([tokenizer.eos_token_id])
    engine.grammars = GrammarCompiler(tokenizer, engine.loaded.arch.vocab_size, eos)
    return tokenizer


def _check_validity(engine: LLMEngine, tokenizer: Any) -> dict[str, Any]:
    """Every output of ``NUM_CHECKED`` requests under ``CHECK_SCHEMA`` parses and validates."""
    import jsonschema

    check = StructuredOutputs(json_schema=json.dumps(CHECK_SCHEMA))
    for index in range(NUM_CHECKED):
        sampling = SamplingParams(
            max_tokens=CHECK_MAX_TOKENS, temperature=(0.0, 0.7, 1.0)[index % 3], seed=index,
            structured=check,
        )  # fmt: skip
        engine.add_request(f"check-{index}", prompt_token_ids=[5 + index, 7, 11], sampling=sampling)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason.value
    failures = []
    for request_id, ids in tokens.items():
        text = tokenizer.decode(
            [i for i in ids if i not in engine.eos_token_ids | {tokenizer.eos_token_id}]
        )
        try:
            jsonschema.validate(json.loads(text), CHECK_SCHEMA)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"id": request_id, "text": text[:200], "error": str(exc)[:200]})
    return {
        "num_requests": NUM_CHECKED,
        "num_valid": NUM_CHECKED - len(failures),
        "finish_reasons": {r: list(reasons.values()).count(r) for r in set(reasons.values())},
        "elapsed_s": time.perf_counter() - start_s,
        "failures": failures[:5],
    }


if __name__ == "__main__":
    main()
