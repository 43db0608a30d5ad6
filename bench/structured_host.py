"""Host time of a constrained decode step, part by part, on the CPU: the engine's own code
(``OutputProcessor.append_all`` with the grammars taking their tokens, ``GrammarMasks.start``
and ``apply``) for ``--num-rows`` (256) rows under ``bench.structured.LONG_SCHEMA`` with
SmolLM2's tokenizer, each row at its own place in a valid output, against the same steps
without grammars.

``python -m bench.structured_host --out structured-host.json``

Each timed step is what the engine's thread does for a step with asynchronous scheduling,
once the step's forward is launched: the previous step's tokens go through ``append_all``
(the grammars take them, the next masks start filling on their thread, then the text and stop
checks), then ``apply`` waits for the masks and hands them to the device. Only the device's
part is left out: the mask kernel (``apply_token_bitmask_ref`` on the CPU, a Triton kernel on
CUDA) and the sampling are not called, so the times are the host's alone. Parts:

- ``grammar_ends``: the grammars take their tokens and say whether they ended;
- ``start``: ``GrammarMasks.start``: ``masked_rows`` (the rows to mask), ``prepare`` (their
  buffers and llguidance's arguments), and the hand-off to the fill's thread;
- ``rest``: the rest of ``append_all`` (detokenizing, stop checks), as in an unconstrained step;
- ``wait``: ``apply`` waiting for the fill; ``apply_host``: the rest of ``apply``;
- ``fill``: the fill on its thread (beside ``rest``; its unhidden part is ``wait``).

``first_fill_ms``: one fill of fresh matchers (a step's first masks after prefill).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

import engine.structured.masks as masks_module
from bench.mask_fill import summary_ms, timed_ms, token_paths
from bench.records import machine_info, utc_now
from bench.structured import LONG_SCHEMA
from engine.detokenizer import IncrementalDetokenizer
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus
from engine.step_types import SampledToken
from engine.structured.grammars import GrammarCompiler
from engine.structured.masks import GrammarMasks, MaskedRow
from engine.structured.params import StructuredOutputs

PROMPT = "Give the records as JSON:"
MAX_START = 48  # tokens into its output a row may stand when the timed steps begin
NUM_WARMUP_STEPS = 2
PARTS = (
    "grammar_ends", "start", "masked_rows", "prepare", "rest", "wait", "apply_host", "total",
    "fill",
)  # fmt: skip


class _Finisher:
    """The scheduler's part in ``OutputProcessor``: an ended sequence is marked finished."""

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


class _Timer:
    """Wraps methods and functions so that each call adds its time to a named part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start_s = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start_s

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, defaultdict(float)
        return seconds


@contextmanager
def _instrumented(timer: _Timer) -> Iterator[None]:
    """Time the parts of a step; the device's mask kernel is not run (host time only)."""
    saved = {
        (OutputProcessor, "_grammar_ends"): OutputProcessor._grammar_ends,
        (GrammarMasks, "start"): GrammarMasks.start,
        (GrammarMasks, "_take_pending"): GrammarMasks._take_pending,
        (GrammarMasks, "apply"): GrammarMasks.apply,
        (GrammarMasks, "_prepare"): GrammarMasks._prepare,
        (masks_module, "masked_rows"): masks_module.masked_rows,
        (masks_module, "apply_token_bitmask_ref"): masks_module.apply_token_bitmask_ref,
    }
    try:
        timer.wrap(OutputProcessor, "_grammar_ends", "grammar_ends")
        timer.wrap(GrammarMasks, "start", "start")
        timer.wrap(GrammarMasks, "_take_pending", "wait")
        timer.wrap(GrammarMasks, "apply", "apply")
        timer.wrap(GrammarMasks, "_prepare", "prepare")  # within start
        timer.wrap(masks_module, "masked_rows", "masked_rows")  # within start
        masks_module.apply_token_bitmask_ref = lambda *args: None
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


class HostSteps:
    """``num_rows`` sequences (with grammars or without) stepping along their token paths."""

    def __init__(
        self, tokenizer: Any, grammars: list[Any], paths: list[list[int]], masks: GrammarMasks
    ) -> None:
        prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
        self.paths = paths
        self.masks = masks
        self.seqs = [
            Sequence(f"r{row}", prompt_ids, SamplingParams(), 0.0, grammar=grammar)
            for row, grammar in enumerate(grammars)
        ]
        for seq in self.seqs:
            seq.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
            seq.output_token_ids.append(PENDING_TOKEN)  # the step in flight's pick
            seq.num_pending_tokens = 1
        self.outputs = OutputProcessor(_Finisher(), lambda seq: None, masks.accept_tokens)  # type: ignore[arg-type]
        self.logits = torch.zeros(len(grammars), 1)  # the kernel is not run: no vocabulary

    def walk_to(self, starts: list[int]) -> None:
        """Take tokens (and fill masks) until row i stands ``starts[i]`` tokens in."""
        for step in range(max(starts, default=0)):
            rows = [
                MaskedRow(row, seq.grammar, [])
                for row, seq in enumerate(self.seqs)
                if step < starts[row] and seq.grammar is not None
            ]
            self.masks.fill(rows)
            for row, seq in enumerate(self.seqs):
                if step < starts[row] and seq.grammar is not None:
                    assert seq.grammar.accept(self.paths[row][step]), "off the grammar"
        self.positions = list(starts)

    def step(self) -> None:
        """One engine step: the next step is launched (each row gets a pending pick), then
        the previous step's picks are taken in and the next step's masks applied."""
        entries = [ScheduledSeq(seq, 1) for seq in self.seqs if not seq.is_finished]
        drafts: list[ScheduledSeq] = []  # the launched step's own list, as the engine's
        for entry in entries:
            entry.seq.output_token_ids.append(PENDING_TOKEN)
            entry.seq.num_pending_tokens += 1
        tokens = [
            SampledToken(seq, self.paths[row][self.positions[row]], None)
            for row, seq in enumerate(self.seqs)
        ]
        self.positions = [position + 1 for position in self.positions]
        constrained = any(seq.grammar is not None for seq in self.seqs)
        start_fill = functools.partial(self.masks.start, entries, drafts) if constrained else None
        self.outputs.append_all(tokens, start_fill)
        if constrained:
            self.masks.apply(self.logits, entries, drafts)


