"""``/metrics``: the gateway's own counters in Prometheus' text format (version 0.0.4).

Hand-written rather than a client library: a few counters and two histograms need no
dependency. Metrics are per process; Prometheus sums them over gateways.

- ``pagestream_gateway_requests_total{endpoint,status}``: answered requests (499: the client
  went away first);
- ``pagestream_gateway_requests_in_flight``: generation requests under way;
- ``pagestream_gateway_completion_tokens_total``: output tokens sent;
- ``pagestream_gateway_time_to_first_token_seconds`` and
  ``pagestream_gateway_request_duration_seconds``: histograms.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

PREFIX = "pagestream_gateway"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    """Cumulative buckets (``le``), a sum and a count."""

    bounds_s: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds_s)

    def observe(self, value_s: float) -> None:
        index = bisect.bisect_left(self.bounds_s, value_s)
        if index < len(self.counts):
            self.counts[index] += 1
        self.sum_s += value_s
        self.count += 1

    def lines(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip(self.bounds_s, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum_s:.6f}", f"{name}_count {self.count}"]
        return lines


class GatewayMetrics:
    """The gateway's counters; ``render`` writes them for Prometheus."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.num_in_flight = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.duration = Histogram(DURATION_BUCKETS_S)

    def count(self, endpoint: str, status: int) -> None:
        """A request answered without generating (an error before submission, a listing)."""
        self.requests[(endpoint, status)] += 1

    def start(self, endpoint: str) -> Observation:
        """A generation request begins; its ``Observation`` records how it ends."""
        self.num_in_flight += 1
        return Observation(self, endpoint, time.perf_counter())

    def render(self) -> str:
        lines = [
            f"# HELP {PREFIX}_requests_total Requests answered, by endpoint and HTTP status.",
            f"# TYPE {PREFIX}_requests_total counter",
        ]
        for (endpoint, status), value in sorted(self.requests.items()):
            lines.append(
                f'{PREFIX}_requests_total{{endpoint="{endpoint}",status="{status}"}} {value}'
            )
        lines += [
            f"# HELP {PREFIX}_requests_in_flight Generation requests under way.",
            f"# TYPE {PREFIX}_requests_in_flight gauge",
            f"{PREFIX}_requests_in_flight {self.num_in_flight}",
            f"# HELP {PREFIX}_completion_tokens_total Output tokens of finished requests.",
            f"# TYPE {PREFIX}_completion_tokens_total counter",
            f"{PREFIX}_completion_tokens_total {self.completion_tokens}",
        ]
        for name, histogram, help_text in (
            ("time_to_first_token_seconds", self.ttft, "Request received to first token sent."),
            ("request_duration_seconds", self.duration, "Request received to response complete."),
        ):
            full = f"{PREFIX}_{name}"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
            lines += histogram.lines(full)
        return "\n".join(lines) + "\n"


@dataclass
class Observation:
    """One generation request's timings; ``finish`` counts it (once)."""

    metrics: GatewayMetrics
    endpoint: str
    start_s: float
    finished: bool = False

    def first_token(self) -> None:
        self.metrics.ttft.observe(time.perf_counter() - self.start_s)

    def finish(self, status: int, num_completion_tokens: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        metrics = self.metrics
        metrics.num_in_flight -= 1
        metrics.requests[(self.endpoint, status)] += 1
        metrics.completion_tokens += num_completion_tokens
        metrics.duration.observe(time.perf_counter() - self.start_s)
