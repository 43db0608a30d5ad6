"""``/metrics`` served by the worker itself, in Prometheus' text format (version 0.0.4).

An autoscaler (an HPA through the Prometheus adapter, or KEDA's prometheus trigger) reads the
worker's load where the worker is: the engine's waiting and running requests and KV pages,
the queue's depth, lag and pending entries, and token counters whose rate is tokens/s. It sits
beside the OpenTelemetry export (``worker/telemetry.py``), which pushes; this is pulled, and
needs no collector. Hand-written, as the gateway's: a dozen gauges and counters need no
dependency, and the HTTP side is one ``GET`` on an ``asyncio`` server in the worker's loop.

The queue figures come from the heartbeat (every ``heartbeat_interval_s``, ``XLEN`` and
``XPENDING``): a scrape never waits for Redis, and a scrape while Redis is down shows the last
reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import EngineStats
from worker.loop_lag import LAG_BUCKETS_S, LoopLag

PREFIX = "pagestream_worker"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ_TIMEOUT_S = 5.0
MAX_HEADER_LINES = 100


@dataclass
class WorkerCounters:
    """What the worker counts for Prometheus (monotonic, from the worker's start)."""

    generated_tokens: int = 0  # tokens written to out streams (every attempt's)
    prompt_tokens: int = 0  # of the requests finished here
    finished: Counter[str] = field(default_factory=Counter)  # requests, by finish reason


@dataclass(frozen=True)
class QueueReading:
    """The request stream and its group, as the heartbeat last read them."""

    depth: int = 0  # XLEN: entries not yet delivered plus those in flight (acked ones are deleted)
    pending: int = 0  # delivered, not yet acknowledged (XINFO GROUPS pending)
    lag: int = 0  # not yet delivered to any worker: depth - pending


@dataclass(frozen=True)
class WorkerReading:
    """Everything one scrape reports."""

    worker: str
    model: str
    stats: EngineStats
    num_in_flight: int
    max_in_flight: int
    queue: QueueReading
    counters: WorkerCounters
    loop_lag: LoopLag = field(default_factory=LoopLag)


def queue_reading(depth: int, pending: int) -> QueueReading:
    """From ``XLEN`` and the ``XPENDING`` count of the request stream. Workers delete what they
    acknowledge, so the entries no worker has read are exactly the others: the group's lag
    (``XINFO GROUPS`` gives it on Redis 7 only, and needs a command the worker's ACL lacks)."""
    return QueueReading(depth=depth, pending=pending, lag=max(depth - pending, 0))


def render(reading: WorkerReading) -> str:
    """The reading in the exposition format; every sample has the ``worker`` label."""
    stats, queue, counters = reading.stats, reading.queue, reading.counters
    labels = f'worker="{_escape(reading.worker)}"'
    gauges = [
        ("requests_running", "Requests the engine is running.", stats.num_running),
        ("requests_waiting", "Requests waiting in the engine for pages or a slot.",
         stats.num_waiting + stats.num_swapped),
        ("requests_in_flight", "Requests this worker holds (read, not yet finished).",
         reading.num_in_flight),
        ("requests_max_in_flight", "Requests this worker holds at most.", reading.max_in_flight),
        ("kv_pages_used", "KV-cache pages in use.", stats.num_pages_used),
        ("kv_pages_total", "KV-cache pages in the pool.",
         stats.num_pages_used + stats.num_pages_free),
        ("prefix_hit_rate", "Prompt pages found in the prefix cache, of those looked up.",
         stats.prefix_hit_rate),
        ("queue_depth", "Entries in the request stream: waiting plus in flight (all workers).",
         queue.depth),
        ("queue_lag", "Entries no worker has read yet (all workers).", queue.lag),
        ("queue_pending", "Entries read and not yet finished (all workers).", queue.pending),
    ]  # fmt: skip
    counts = [
        ("generated_tokens_total", "Output tokens streamed.", counters.generated_tokens),
        ("prompt_tokens_total", "Prompt tokens of the requests finished.", counters.prompt_tokens),
        ("preemptions_total", "Sequences preempted for pages or priority.", stats.num_preemptions),
        ("engine_steps_total", "Engine steps.", stats.num_steps),
        ("engine_step_seconds_total", "Time spent in engine steps.", stats.step_time_s),
    ]
    lines = [f'# HELP {PREFIX}_info The worker and its model.', f"# TYPE {PREFIX}_info gauge",
             f'{PREFIX}_info{{{labels},model="{_escape(reading.model)}"}} 1']  # fmt: skip
    for name, help_text, value in gauges:
        lines += _sample(name, "gauge", help_text, labels, value)
    for name, help_text, value in counts:
        lines += _sample(name, "counter", help_text, labels, value)
    name = f"{PREFIX}_requests_finished_total"
    lines += [f"# HELP {name} Requests finished here, by finish reason.", f"# TYPE {name} counter"]
    for reason, count in sorted(counters.finished.items()):
        lines.append(f'{name}{{{labels},finish_reason="{_escape(reason)}"}} {count}')
    lines += _histogram(
        "event_loop_lag_seconds", "How late the worker's event loop ran what was due.",
        labels, reading.loop_lag,
    )  # fmt: skip
    return "\n".join(lines) + "\n"


class MetricsPortError(RuntimeError):
    """``--metrics-port`` cannot be listened on (taken, or not allowed)."""

    @classmethod
    def of(cls, host: str, port: int, exc: OSError) -> MetricsPortError:
        return cls(f"--metrics-port {port} on {host}: {exc.strerror or exc}")


def check_listenable(host: str, port: int) -> None:
    """Raise ``MetricsPortError`` at once when ``port`` on ``host`` cannot be listened on (taken,
    not allowed, an unknown host): the worker checks before its model loads, minutes on a GPU,
    rather than failing after. The server binds as ``asyncio.start_server`` does."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as exc:  # socket.gaierror included
        raise MetricsPortError.of(host, port, exc) from exc


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` with ``render()`` (404 elsewhere)."""

    def __init__(self, render_text: Callable[[], str], host: str, port: int) -> None:
        self._render = render_text
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; raises ``MetricsPortError`` when the port cannot be had."""
        try:
            self._server = await asyncio.start_server(self._answer, self.host, self.port)
        except OSError as exc:
            raise MetricsPortError.of(self.host, self.port, exc) from exc

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await self._respond(reader)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass  # a client that went away, stalled or sent too long a line: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, bytes]:
        request_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        for _ in range(MAX_HEADER_LINES):  # the headers: nothing in them matters here
            if await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S) in (b"\r\n", b"\n", b""):
                break
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3:
            return "400 Bad Request", b"bad request line\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target != "/metrics":
            return "404 Not Found", b"not found: the worker serves /metrics only\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n"
        body = self._render().encode()
        return "200 OK", b"" if method == "HEAD" else body


def _sample(name: str, kind: str, help_text: str, labels: str, value: float) -> list[str]:
    full = f"{PREFIX}_{name}"
    number = str(value) if isinstance(value, int) else repr(float(value))  # every digit kept
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full}{{{labels}}} {number}"]


def _histogram(name: str, help_text: str, labels: str, lag: LoopLag) -> list[str]:
    full = f"{PREFIX}_{name}"
    bounds = [repr(bound) for bound in LAG_BUCKETS_S] + ["+Inf"]
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
    for bound, count in zip(bounds, lag.cumulative_counts(), strict=True):
        lines.append(f'{full}_bucket{{{labels},le="{bound}"}} {count}')
    return [
        *lines,
        f"{full}_sum{{{labels}}} {lag.sum_s!r}",
        f"{full}_count{{{labels}}} {lag.count}",
    ]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
