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

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.request_trace import (
    REQUEST_DURATION_BUCKETS_S,
    TOKEN_USAGE_BUCKETS,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    Clock,
    GenAIHistograms,
    RequestTrace,
    to_ns,
)

__all__ = [
    "REQUEST_DURATION_BUCKETS_S",
    "TOKEN_USAGE_BUCKETS",
    "TPOT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "EngineGauges",
    "ExportSetup",
    "RequestTrace",
    "Telemetry",
]

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
    # Cumulative: tokens admitted from each prefix-cache tier, and the host tier's traffic
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_offloaded_pages: int = 0
    num_offload_evictions: int = 0
    spec_acceptance_rate: float = 0.0  # speculative decoding: accepted over verified drafts
    num_draft_tokens: int = 0  # cumulative
    num_accepted_tokens: int = 0  # cumulative
    num_deferred_admissions: int = 0  # cumulative: waits for a page filled in the same step


# Gauge name, EngineGauges field, unit, description; cumulative ones are counters below.
_ENGINE_GAUGES = (
    ("pagestream.engine.requests.running", "num_running", "{request}", "Requests being decoded."),
    ("pagestream.engine.requests.waiting", "num_waiting", "{request}", "Requests waiting to run."),
    ("pagestream.engine.requests.swapped", "num_swapped", "{request}", "Requests swapped out."),
    ("pagestream.engine.pages.used", "num_pages_used", "{page}", "KV-cache pages in use."),
    ("pagestream.engine.pages.free", "num_pages_free", "{page}", "KV-cache pages free."),
    ("pagestream.engine.prefix_cache.hit_rate", "prefix_hit_rate", "1", "Prefix-cache hit rate."),
    ("pagestream.queue.depth", "queue_depth", "{request}", "Requests queued in the stream."),
    ("pagestream.engine.spec_decode.acceptance_rate", "spec_acceptance_rate", "1",
     "Share of verified draft tokens accepted."),
)  # fmt: skip
_ENGINE_COUNTERS = (
    ("pagestream.engine.preemptions", "num_preemptions", "{preemption}", "Preemptions so far."),
    (
        "pagestream.engine.prefix_cache.device_hit_tokens", "num_device_hit_tokens", "{token}",
        "Tokens admitted with their KV found in the GPU pool's prefix cache.",
    ),
    (
        "pagestream.engine.prefix_cache.host_hit_tokens", "num_host_hit_tokens", "{token}",
        "Tokens admitted with their KV copied back from the host tier (--kv-offload-mb).",
    ),
    (
        "pagestream.engine.prefix_cache.deferred_admissions", "num_deferred_admissions",
        "{request}", "Admissions put off a step to read a page another request filled in it.",
    ),
    (
        "pagestream.engine.kv_offload.pages_offloaded", "num_offloaded_pages", "{page}",
        "Evicted prefix-cache pages saved to the host tier.",
    ),
    (
        "pagestream.engine.kv_offload.evictions", "num_offload_evictions", "{page}",
        "Host-tier pages dropped to make room.",
    ),
    ("pagestream.engine.spec_decode.draft_tokens", "num_draft_tokens", "{token}",
     "Draft tokens verified so far."),
    ("pagestream.engine.spec_decode.accepted_tokens", "num_accepted_tokens", "{token}",
     "Draft tokens accepted so far."),
)  # fmt: skip


@dataclass(frozen=True)
class ExportSetup:
    """Where `Telemetry.from_env` sends data: None for a signal that is not exported."""

    span_exporter: SpanExporter | None = None
    metric_exporter: MetricExporter | None = None


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
        self._histograms = GenAIHistograms.create(self._meter)
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
            start_time=to_ns(received_at_s),
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
        """Flush pending spans and metrics and shut both providers down (idempotent).

        The two flush at once: against an unreachable collector each waits out
        ``OTEL_EXPORTER_OTLP_TIMEOUT``, and one after the other they kept a stopping worker
        twice that long."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        traces = threading.Thread(
            target=self.tracer_provider.shutdown, name="otel-traces-shutdown", daemon=True
        )
        traces.start()
        self.meter_provider.shutdown()
        traces.join()

    def _create_gauges(self) -> None:
        for name, field, unit, description in _ENGINE_GAUGES:
            self._meter.create_observable_gauge(
                name, [self._gauge_callback(field)], unit=unit, description=description
            )
        for name, field, unit, description in _ENGINE_COUNTERS:
            self._meter.create_observable_counter(
                name, [self._gauge_callback(field)], unit=unit, description=description
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


def check_export_env() -> None:
    """Refuse the ``OTEL_*`` choices this service does not honour, rather than export
    otherwise than asked: OTLP goes over HTTP (``http/protobuf``) only, and a signal's
    exporter is ``otlp`` or ``none``."""
    for scope in ("", "TRACES_", "METRICS_"):
        name = f"OTEL_EXPORTER_OTLP_{scope}PROTOCOL"
        value = os.environ.get(name, "").strip()
        if value and value.lower() != "http/protobuf":
            raise ValueError(
                f"{name}={value!r}: pagestream exports OTLP over HTTP only (http/protobuf)"
            )
    for signal in ("TRACES", "METRICS"):
        name = f"OTEL_{signal}_EXPORTER"
        value = os.environ.get(name, "").strip()
        if value and value.lower() not in ("otlp", "none"):
            raise ValueError(f"{name}={value!r}: expected otlp or none")


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
