"""One request's spans and GenAI metrics: the `RequestTrace` from `Telemetry.start_request`.

The request span (opened by `Telemetry`) gets the children "queue wait", "prefill" and
"decode" as the request moves through admission, its first token and its end; the histograms
named by the OpenTelemetry GenAI semantic conventions are recorded on the way. All latencies
are measured from request receipt: the enqueue time when known, else `start_request`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from opentelemetry.metrics import Histogram, Meter
from opentelemetry.trace import Span, Status, StatusCode, Tracer, set_span_in_context

__all__ = [
    "REQUEST_DURATION_BUCKETS_S",
    "TOKEN_USAGE_BUCKETS",
    "TPOT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "Clock",
    "GenAIHistograms",
    "RequestTrace",
    "to_ns",
]

# Bucket boundaries the GenAI semantic conventions recommend for each histogram.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)  # fmt: skip
TOKEN_USAGE_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 4**13
# the finish reasons of a request that ran to its end: its decode time says what a token took
COMPLETED_REASONS = frozenset({"stop", "length"})
FAILED_REASONS = frozenset({"timeout"})  # a deadline that passed: the request failed

Clock = Callable[[], float]  # wall-clock seconds since the epoch, like time.time


@dataclass(frozen=True)
class GenAIHistograms:
    """The GenAI semantic-convention instruments."""

    time_to_first_token: Histogram
    time_per_output_token: Histogram
    request_duration: Histogram
    token_usage: Histogram

    @classmethod
    def create(cls, meter: Meter) -> GenAIHistograms:
        """The four histograms on `meter`, with the semconv's names, units and buckets."""
        return cls(
            time_to_first_token=meter.create_histogram(
                "gen_ai.server.time_to_first_token",
                unit="s",
                description="Time from request receipt (enqueue) to the first output token.",
                explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S,
            ),
            time_per_output_token=meter.create_histogram(
                "gen_ai.server.time_per_output_token",
                unit="s",
                description="Decode time per output token after the first.",
                explicit_bucket_boundaries_advisory=TPOT_BUCKETS_S,
            ),
            request_duration=meter.create_histogram(
                "gen_ai.server.request.duration",
                unit="s",
                description="Time from request receipt (enqueue) to the last output token.",
                explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS_S,
            ),
            token_usage=meter.create_histogram(
                "gen_ai.client.token.usage",
                unit="{token}",
                description="Input and output tokens per request.",
                explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS,
            ),
        )


