"""Request spans, GenAI histograms and engine gauges, checked through in-memory exporters."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, Metric
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from worker.telemetry import (
    TTFT_BUCKETS_S,
    EngineGauges,
    ExportSetup,
    RequestTrace,
    Telemetry,
)

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
MODEL = "SmolLM2-135M"
ATTRIBUTES: dict[str, str | int | float] = {
    "gen_ai.operation.name": "text_completion",
    "gen_ai.request.model": MODEL,
    "gen_ai.request.max_tokens": 64,
}
T0_S = 1_700_000_000.0  # an arbitrary wall-clock instant


@dataclass
class FakeClock:
    """A wall clock the test moves by hand."""

    now_s: float = T0_S

    def __call__(self) -> float:
        return self.now_s

    def advance(self, delta_s: float) -> None:
        self.now_s += delta_s


@dataclass
class Harness:
    telemetry: Telemetry
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    clock: FakeClock
    gauges: list[EngineGauges] = field(default_factory=list)

    def finished_spans(self) -> dict[str, ReadableSpan]:
        return {span.name: span for span in self.spans.get_finished_spans()}

    def metric(self, name: str) -> Metric:
        data = self.metrics.get_metrics_data()
        assert data is not None
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        return metric
        raise AssertionError(f"metric {name} not recorded")

    def histogram_points(self, name: str) -> list[HistogramDataPoint]:
        points = list(self.metric(name).data.data_points)
        assert all(isinstance(p, HistogramDataPoint) for p in points)
        return points  # type: ignore[return-value]


@pytest.fixture
def harness() -> Iterator[Harness]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    metrics = InMemoryMetricReader()
    clock = FakeClock()
    telemetry = Telemetry(
        tracer_provider,
        MeterProvider(metric_readers=[metrics]),
        worker_name="worker-a",
        clock_s=clock,
    )
    yield Harness(telemetry, spans, metrics, clock)
    telemetry.shutdown()


def run_request(h: Harness, **overrides: Any) -> RequestTrace:
    """A request enqueued at T0: 0.5 s queued, 0.25 s prefill, 2 s decode of 9 tokens."""
    kwargs: dict[str, Any] = dict(
        traceparent=CALLER_TRACEPARENT, enqueued_at_s=T0_S, attributes=ATTRIBUTES
    )
    kwargs.update(overrides)
    h.clock.now_s = T0_S + 0.125  # the worker reads the request 0.125 s after the enqueue
    trace = h.telemetry.start_request("req-1", **kwargs)
    h.clock.now_s = T0_S + 0.5
    trace.admitted()
    h.clock.advance(0.25)
    trace.first_token()
    h.clock.advance(2.0)
    trace.finish(finish_reason="length", prompt_tokens=12, completion_tokens=9)
    return trace


def test_request_continues_the_callers_trace(harness: Harness) -> None:
    trace = run_request(harness)
    spans = harness.finished_spans()
    request = spans[f"text_completion {MODEL}"]
    assert trace.trace_id == CALLER_TRACE_ID
    assert format(request.context.trace_id, "032x") == CALLER_TRACE_ID
    assert request.parent is not None
    assert format(request.parent.span_id, "016x") == CALLER_SPAN_ID
    assert request.parent.is_remote
    assert request.kind is SpanKind.SERVER
    assert trace.traceparent == f"00-{CALLER_TRACE_ID}-{format(request.context.span_id, '016x')}-01"


def test_phase_spans_are_children_in_order(harness: Harness) -> None:
    run_request(harness)
    spans = harness.finished_spans()
    request = spans[f"text_completion {MODEL}"]
    phases = [spans["queue wait"], spans["prefill"], spans["decode"]]
    for phase in phases:
        assert phase.parent is not None
        assert phase.parent.span_id == request.context.span_id
        assert phase.context.trace_id == request.context.trace_id
    ns = 1_000_000_000
    assert [(p.start_time, p.end_time) for p in phases] == [
        (int(T0_S * ns), int((T0_S + 0.5) * ns)),
        (int((T0_S + 0.5) * ns), int((T0_S + 0.75) * ns)),
        (int((T0_S + 0.75) * ns), int((T0_S + 2.75) * ns)),
    ]
    assert (request.start_time, request.end_time) == (int(T0_S * ns), int((T0_S + 2.75) * ns))


def test_request_span_attributes(harness: Harness) -> None:
    run_request(harness)
    attributes = harness.finished_spans()[f"text_completion {MODEL}"].attributes
    assert attributes is not None
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 64
    assert attributes["pagestream.request.id"] == "req-1"
    assert attributes["pagestream.worker.name"] == "worker-a"
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
    assert attributes["gen_ai.usage.input_tokens"] == 12
    assert attributes["gen_ai.usage.output_tokens"] == 9


@pytest.mark.parametrize("traceparent", ["garbage", "00-zz-00f067aa0ba902b7-01", "", None])
def test_bad_or_missing_traceparent_starts_a_new_trace(
    harness: Harness, traceparent: str | None
) -> None:
    trace = run_request(harness, traceparent=traceparent)
    request = harness.finished_spans()[f"text_completion {MODEL}"]
    assert len(trace.trace_id) == 32
    assert trace.trace_id != CALLER_TRACE_ID
    assert int(trace.trace_id, 16) == request.context.trace_id
    assert request.parent is None


def test_without_enqueue_time_there_is_no_queue_wait(harness: Harness) -> None:
    run_request(harness, enqueued_at_s=None)
    spans = harness.finished_spans()
    assert set(spans) == {f"text_completion {MODEL}", "prefill", "decode"}
    # Latencies are then measured from start_request (T0 + 0.125 s).
    [ttft] = harness.histogram_points("gen_ai.server.time_to_first_token")
    assert ttft.sum == pytest.approx(0.625)


def test_latency_histograms(harness: Harness) -> None:
    run_request(harness)
    ttft = harness.metric("gen_ai.server.time_to_first_token")
    assert ttft.unit == "s"
    [point] = harness.histogram_points("gen_ai.server.time_to_first_token")
    assert (point.count, point.sum) == (1, pytest.approx(0.75))  # from enqueue, queue included
    assert tuple(point.explicit_bounds) == TTFT_BUCKETS_S
    assert point.attributes == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": MODEL,
        "pagestream.worker.name": "worker-a",
    }
    [duration] = harness.histogram_points("gen_ai.server.request.duration")
    assert (duration.count, duration.sum) == (1, pytest.approx(2.75))
    assert harness.metric("gen_ai.server.request.duration").unit == "s"
    [tpot] = harness.histogram_points("gen_ai.server.time_per_output_token")
    assert (tpot.count, tpot.sum) == (1, pytest.approx(2.0 / 8))  # 8 tokens after the first
    assert harness.metric("gen_ai.server.time_per_output_token").unit == "s"


def test_token_usage_split_by_type(harness: Harness) -> None:
    run_request(harness)
    assert harness.metric("gen_ai.client.token.usage").unit == "{token}"
    points = harness.histogram_points("gen_ai.client.token.usage")
    by_type = {p.attributes["gen_ai.token.type"]: p for p in points if p.attributes}
    assert set(by_type) == {"input", "output"}
    assert (by_type["input"].count, by_type["input"].sum) == (1, 12)
    assert (by_type["output"].count, by_type["output"].sum) == (1, 9)
    assert by_type["input"].attributes["gen_ai.request.model"] == MODEL  # type: ignore[index]


def test_single_output_token_records_no_time_per_output_token(harness: Harness) -> None:
    trace = harness.telemetry.start_request(
        "req-2", traceparent=None, enqueued_at_s=None, attributes=ATTRIBUTES
    )
    trace.first_token()  # without admitted(): admission happens at the same instant
    trace.finish(finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    names = [s.name for s in harness.spans.get_finished_spans()]
    assert sorted(names) == sorted(["prefill", "decode", f"text_completion {MODEL}"])
    with pytest.raises(AssertionError, match="not recorded"):
        harness.metric("gen_ai.server.time_per_output_token")


def test_a_cancelled_request_records_no_time_per_output_token(harness: Harness) -> None:
    """TPOT is the decode speed of requests that ran to their end: a cancel cuts the decode
    short wherever the caller chose (and a timeout is an error, which records none either)."""
    run_request(harness)  # one complete request: one TPOT point
    trace = harness.telemetry.start_request(
        "req-4", traceparent=None, enqueued_at_s=None, attributes=ATTRIBUTES
    )
    trace.first_token()
    harness.clock.advance(1.0)
    trace.finish(finish_reason="cancelled", prompt_tokens=3, completion_tokens=5)
    [tpot] = harness.histogram_points("gen_ai.server.time_per_output_token")
    assert tpot.count == 1
    request = harness.finished_spans()[f"text_completion {MODEL}"]
    assert request.status.status_code is StatusCode.UNSET  # a cancel is no failure


def test_a_request_past_its_deadline_has_failed(harness: Harness) -> None:
    """The worker finishes a timed-out request with its finish reason alone: the trace marks
    it an error and keeps its decode time out of the time per output token."""
    trace = harness.telemetry.start_request(
        "req-5", traceparent=None, enqueued_at_s=None, attributes=ATTRIBUTES
    )
    trace.first_token()
    harness.clock.advance(1.0)
    trace.finish(finish_reason="timeout", prompt_tokens=3, completion_tokens=5)
    request = harness.finished_spans()[f"text_completion {MODEL}"]
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes is not None and request.attributes["error.type"] == "timeout"
    with pytest.raises(AssertionError, match="not recorded"):
        harness.metric("gen_ai.server.time_per_output_token")


def test_second_finish_is_ignored(harness: Harness) -> None:
    trace = run_request(harness)
    harness.clock.advance(5.0)
    trace.finish(finish_reason="stop", prompt_tokens=99, completion_tokens=99, error="late")
    trace.first_token()
    assert len(harness.spans.get_finished_spans()) == 4
    [duration] = harness.histogram_points("gen_ai.server.request.duration")
    assert (duration.count, duration.sum) == (1, pytest.approx(2.75))
    assert sum(p.count for p in harness.histogram_points("gen_ai.client.token.usage")) == 2
    request = harness.finished_spans()[f"text_completion {MODEL}"]
    assert request.status.status_code is StatusCode.UNSET


def test_error_finish_sets_status_and_error_type(harness: Harness) -> None:
    trace = harness.telemetry.start_request(
        "req-3", traceparent=CALLER_TRACEPARENT, enqueued_at_s=T0_S, attributes=ATTRIBUTES
    )
    trace.admitted()
    harness.clock.advance(1.0)
    trace.finish(finish_reason="error", prompt_tokens=5, completion_tokens=0, error="timeout")
    spans = harness.finished_spans()
    request, prefill = spans[f"text_completion {MODEL}"], spans["prefill"]
    for span in (request, prefill):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["error.type"] == "timeout"
    assert spans["queue wait"].status.status_code is StatusCode.UNSET
    assert "decode" not in spans
    [duration] = harness.histogram_points("gen_ai.server.request.duration")
    assert duration.attributes is not None
    assert duration.attributes["error.type"] == "timeout"
    with pytest.raises(AssertionError, match="not recorded"):
        harness.metric("gen_ai.server.time_to_first_token")


def test_future_enqueue_time_counts_as_now(harness: Harness) -> None:
    trace = harness.telemetry.start_request(
        "req-4", traceparent=None, enqueued_at_s=T0_S + 60.0, attributes={}
    )
    harness.clock.advance(1.0)
    trace.finish(finish_reason="abort", prompt_tokens=1, completion_tokens=0)
    spans = harness.finished_spans()
    assert spans["queue wait"].start_time == int(T0_S * 1e9)
    assert set(spans) == {"generate", "queue wait"}
    [duration] = harness.histogram_points("gen_ai.server.request.duration")
    assert duration.sum == pytest.approx(1.0)
    assert duration.attributes == {"pagestream.worker.name": "worker-a"}


def test_engine_gauges_read_the_callback(harness: Harness) -> None:
    readings = iter(
        [
            EngineGauges(3, 4, 100, 28, 0.25, 7, 11, 1, 640, 96, 5, 2, 0.6, 50, 30, 12),
            EngineGauges(0, 0, 0, 128, 0.5, 9, 0),
        ]
    )
    current = next(readings)
    harness.telemetry.observe_engine(lambda: current)
    expected = {
        "pagestream.engine.requests.running": (3, "{request}"),
        "pagestream.engine.requests.waiting": (4, "{request}"),
        "pagestream.engine.requests.swapped": (1, "{request}"),
        "pagestream.engine.pages.used": (100, "{page}"),
        "pagestream.engine.pages.free": (28, "{page}"),
        "pagestream.engine.prefix_cache.hit_rate": (0.25, "1"),
        "pagestream.engine.preemptions": (7, "{preemption}"),
        "pagestream.engine.prefix_cache.device_hit_tokens": (640, "{token}"),
        "pagestream.engine.prefix_cache.host_hit_tokens": (96, "{token}"),
        "pagestream.engine.prefix_cache.deferred_admissions": (12, "{request}"),
        "pagestream.engine.kv_offload.pages_offloaded": (5, "{page}"),
        "pagestream.engine.kv_offload.evictions": (2, "{page}"),
        "pagestream.queue.depth": (11, "{request}"),
        "pagestream.engine.spec_decode.acceptance_rate": (0.6, "1"),
        "pagestream.engine.spec_decode.draft_tokens": (50, "{token}"),
        "pagestream.engine.spec_decode.accepted_tokens": (30, "{token}"),
    }
    for name, (value, unit) in expected.items():
        metric = harness.metric(name)
        [point] = metric.data.data_points
        assert (point.value, metric.unit) == (value, unit), name  # type: ignore[union-attr]
        assert point.attributes == {"pagestream.worker.name": "worker-a"}
    current = next(readings)
    [point] = harness.metric("pagestream.engine.pages.free").data.data_points
    assert point.value == 128  # type: ignore[union-attr]
    [point] = harness.metric("pagestream.engine.preemptions").data.data_points
    assert point.value == 9  # type: ignore[union-attr]


def test_telemetry_objects_are_independent() -> None:
    exporters = [InMemorySpanExporter(), InMemorySpanExporter()]
    telemetries = []
    for exporter in exporters:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        telemetries.append(Telemetry(provider, MeterProvider()))
    trace = telemetries[0].start_request("r", traceparent=None, enqueued_at_s=None, attributes={})
    trace.finish(finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    assert [len(e.get_finished_spans()) for e in exporters] == [1, 0]
    for telemetry in telemetries:
        telemetry.shutdown()
        telemetry.shutdown()  # idempotent


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_from_env_without_endpoint_exports_nothing(clean_otel_env: pytest.MonkeyPatch) -> None:
    telemetry = Telemetry.from_env(worker_name="worker-b")
    assert telemetry.export == ExportSetup(span_exporter=None, metric_exporter=None)
    resource = telemetry.tracer_provider.resource.attributes
    assert resource["service.name"] == "pagestream-worker"
    assert resource["service.instance.id"] == "worker-b"
    trace = telemetry.start_request("r", traceparent=None, enqueued_at_s=None, attributes={})
    assert len(trace.trace_id) == 32 and int(trace.trace_id, 16) != 0  # ids still reach logs
    telemetry.shutdown()


def test_from_env_with_endpoint_builds_otlp_exporters(clean_otel_env: pytest.MonkeyPatch) -> None:
    # Port 9 (discard) refuses connections; nothing is recorded, so nothing is sent.
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/")
    clean_otel_env.setenv("OTEL_SERVICE_NAME", "custom-service")
    telemetry = Telemetry.from_env(worker_name="worker-c")
    span_exporter, metric_exporter = (
        telemetry.export.span_exporter,
        telemetry.export.metric_exporter,
    )
    assert isinstance(span_exporter, OTLPSpanExporter)
    assert isinstance(metric_exporter, OTLPMetricExporter)
    assert span_exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    assert metric_exporter._endpoint == "http://127.0.0.1:9/v1/metrics"
    assert telemetry.meter_provider._sdk_config.resource.attributes["service.name"] == (
        "custom-service"
    )
    telemetry.shutdown()


def test_per_signal_endpoint_and_kill_switches(clean_otel_env: pytest.MonkeyPatch) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/traces")
    telemetry = Telemetry.from_env()
    assert isinstance(telemetry.export.span_exporter, OTLPSpanExporter)
    assert telemetry.export.span_exporter._endpoint == "http://127.0.0.1:9/traces"
    assert telemetry.export.metric_exporter is None
    telemetry.shutdown()

    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    telemetry = Telemetry.from_env()
    assert telemetry.export.span_exporter is None
    assert isinstance(telemetry.export.metric_exporter, OTLPMetricExporter)
    telemetry.shutdown()

    clean_otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert Telemetry.from_env().export == ExportSetup()


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/http receiver that keeps each POST's path and body."""

    received: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_shutdown_flushes_to_an_otlp_endpoint(clean_otel_env: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        clean_otel_env.setenv(
            "OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}"
        )
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        telemetry = Telemetry.from_env(worker_name="worker-d")
        trace = telemetry.start_request(
            "r", traceparent=CALLER_TRACEPARENT, enqueued_at_s=None, attributes=ATTRIBUTES
        )
        trace.first_token()
        trace.finish(finish_reason="stop", prompt_tokens=4, completion_tokens=2)
        telemetry.shutdown()  # returns after the batch processor and reader have exported
    finally:
        server.shutdown()
        server.server_close()
    by_path = dict(_Collector.received)
    spans_request = ExportTraceServiceRequest.FromString(by_path["/v1/traces"])
    [resource_spans] = spans_request.resource_spans
    names = {s.name for scope in resource_spans.scope_spans for s in scope.spans}
    assert names == {f"text_completion {MODEL}", "prefill", "decode"}
    metrics_request = ExportMetricsServiceRequest.FromString(by_path["/v1/metrics"])
    metric_names = {
        m.name
        for rm in metrics_request.resource_metrics
        for scope in rm.scope_metrics
        for m in scope.metrics
    }
    assert "gen_ai.server.request.duration" in metric_names


def test_a_requests_span_carries_its_sampling_settings() -> None:
    """The worker's request span names the model, the operation and the settings the request
    sampled with, as OpenTelemetry's GenAI conventions call them."""
    from clients.protocol import Message, Request
    from worker.requests import span_attributes

    chat = Request(
        id="r1", messages=[Message(role="user", content="hi")], temperature=0.5, top_p=0.9, top_k=40,
        max_tokens=32, tenant="team-a", priority=2,
    )  # fmt: skip
    assert span_attributes(chat, "smollm2-135m") == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "smollm2-135m",
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.max_tokens": 32,
        "pagestream.tenant": "team-a",
        "pagestream.priority": 2,
    }
    plain = span_attributes(Request(id="r2", prompt="hi", top_k=-1), "smollm2-135m")
    assert plain["gen_ai.operation.name"] == "text_completion"
    assert "gen_ai.request.top_k" not in plain and "gen_ai.request.max_tokens" not in plain


