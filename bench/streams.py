"""What a streaming client measures of each request, and the run's summary of them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StreamTiming:
    """One request seen by its client: seconds from submit to first and last token."""

    ttft_s: float
    last_s: float
    num_tokens: int

    @property
    def tpot_s(self) -> float | None:
        return (self.last_s - self.ttft_s) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def summarize(timings: list[StreamTiming], elapsed_s: float) -> dict[str, Any]:
    """Throughput and TTFT/TPOT percentiles of a run."""
    from bench.records import percentiles

    num_tokens = sum(t.num_tokens for t in timings)
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(timings),
        "output_tokens": num_tokens,
        "output_tok_s": num_tokens / elapsed_s,
        "ttft_s": percentiles([t.ttft_s for t in timings]),
        "tpot_s": percentiles(tpots),
    }
