"""The benchmarks' workloads: random token-id prompts (no tokenizer needed, so ``dummy:<shape>``
models work) of uniformly drawn lengths, the same list for the same seed, and the warm-up run
shaped like them. The engine, the service benchmark and the vLLM peer all draw from here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError

NUM_WARMUP_PROMPTS = 64  # the untimed run before the measured one
WARMUP_OUTPUT_LEN = 8


@dataclass(frozen=True)
class ThroughputWorkload:
    """How many prompts, and the inclusive ranges their input and output lengths come from."""

    num_prompts: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError("num_prompts must be >= 1")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name} must be a range MIN-MAX with 1 <= MIN <= MAX")


@dataclass(frozen=True)
class BenchPrompt:
    token_ids: list[int]
    output_len: int


def make_random_prompts(workload: ThroughputWorkload, vocab_size: int) -> list[BenchPrompt]:
    """Prompts of uniform random lengths and token ids in [0, vocab_size); same seed, same list."""
    rng = np.random.default_rng(workload.seed)
    input_lens = rng.integers(
        workload.input_len[0], workload.input_len[1] + 1, workload.num_prompts
    )
    output_lens = rng.integers(
        workload.output_len[0], workload.output_len[1] + 1, workload.num_prompts
    )
    return [
        BenchPrompt(rng.integers(0, vocab_size, int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def warmup_prompts(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """A small run shaped like the measured one, so one-time costs stay out of the timing.

    Kernel variants compile at the first step that needs them: full prefill chunks, mixed
    steps with their varying decode counts, decode-only steps. The first prompts, reversed
    (the prefix cache cannot serve the timed run from them), a few output tokens each.
    """
    return [
        BenchPrompt(p.token_ids[::-1], min(p.output_len, WARMUP_OUTPUT_LEN))
        for p in prompts[:NUM_WARMUP_PROMPTS]
    ]
