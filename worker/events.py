"""Engine outputs as wire events, and the per-request state the service keeps to build them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from clients import protocol
from clients.protocol import DoneEvent, Request, Timings, TokenEvent, TokenLogprob, Usage
from engine import StepOutput
from worker.delivery import Entry
from worker.telemetry import RequestTrace

# A live out stream's TTL is refreshed at least this often (and on its terminal event).
TTL_REFRESH_S = protocol.OUT_STREAM_TTL_S / 2


@dataclass
class InFlight:
    """A request this worker owns, from admission to its terminal event."""

    request: Request
    entry: Entry
    trace: RequestTrace
    admitted_s: float  # monotonic
    queue_ms: float | None  # enqueued (client's wall clock) -> read here
    num_token_events: int = 0
    num_tokens: int = 0
    first_token_s: float | None = None
    in_engine: bool = False
    cancel_requested: bool = False
    ttl_refreshed_s: float | None = None  # monotonic time the out stream's TTL was last set

    @property
    def request_id(self) -> str:
        return self.request.id

    def ttl_due(self, now_s: float) -> bool:
        """Whether this write should refresh the out stream's TTL (then marks it refreshed).

        Once per half TTL is enough to keep a live stream from expiring, and it spares
        Redis an EXPIRE per token event (half the commands of a decode step's write).
        """
        due = self.ttl_refreshed_s is None or now_s - self.ttl_refreshed_s >= TTL_REFRESH_S
        if due:
            self.ttl_refreshed_s = now_s
        return due

    @property
    def has_samples(self) -> bool:
        """Whether the request asked for several samples: their ends come on token events."""
        return self.request.n > 1 or (self.request.best_of or 1) > 1

    def wants_token_event(self, out: StepOutput) -> bool:
        return bool(out.new_token_ids or out.text_delta) or (
            out.sample_finished and self.has_samples
        )

    def token_event(self, out: StepOutput) -> TokenEvent:
        """The ``token`` event for one step's new tokens (counts them); with several samples,
        tagged with the sample's index, and its end."""
        if self.first_token_s is None and out.new_token_ids:
            self.first_token_s = time.monotonic()
            self.trace.first_token()
        event = TokenEvent(
            seq=self.num_token_events,
            text=out.text_delta,
            token_ids=list(out.new_token_ids),
            logprobs=_logprobs(out) if self.request.logprobs is not None else None,
            index=out.index,
        )
        if out.sample_finished and self.has_samples:
            event.finish_reason = _finish_reason(out)
            event.stop_reason = out.stop_reason
        self.num_token_events += 1
        self.num_tokens += len(out.new_token_ids)
        return event

    def done_event(self, out: StepOutput, worker: str) -> DoneEvent:
        """The terminal ``done`` event of a finished output."""
        usage = out.usage
        return DoneEvent(
            finish_reason=_finish_reason(out),
            usage=Usage(
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else self.num_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens if usage else 0,
            ),
            timings=self.timings(),
            stop_reason=out.stop_reason,
            worker=worker,
        )

    def timings(self) -> Timings:
        now_s = time.monotonic()
        ttft_ms = None
        if self.first_token_s is not None:
            ttft_ms = (self.first_token_s - self.admitted_s) * 1000
        return Timings(
            queue_ms=self.queue_ms,
            time_to_first_token_ms=ttft_ms,
            total_ms=(now_s - self.admitted_s) * 1000,
        )


def _finish_reason(out: StepOutput) -> protocol.FinishReason:
    return protocol.FinishReason(out.finish_reason.value if out.finish_reason else "stop")


def coalesce(outputs: list[StepOutput]) -> list[StepOutput]:
    """Outputs of several steps that wait for the same write (Redis was slower than the engine)
    merged per request, in order, so that a request's ready tokens become one ``token`` event
    and one ``XADD``, not one per step. Nothing waits to be merged: a write takes what is
    ready, so the first token goes out as soon as it would alone. Outputs with logprobs stay
    one event per step: the gateway, which has no tokenizer, names a token by the text of an
    event that carried it alone."""
    merged: list[StepOutput] = []
    last: dict[tuple[str, int], int] = {}  # (request id, sample) -> its latest output in merged
    for out in outputs:
        key = (out.request_id, out.index)
        index = last.get(key)
        if index is None or _has_logprobs(out) or _has_logprobs(merged[index]):
            last[key] = len(merged)
            merged.append(out)
            continue
        into = merged[index]
        if into.sample_finished:  # a sample's end stays the last of its outputs
            last[key] = len(merged)
            merged.append(out)
            continue
        merged[index] = StepOutput(
            out.request_id,
            [*into.new_token_ids, *out.new_token_ids],
            into.text_delta + out.text_delta,
            [*into.logprobs, *out.logprobs],
            finished=out.finished,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            usage=out.usage,
            index=out.index,
            sample_finished=out.sample_finished,
        )
    return merged


def _has_logprobs(out: StepOutput) -> bool:
    return any(entry is not None for entry in out.logprobs)


def _logprobs(out: StepOutput) -> list[TokenLogprob | None]:
    return [
        None if entry is None else TokenLogprob(entry.token_id, entry.logprob, list(entry.top))
        for entry in out.logprobs
    ]


def queue_ms(request: Request, now_ms: int) -> float | None:
    """Time from the client's enqueue to now; None when the client sent no enqueue time."""
    if request.enqueued_at_ms is None:
        return None
    return float(max(now_ms - request.enqueued_at_ms, 0))


def wall_ms() -> int:
    return int(time.time() * 1000)
