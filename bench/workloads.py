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
    """How many prompts, and the inclusive ranges their input and output lengths come from.

    ``shared_prefix_len`` tokens (one random run, the same for every prompt: a system prompt)
    go before each prompt's own ``input_len`` tokens; with ``num_shared_prefixes`` N, there are
    N such runs (the system prompts of N tenants), prompt i taking run i mod N.
    ``num_warmup_prompts`` caps the untimed run (a few 32k-token prompts warm every kernel up;
    64 of them would double the run).
    """

    num_prompts: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    seed: int = 0
    shared_prefix_len: int = 0
    num_warmup_prompts: int = NUM_WARMUP_PROMPTS
    num_shared_prefixes: int = 1

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError("num_prompts must be >= 1")
        if self.shared_prefix_len < 0 or self.num_warmup_prompts < 1:
            raise ConfigError("shared_prefix_len must be >= 0 and num_warmup_prompts >= 1")
        if self.num_shared_prefixes < 1:
            raise ConfigError("num_shared_prefixes must be >= 1")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name} must be a range MIN-MAX with 1 <= MIN <= MAX")

    @property
    def longest_request_len(self) -> int:
        """Prompt and output tokens of the longest request the workload can draw."""
        return self.shared_prefix_len + self.input_len[1] + self.output_len[1]


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
    prompts = [
        BenchPrompt(rng.integers(0, vocab_size, int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]
    if workload.shared_prefix_len:  # drawn last: the prompts' own tokens stay as without it
        prefixes = [
            rng.integers(0, vocab_size, workload.shared_prefix_len).tolist()
            for _ in range(workload.num_shared_prefixes)
        ]
        prompts = [
            BenchPrompt(prefixes[i % len(prefixes)] + p.token_ids, p.output_len)
            for i, p in enumerate(prompts)
        ]
    return prompts


def warmup_prompts(
    prompts: list[BenchPrompt], num_prompts: int = NUM_WARMUP_PROMPTS
) -> list[BenchPrompt]:
    """A small run shaped like the measured one, so one-time costs stay out of the timing.

    Kernel variants compile at the first step that needs them: full prefill chunks, mixed
    steps with their varying decode counts, decode-only steps. The first prompts, reversed
    (the prefix cache cannot serve the timed run from them, a shared prefix included), a few
    output tokens each.
    """
    return [
        BenchPrompt(p.token_ids[::-1], min(p.output_len, WARMUP_OUTPUT_LEN))
        for p in prompts[:num_prompts]
    ]
