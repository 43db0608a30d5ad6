"""OpenTelemetry for the worker: a span tree per request, GenAI latency metrics, engine gauges.

One `Telemetry` per worker process owns its tracer and meter providers (never the global
ones, so tests can build several). Per request the service calls

    trace = telemetry.start_request(request_id, traceparent=..., enqueued_at_s=..., attributes=...)
    trace.admitted()       # the scheduler took it: "queue wait" ends, "prefill" starts
    trace.first_token()    # "prefill" ends, time to first token recorded, "decode" starts
    trace.finish(finish_reason="stop", prompt_tokens=12, completion_tokens=40)

which yields a request span (child of the caller's W3C `traceparent`) with the children
"queue wait", "prefill" and "decode", and the GenAI semantic-convention histograms.
Every latency is measured from when the request entered the queue (`enqueued_at_s`, the
semconv's "request receipt"); without it, from `start_request`. See docs/observability.md.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import (
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["EngineGauges", "ExportSetup", "RequestTrace", "Telemetry"]

INSTRUMENTATION_NAME = "pagestream.worker"
WORKER_NAME_ATTRIBUTE = "pagestream.worker.name"
REQUEST_ID_ATTRIBUTE = "pagestream.request.id"

# Request attributes that also go on the GenAI metrics (low cardinality, per the semconv).
_METRIC_ATTRIBUTE_KEYS = (
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "gen_ai.response.model",
    "server.address",
    "server.port",
)

# Bucket boundaries the GenAI semantic conventions recommend for each histogram.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)  # fmt: skip
TOKEN_USAGE_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 4**13

Clock = Callable[[], float]  # wall-clock seconds since the epoch, like time.time


@dataclass(frozen=True)
class EngineGauges:
    """One reading of the engine's and the queue's state, for the `pagestream.*` gauges."""

    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_free: int
    prefix_hit_rate: float
    num_preemptions: int  # cumulative since the engine started
    queue_depth: int  # requests in the Redis stream not yet read by this worker
    num_swapped: int = 0


# Gauge name, EngineGauges field, unit, description. Preemptions is cumulative: a counter.
_ENGINE_GAUGES = (
    ("pagestream.engine.requests.running", "num_running", "{request}", "Requests being decoded."),
    ("pagestream.engine.requests.waiting", "num_waiting", "{request}", "Requests waiting to run."),
    ("pagestream.engine.requests.swapped", "num_swapped", "{request}", "Requests swapped out."),
    ("pagestream.engine.pages.used", "num_pages_used", "{page}", "KV-cache pages in use."),
    ("pagestream.engine.pages.free", "num_pages_free", "{page}", "KV-cache pages free."),
    ("pagestream.engine.prefix_cache.hit_rate", "prefix_hit_rate", "1", "Prefix-cache hit rate."),
    ("pagestream.queue.depth", "queue_depth", "{request}", "Requests queued in the stream."),
)
_PREEMPTIONS = ("pagestream.engine.preemptions", "num_preemptions", "{preemption}")


@dataclass(frozen=True)
class ExportSetup:
    """Where `Telemetry.from_env` sends data: None for a signal that is not exported."""

    span_exporter: SpanExporter | None = None
    metric_exporter: MetricExporter | None = None


@dataclass(frozen=True)
class _Histograms:
    """The GenAI semantic-convention instruments."""

    time_to_first_token: Histogram
    time_per_output_token: Histogram
    request_duration: Histogram
    token_usage: Histogram

    @classmethod
    def create(cls, meter: Meter) -> _Histograms:
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


def _ns(time_s: float) -> int:
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
        histograms: _Histograms,
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
        is ERROR. Time per output token is recorded only for successful requests with more
        than one output token. A second call is ignored.
        """
        with self._lock:
            if self._phase is _Phase.FINISHED:
                return
            now_s = self._clock_s()
            self._end_phase_span(now_s, error)
            self._phase = _Phase.FINISHED
            self._end_request_span(now_s, finish_reason, prompt_tokens, completion_tokens, error)
            self._record_finish(now_s, prompt_tokens, completion_tokens, error)

    def _admit(self, now_s: float) -> None:
        if self._phase is not _Phase.QUEUED:
            return
        self._end_phase_span(now_s)
        self._phase_span = self._child_span("prefill", now_s)
        self._phase = _Phase.PREFILL

    def _child_span(self, name: str, start_s: float) -> Span:
        context = set_span_in_context(self._request_span)
        return self._tracer.start_span(name, context=context, start_time=_ns(start_s))

    def _end_phase_span(self, now_s: float, error: str | None = None) -> None:
        if self._phase_span is None:
            return
        if error is not None:
            _mark_error(self._phase_span, error)
        self._phase_span.end(end_time=_ns(now_s))
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
        span.end(end_time=_ns(now_s))

    def _record_finish(
        self, now_s: float, prompt_tokens: int, completion_tokens: int, error: str | None
    ) -> None:
        histograms, attributes = self._histograms, self._metric_attributes
        duration_attributes = attributes if error is None else {**attributes, "error.type": error}
        histograms.request_duration.record(now_s - self._received_at_s, duration_attributes)
        if error is None and self._first_token_at_s is not None and completion_tokens > 1:
            decode_s = now_s - self._first_token_at_s
            histograms.time_per_output_token.record(decode_s / (completion_tokens - 1), attributes)
        histograms.token_usage.record(prompt_tokens, {**attributes, "gen_ai.token.type": "input"})
        histograms.token_usage.record(
            completion_tokens, {**attributes, "gen_ai.token.type": "output"}
        )


