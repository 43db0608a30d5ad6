"""bench/structured_host.py at a few rows: every part of a constrained step is timed, and the
unconstrained run has no grammar work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.structured_host import PARTS, run


def test_the_record_times_each_part_of_a_constrained_step(smollm2_vocab_model: Path) -> None:
    from transformers import AutoTokenizer

    hf_tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_vocab_model)
    record = run(hf_tokenizer, num_rows=4, num_steps=2, num_threads=2)
    assert record["kind"] == "structured-host-path"
    free, constrained = record["results"]["unconstrained"], record["results"]["json_schema"]
    assert set(constrained["parts_ms"]) == set(PARTS)
    for part in ("grammar_ends", "start", "masked_rows", "prepare", "fill", "total"):
        assert constrained["parts_ms"][part]["p50"] > 0, part
    for part in ("start", "wait", "fill"):
        assert free["parts_ms"][part]["p50"] == 0, part
    assert constrained["first_fill_ms"] > 0 and constrained["make_matchers_ms"] > 0