def time_steps(host: HostSteps, timer: _Timer, num_steps: int) -> dict[str, Any]:
    """Per step: the parts' milliseconds (p50 and mean)."""
    per_part: dict[str, list[float]] = defaultdict(list)
    masks = host.masks
    with _instrumented(timer):
        for _ in range(num_steps):
            fill_before = masks.fill_s
            timer.take()
            start_s = time.perf_counter()
            host.step()
            total_s = time.perf_counter() - start_s
            seconds = timer.take()
            seconds["total"] = total_s
            seconds["fill"] = masks.fill_s - fill_before
            seconds["apply_host"] = seconds["apply"] - seconds["wait"]
            seconds["rest"] = total_s - sum(seconds[p] for p in ("grammar_ends", "start", "apply"))
            for part in PARTS:
                per_part[part].append(seconds.get(part, 0.0) * 1000)
    return {part: summary_ms(values) for part, values in per_part.items()}


def run(
    hf_tokenizer: Any, num_rows: int, num_steps: int, num_threads: int, seed: int = 0
) -> dict[str, Any]:
    eos = frozenset([hf_tokenizer.eos_token_id])
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), eos)
    schema = StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA))
    compiler.matcher_for(schema)  # the tokenizer's grammar view (~1 s), off the timings
    rng = random.Random(seed)
    starts = [rng.randint(0, MAX_START) for _ in range(num_rows)]
    paths = token_paths(hf_tokenizer, num_rows, MAX_START + num_steps + NUM_WARMUP_STEPS, seed)
    results = {}
    for name in ("unconstrained", "json_schema"):
        masks = GrammarMasks(compiler.vocab_size, torch.device("cpu"), num_threads=num_threads)
        start_s = time.perf_counter()
        grammars = [
            compiler.matcher_for(schema) if name == "json_schema" else None for _ in range(num_rows)
        ]
        make_ms = (time.perf_counter() - start_s) * 1000
        prebuilt_ms = 0.0
        if name == "json_schema":
            prebuilt_ms = timed_ms(functools.partial(_prebuilt, compiler, schema, num_rows))
        host = HostSteps(hf_tokenizer, grammars, paths, masks)
        first_fill_ms = timed_ms(functools.partial(masks.fill, _fresh_rows(host)))
        host.walk_to(starts)
        timer = _Timer()
        time_steps(host, timer, NUM_WARMUP_STEPS)
        results[name] = {
            "make_matchers_ms": make_ms,  # one after another, as requests are added
            # made ahead on threads (``prebuild``, as ``LLM.generate`` does), then handed out
            "make_matchers_prebuilt_ms": prebuilt_ms,
            "first_fill_ms": first_fill_ms if name == "json_schema" else 0.0,
            "parts_ms": time_steps(host, timer, num_steps),
        }
    return {
        "kind": "structured-host-path",
        "created_utc": utc_now(),
        "machine": machine_info("cpu"),
        "settings": {
            "num_rows": num_rows,
            "num_steps": num_steps,
            "num_fill_threads": num_threads,
            "vocab_size": compiler.vocab_size,
            "llguidance": version("llguidance"),
            "schema": LONG_SCHEMA,
            "seed": seed,
        },
        "results": results,
    }


def _prebuilt(compiler: GrammarCompiler, schema: StructuredOutputs, num_rows: int) -> None:
    compiler.prebuild([schema] * num_rows)
    for _ in range(num_rows):
        compiler.matcher_for(schema)


def _fresh_rows(host: HostSteps) -> list[MaskedRow]:
    return [
        MaskedRow(row, seq.grammar, [])
        for row, seq in enumerate(host.seqs)
        if seq.grammar is not None
    ]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-rows", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--threads", type=int, default=2, help="llguidance fill threads")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = parser.parse_args()
    from engine.structured.tokenizers import bundled_tokenizer

    record = run(bundled_tokenizer(), args.num_rows, args.num_steps, args.threads)
    for name, result in record["results"].items():
        parts = result["parts_ms"]
        print(f"{name:>13}: " + ", ".join(f"{p} {parts[p]['p50']:.3f}" for p in PARTS)
              + f" ms/step (p50); first fill {result['first_fill_ms']:.1f} ms")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