def _mark_error(span: Span, error: str) -> None:
    span.set_attribute("error.type", error)
    span.set_status(Status(StatusCode.ERROR, error))


class Telemetry:
    """The worker's tracer and meter providers, and the instruments built on them.

    Use `from_env` in the service; tests pass providers with in-memory exporters/readers.
    The providers stay on this object (the global OpenTelemetry providers are not touched).
    """

    def __init__(
        self,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        *,
        worker_name: str = "",
        clock_s: Clock = time.time,
        export: ExportSetup | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.export = export or ExportSetup()
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME)
        self._meter = meter_provider.get_meter(INSTRUMENTATION_NAME)
        self._histograms = _Histograms.create(self._meter)
        self._worker_attributes = {WORKER_NAME_ATTRIBUTE: worker_name} if worker_name else {}
        self._clock_s = clock_s
        self._read_gauges: Callable[[], EngineGauges] | None = None
        self._is_shut_down = False

    @classmethod
    def from_env(
        cls, *, service_name: str = "pagestream-worker", worker_name: str = ""
    ) -> Telemetry:
        """Providers configured from the standard OTEL_* environment variables.

        Traces go to OTLP over http/protobuf when OTEL_EXPORTER_OTLP_ENDPOINT or
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, metrics when OTEL_EXPORTER_OTLP_ENDPOINT or
        OTEL_EXPORTER_OTLP_METRICS_ENDPOINT is; otherwise nothing is exported (spans are
        still created, so trace ids reach the logs). OTEL_SDK_DISABLED=true, or
        OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER = none, turn export off. The resource
        has service.name (OTEL_SERVICE_NAME wins over `service_name`) and
        service.instance.id = `worker_name` (host-pid when empty).
        """
        resource = _resource(service_name, worker_name)
        export = _export_setup_from_env()
        tracer_provider = TracerProvider(resource=resource)
        if export.span_exporter is not None:
            tracer_provider.add_span_processor(BatchSpanProcessor(export.span_exporter))
        readers = []
        if export.metric_exporter is not None:
            readers.append(PeriodicExportingMetricReader(export.metric_exporter))
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        return cls(tracer_provider, meter_provider, worker_name=worker_name, export=export)

    def start_request(
        self,
        request_id: str,
        *,
        traceparent: str | None,
        enqueued_at_s: float | None,
        attributes: Mapping[str, str | int | float],
        tracestate: str | None = None,
    ) -> RequestTrace:
        """Open the request span (and its "queue wait" child when `enqueued_at_s` is given).

        The span continues the caller's W3C `traceparent` when it is valid; a missing or
        malformed one starts a new trace. `enqueued_at_s` is the wall-clock time the request
        entered the queue; one in the future (a skewed client clock) counts as now.
        `attributes` go on the request span; the gen_ai.operation.name / provider / model
        ones also label the metrics.
        """
        now_s = self._clock_s()
        received_at_s = now_s if enqueued_at_s is None else min(enqueued_at_s, now_s)
        span = self._tracer.start_span(
            _span_name(attributes),
            context=_parent_context(traceparent, tracestate),
            kind=SpanKind.SERVER,
            attributes={**attributes, REQUEST_ID_ATTRIBUTE: request_id, **self._worker_attributes},
            start_time=_ns(received_at_s),
        )
        metric_attributes = {k: attributes[k] for k in _METRIC_ATTRIBUTE_KEYS if k in attributes}
        trace = RequestTrace(
            self._tracer,
            self._histograms,
            self._clock_s,
            span,
            received_at_s,
            {**metric_attributes, **self._worker_attributes},
        )
        if enqueued_at_s is not None:
            trace.start_queue_wait(received_at_s)
        return trace

    def observe_engine(self, stats: Callable[[], EngineGauges]) -> None:
        """Report `stats()` as the `pagestream.*` gauges, read at each metric collection.

        `stats` runs on the metric reader's thread, once per gauge per collection: it must
        be cheap and thread-safe. A second call replaces the callable.
        """
        if self._read_gauges is None:
            self._create_gauges()
        self._read_gauges = stats

    def shutdown(self) -> None:
        """Flush pending spans and metrics and shut both providers down (idempotent)."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    def _create_gauges(self) -> None:
        for name, field, unit, description in _ENGINE_GAUGES:
            self._meter.create_observable_gauge(
                name, [self._gauge_callback(field)], unit=unit, description=description
            )
        name, field, unit = _PREEMPTIONS
        self._meter.create_observable_counter(
            name, [self._gauge_callback(field)], unit=unit, description="Preemptions so far."
        )

    def _gauge_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            if self._read_gauges is None:
                return []
            value = getattr(self._read_gauges(), field)
            return [Observation(value, self._worker_attributes)]

        return observe


def _span_name(attributes: Mapping[str, str | int | float]) -> str:
    """'{gen_ai.operation.name} {gen_ai.request.model}', the GenAI semconv span name."""
    operation = str(attributes.get("gen_ai.operation.name", "generate"))
    model = attributes.get("gen_ai.request.model")
    return operation if model is None else f"{operation} {model}"


def _parent_context(traceparent: str | None, tracestate: str | None) -> Context | None:
    """The caller's span context, or None (a new trace) when traceparent is absent or bad."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    context = TraceContextTextMapPropagator().extract(carrier)
    if not get_current_span(context).get_span_context().is_valid:
        return None
    return context


def _resource(service_name: str, worker_name: str) -> Resource:
    instance_id = worker_name or f"{socket.gethostname()}-{os.getpid()}"
    return Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name,
            "service.instance.id": instance_id,
        }
    )


def _export_setup_from_env() -> ExportSetup:
    """OTLP/http exporters for the signals whose endpoint variables are set."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ExportSetup()
    has_base = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    span_exporter: SpanExporter | None = None
    metric_exporter: MetricExporter | None = None
    if _signal_enabled("TRACES", has_base):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()  # reads endpoint, headers, timeout from OTEL_*
    if _signal_enabled("METRICS", has_base):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        metric_exporter = OTLPMetricExporter()
    return ExportSetup(span_exporter=span_exporter, metric_exporter=metric_exporter)


def _signal_enabled(signal: str, has_base_endpoint: bool) -> bool:
    if os.environ.get(f"OTEL_{signal}_EXPORTER", "").strip().lower() == "none":
        return False
    return has_base_endpoint or bool(os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))
