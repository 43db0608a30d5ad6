"""bench/mask_fill.py at a few rows: its record's shape, and that the masks its walk leads to,
filled on several threads, are each matcher's own single-threaded mask."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.mask_fill import SOURCES, Walk, make_grammars, run, token_paths
from engine.structured.grammars import GrammarCompiler
from engine.structured.masks import GrammarMasks

NUM_ROWS = 6


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_vocab_model: Path) -> Any:
    """SmolLM2's tokenizer, as saved beside the session's model (loads faster than the GGUF)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_vocab_model)


def test_the_record_has_a_fill_and_accept_time_per_source_and_thread_count(
    hf_tokenizer: Any,
) -> None:
    record = run(hf_tokenizer, NUM_ROWS, [1, 2], num_steps=2)
    assert record["kind"] == "mask-fill"
    assert {"cpu", "cpu_count", "torch"} <= record["machine"].keys()
    assert record["settings"]["num_rows"] == NUM_ROWS
    assert record["settings"]["vocab_size"] == len(hf_tokenizer)
    settings = [(r["source"], r["num_threads"]) for r in record["results"]]
    assert settings == [(source, n) for source in SOURCES for n in (1, 2)]
    for result in record["results"]:
        for timing in (result["fill_ms"], result["accept_ms"]):
            assert timing["p50"] > 0 and timing["mean"] > 0
        assert result["make_ms_per_matcher"] > 0


@pytest.mark.parametrize("source", SOURCES)
def test_masks_filled_on_threads_are_each_matchers_own(hf_tokenizer: Any, source: str) -> None:
    compiler = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), frozenset([0]))
    masks = GrammarMasks(compiler.vocab_size, torch.device("cpu"), num_threads=3)
    rng = random.Random(1)
    starts = [rng.randint(0, 40) for _ in range(NUM_ROWS)]
    walk = Walk(
        make_grammars(compiler, source, NUM_ROWS), token_paths(hf_tokenizer, NUM_ROWS, 41, 1)
    )
    walk.walk_to(masks, starts)
    rows = walk.rows()
    bitmask, row_index = masks.fill(rows)
    assert row_index.tolist() == list(range(NUM_ROWS))
    for row in rows:  # llguidance's own mask of one matcher, on this thread
        own = torch.frombuffer(bytearray(row.grammar.matcher.compute_bitmask()), dtype=torch.int32)
        assert torch.equal(bitmask[row.first_row], own[: masks.num_words])
    # places in strings, numbers and between keys allow different tokens
    assert len({tuple(mask.tolist()) for mask in bitmask}) > 1