class _Phase(str, Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


def to_ns(time_s: float) -> int:
    """Seconds since the epoch as the integer nanoseconds OpenTelemetry timestamps use."""
    return int(time_s * 1e9)


class RequestTrace:
    """The spans and metrics of one request; built by `Telemetry.start_request`.

    The phase methods must be called in order (admitted, first_token, finish); a call that
    comes too late is ignored (a second finish, first_token after finish), and first_token
    without admitted implies admission at the same instant. Safe to call from any thread.
    """

    def __init__(
        self,
        tracer: Tracer,
        histograms: GenAIHistograms,
        clock_s: Clock,
        request_span: Span,
        received_at_s: float,
        metric_attributes: Mapping[str, str | int | float],
    ) -> None:
        self._tracer = tracer
        self._histograms = histograms
        self._clock_s = clock_s
        self._request_span = request_span
        self._received_at_s = received_at_s
        self._metric_attributes = dict(metric_attributes)
        self._lock = threading.Lock()
        self._phase = _Phase.QUEUED
        self._phase_span: Span | None = None
        self._first_token_at_s: float | None = None
        span_context = request_span.get_span_context()
        self.trace_id = format(span_context.trace_id, "032x")
        self.span_id = format(span_context.span_id, "016x")

    @property
    def traceparent(self) -> str:
        """The W3C traceparent of the request span, for replies or downstream calls."""
        return f"00-{self.trace_id}-{self.span_id}-01"

    def start_queue_wait(self, enqueued_at_s: float) -> None:
        """Open the "queue wait" span at `enqueued_at_s` (called by `start_request`)."""
        with self._lock:
            self._phase_span = self._child_span("queue wait", enqueued_at_s)

    def admitted(self) -> None:
        """The scheduler admitted the request: "queue wait" ends, "prefill" starts."""
        with self._lock:
            self._admit(self._clock_s())

    def first_token(self) -> None:
        """The first output token exists: records gen_ai.server.time_to_first_token.

        Measured from request receipt (enqueue), so it includes queue wait, as the GenAI
        semantic conventions define it. "prefill" ends and "decode" starts.
        """
        with self._lock:
            now_s = self._clock_s()
            self._admit(now_s)
            if self._phase is not _Phase.PREFILL:
                return
            self._end_phase_span(now_s)
            self._histograms.time_to_first_token.record(
                now_s - self._received_at_s, self._metric_attributes
            )
            self._first_token_at_s = now_s
            self._phase_span = self._child_span("decode", now_s)
            self._phase = _Phase.DECODE

    def finish(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        error: str | None = None,
    ) -> None:
        """End all open spans and record duration, time per output token and token usage.

        `error` is a short, low-cardinality error class ("timeout", "ValueError"): it becomes
        `error.type` on the spans and on gen_ai.server.request.duration, and the span status
        is ERROR; a request that ran past its deadline (``finish_reason`` "timeout") has failed
        whether or not the caller says so. Time per output token is recorded only for requests
        that ended by a stop or their length (not failed, timed out or cancelled) with more
        than one output token. A second call is ignored.
        """
        if error is None and finish_reason in FAILED_REASONS:
            error = finish_reason
        with self._lock:
            if self._phase is _Phase.FINISHED:
                return
            now_s = self._clock_s()
            self._end_phase_span(now_s, error)
            self._phase = _Phase.FINISHED
            self._end_request_span(now_s, finish_reason, prompt_tokens, completion_tokens, error)
            completed = error is None and finish_reason in COMPLETED_REASONS
            self._record_finish(now_s, prompt_tokens, completion_tokens, error, completed)

    def _admit(self, now_s: float) -> None:
        if self._phase is not _Phase.QUEUED:
            return
        self._end_phase_span(now_s)
        self._phase_span = self._child_span("prefill", now_s)
        self._phase = _Phase.PREFILL

    def _child_span(self, name: str, start_s: float) -> Span:
        context = set_span_in_context(self._request_span)
        return self._tracer.start_span(name, context=context, start_time=to_ns(start_s))

    def _end_phase_span(self, now_s: float, error: str | None = None) -> None:
        if self._phase_span is None:
            return
        if error is not None:
            _mark_error(self._phase_span, error)
        self._phase_span.end(end_time=to_ns(now_s))
        self._phase_span = None

    def _end_request_span(
        self,
        now_s: float,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        error: str | None,
    ) -> None:
        span = self._request_span
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if error is not None:
            _mark_error(span, error)
        span.end(end_time=to_ns(now_s))

    def _record_finish(
        self,
        now_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        error: str | None,
        completed: bool,
    ) -> None:
        histograms, attributes = self._histograms, self._metric_attributes
        duration_attributes = attributes if error is None else {**attributes, "error.type": error}
        histograms.request_duration.record(now_s - self._received_at_s, duration_attributes)
        if completed and self._first_token_at_s is not None and completion_tokens > 1:
            decode_s = now_s - self._first_token_at_s
            histograms.time_per_output_token.record(decode_s / (completion_tokens - 1), attributes)
        histograms.token_usage.record(prompt_tokens, {**attributes, "gen_ai.token.type": "input"})
        histograms.token_usage.record(
            completion_tokens, {**attributes, "gen_ai.token.type": "output"}
        )


def _mark_error(span: Span, error: str) -> None:
    span.set_attribute("error.type", error)
    span.set_status(Status(StatusCode.ERROR, error))
