"""``bench matrix``'s workloads, by name: the same definitions for the engine and its peer.

Throughput rows count output tokens/s of random token-id prompts all submitted at once
(``bench/workloads.py``: EOS ignored, greedy, an untimed warm-up first); TPOT rows are one
batch of ``bench latency`` (128 in / 128 out). ``--scale F`` multiplies every count and length
(at least 1; an output at least 2) for a quick run of the whole matrix: its figures answer
"does it run", not "how fast".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.latency import LatencyWorkload
from bench.workloads import ThroughputWorkload
from engine.errors import ConfigError

STANDARD_LEN = (100, 1024)
LONG_CONTEXT_WARMUP_PROMPTS = 4  # 32k-token prompts: a few warm every kernel up
TOK_S_TARGET = 1.10  # the target: pagestream / peer output tok/s at least this
TPOT_TARGET = 0.91  # and pagestream / peer TPOT at most this


@dataclass(frozen=True)
class MatrixWorkload:
    """One row kind of the matrix: a throughput run or one latency batch (TPOT)."""

    name: str
    description: str
    throughput: ThroughputWorkload | None = None
    latency: LatencyWorkload | None = None
    extra: bool = False  # run only when named: not one of ``all`` (the matrix)

    @property
    def metric(self) -> str:
        """The figure the row compares: ``output_tok_s`` (higher is better) or ``tpot_s``."""
        return "tpot_s" if self.latency is not None else "output_tok_s"

    @property
    def longest_request_len(self) -> int:
        if self.latency is not None:
            return self.latency.input_len + self.latency.output_len
        assert self.throughput is not None
        return self.throughput.longest_request_len

    def scaled(self, scale: float, seed: int) -> MatrixWorkload:
        """The same shape with counts and lengths times ``scale``, prompts drawn from ``seed``."""
        if self.latency is not None:
            w = self.latency
            latency = LatencyWorkload(
                (_times(w.batch_sizes[0], scale),), _times(w.input_len, scale),
                max(2, _times(w.output_len, scale)), seed,
            )  # fmt: skip
            return dataclasses.replace(self, latency=latency)
        assert self.throughput is not None
        t = self.throughput
        throughput = dataclasses.replace(
            t,
            num_prompts=_times(t.num_prompts, scale),
            input_len=(_times(t.input_len[0], scale), _times(t.input_len[1], scale)),
            output_len=(_times(t.output_len[0], scale), _times(t.output_len[1], scale)),
            shared_prefix_len=_times(t.shared_prefix_len, scale) if t.shared_prefix_len else 0,
            num_shared_prefixes=min(t.num_shared_prefixes, _times(t.num_prompts, scale)),
            seed=seed,
        )
        return dataclasses.replace(self, throughput=throughput)


def _times(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def _throughput(
    name: str, description: str, num_prompts: int, input_len: tuple[int, int],
    output_len: tuple[int, int], *, extra: bool = False, **fields: int,
) -> MatrixWorkload:  # fmt: skip
    return MatrixWorkload(
        name,
        description,
        extra=extra,
        throughput=ThroughputWorkload(num_prompts, input_len, output_len, **fields),
    )


def _tpot(batch: int) -> MatrixWorkload:
    return MatrixWorkload(
        f"tpot-b{batch}",
        f"batch {batch}, 128 in / 128 out: time per output token",
        latency=LatencyWorkload((batch,), 128, 128),
    )


WORKLOADS: tuple[MatrixWorkload, ...] = (
    _throughput("standard-64", "in/out U[100,1024], 64 prompts", 64, STANDARD_LEN, STANDARD_LEN),
    _throughput("standard-256", "in/out U[100,1024], 256 prompts", 256, STANDARD_LEN, STANDARD_LEN),
    _throughput(
        "standard-1024", "in/out U[100,1024], 1024 prompts", 1024, STANDARD_LEN, STANDARD_LEN
    ),
    _throughput("prefill-heavy", "4096 in / 128 out, 256 prompts", 256, (4096, 4096), (128, 128)),
    _throughput("decode-heavy", "128 in / 1024 out, 1024 prompts", 1024, (128, 128), (1024, 1024)),
    _throughput(
        "shared-prefix",
        "a 2048-token system prompt shared by 256 prompts of 128 in / 256 out",
        256,
        (128, 128),
        (256, 256),
        shared_prefix_len=2048,
    ),
    _throughput(
        "shared-prefixes",
        "four 2048-token system prompts, each shared by 64 of 256 prompts of 128 in / 256 out",
        256,
        (128, 128),
        (256, 256),
        shared_prefix_len=2048,
        num_shared_prefixes=4,
        extra=True,
    ),
    _throughput(
        "long-context",
        "32768 in / 256 out, 32 prompts",
        32,
        (32768, 32768),
        (256, 256),
        num_warmup_prompts=LONG_CONTEXT_WARMUP_PROMPTS,
    ),
    _tpot(1),
    _tpot(64),
)
WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS if not w.extra)  # ``all``
EXTRA_WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS if w.extra)
MATRIX_ORDER = tuple(w.name for w in WORKLOADS)  # a record's rows, extras in their place


def parse_workload_names(text: str) -> tuple[str, ...]:
    """``all`` (the issue's matrix: every row but the extra ones) or a comma-separated list of
    names, in the matrix's order, each once."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return WORKLOAD_NAMES
    unknown = [name for name in names if name not in MATRIX_ORDER]
    if unknown or not names:
        raise ConfigError(
            f"unknown workload(s) {', '.join(unknown) or repr(text)}; choose from all or "
            + ", ".join(MATRIX_ORDER)
        )
    return tuple(name for name in MATRIX_ORDER if name in names)


def select_workloads(
    names: tuple[str, ...], *, seed: int = 0, scale: float = 1.0
) -> list[MatrixWorkload]:
    """The named workloads in the matrix's order, at ``scale``, prompts drawn from ``seed``."""
    if not 0 < scale <= 1:
        raise ConfigError(f"scale must be in (0, 1], got {scale}")
    chosen = parse_workload_names(",".join(names))
    return [w.scaled(scale, seed) for w in WORKLOADS if w.name in chosen]


def row_target(workload: MatrixWorkload) -> float:
    """The ratio each row must reach (TPOT rows: at most; throughput rows: at least)."""
    return TPOT_TARGET if workload.latency is not None else TOK_S_TARGET
