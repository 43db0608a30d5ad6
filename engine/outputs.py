"""What the engine hands out: each sequence's output of a step, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import TokenLogprobs
from engine.sequence import FinishReason, Usage


@dataclass(slots=True)
class StepOutput:
    """What one sample of a request produced in one step (new tokens, or its end).

    ``index`` is the sample (0 unless the request asked for n > 1); ``sample_finished``
    says that this output ends it (``finish_reason`` is that sample's), ``finished`` that
    the whole request has ended: its last output, whose ``usage`` covers every sample (the
    prompt counted once).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    index: int = 0
    sample_finished: bool = False

    def __post_init__(self) -> None:
        if self.finished:
            self.sample_finished = True


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_pages_used: int
    num_pages_free: int
    prefix_hit_rate: float
    num_preemptions: int
    num_steps: int = 0
    step_time_s: float = 0.0  # wall time spent inside step(), summed
    # Tokens not recomputed at admission (prompts, and the tokens of sequences preempted by
    # recompute), by the cache tier their KV came from
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    # Admissions put off a step to read a page another sequence filled in it (in-batch sharing)
    num_deferred_admissions: int = 0
    num_offloaded_pages: int = 0  # evicted device pages saved to the host tier
    num_offload_evictions: int = 0  # host-tier pages dropped to make room
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    # Prompt tokens run through the forward (again after a preemption by recompute; the
    # samples of an n > 1 request share one run)
    num_prefill_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Share of verified draft tokens accepted (0 without speculative decoding)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