def test_shutdown_flushes_spans_and_metrics_at_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against an unreachable collector each provider's flush waits out the export timeout:
    they wait together, not one after the other (each fake flush here returns only once the
    other has started)."""
    both_flushing = threading.Barrier(2, timeout=10)
    telemetry = harness.telemetry
    for provider in (telemetry.tracer_provider, telemetry.meter_provider):
        monkeypatch.setattr(provider, "shutdown", both_flushing.wait)
    telemetry.shutdown()  # one after the other: the first flush's barrier breaks
    assert not both_flushing.broken


@pytest.mark.parametrize(
    ("variable", "value", "refused"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "exports OTLP over HTTP only"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "exports OTLP over HTTP only"),
        ("OTEL_TRACES_EXPORTER", "console", "expected otlp or none"),
        ("OTEL_METRICS_EXPORTER", "prometheus", "expected otlp or none"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", None),
        ("OTEL_TRACES_EXPORTER", "none", None),
    ],
)
def test_export_settings_not_honoured_are_refused(
    variable: str, value: str, refused: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gRPC or console export asked for is refused at start, not replaced by OTLP/HTTP."""
    from worker.telemetry import check_export_env

    monkeypatch.setenv(variable, value)
    if refused is None:
        check_export_env()
    else:
        with pytest.raises(ValueError, match=f"{variable}='{value}': .*{refused}"):
            check_export_env()
