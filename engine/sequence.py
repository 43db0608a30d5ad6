"""``Sequence``: the one object that carries a request through every stage of the engine."""

from __future__ import annotations

import enum
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer
    from engine.sampler import TokenLogprobs
    from engine.structured.grammars import GrammarMatcher


# An output token sampled by a step still on the device: its id reaches the host one step
# later (asynchronous scheduling); the next step reads it from the device instead.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its pages live in host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(eq=False)
class Sequence:
    """A request in flight: its tokens, its KV pages and where it stands.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the tokens from there to
    the end still need a forward pass (the whole prompt at first, one token per decode step).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    priority: int = 0  # lower runs first (as in vLLM)
    tenant: str = "default"
    deadline_s: float | None = None  # monotonic clock
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table known to the prefix cache
    swapped_blocks: list[int] = field(default_factory=list)  # host slots while SWAPPED
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    # Trailing PENDING_TOKEN placeholders in output_token_ids (at most 2: one per step in flight)
    num_pending_tokens: int = 0
    # No more tokens past this many (prompt + max_tokens, within the model's context)
    length_limit: int = 1 << 62
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Where its output stands in its grammar (structured outputs); advanced with each token
    grammar: GrammarMatcher | None = None
    # Guessed next tokens (speculative decoding), set before each schedule; verified with it
    draft_token_ids: list[int] = field(default_factory=list)
    # [k, V] the draft model's distribution at each draft (a sampled request's drafts from a
    # draft model); None = each draft is a point mass (prompt lookup, greedy drafting)
    draft_probs: torch.Tensor | None = None
    # n > 1 / best_of: which sample of its request this is; the first one computes the prompt
    # and carries the others in ``forks`` until its last prompt token runs (see
    # ``Scheduler.fork``), when they start sharing its pages
    sample_index: int = 0
    forks: list[Sequence] = field(default_factory=list)
    # Its last page is shared with its samples (partial): copied before it is written
    shares_tail_page: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def picks_argmax(self) -> bool:
        """Whether its next token is simply the argmax of its logits: plain greedy, and past
        ``min_tokens`` (before it, EOS is suppressed)."""
        params = self.sampling
        return params.is_plain_greedy and len(self.output_token_ids) >= params.min_tokens

    def sampling_row(
        self, output_token_ids: Sequence_[int] | None = None, num_output_tokens: int | None = None
    ) -> SamplingRow:
        """Its sampling settings over ``output_token_ids`` (default: its own), with EOS and
        stop ids suppressed while fewer than ``min_tokens`` are out (default: its count)."""
        params = self.sampling
        num_output = self.num_output_tokens if num_output_tokens is None else num_output_tokens
        suppressed: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            suppressed = (*self.eos_token_ids, *params.stop_token_ids)
        output = self.output_token_ids if output_token_ids is None else output_token_ids
        return SamplingRow(params, self.prompt_token_ids, output, self.generator, suppressed)

    def known_sampling_row(self) -> SamplingRow:
        """``sampling_row`` over the output tokens the host has, without the trailing
        placeholders of the steps in flight (a row sampled after its step's was appended)."""
        known = self.output_token_ids[: len(self.output_token_ids) - self.num_pending_tokens]
        return self.sampling_row(known, len(known))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its tokens whose ids the host has: all but the picks of steps still in flight."""
        return self.num_tokens - self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def awaits_last_token(self) -> bool:
        """Its last token is sampled but not yet seen: no further step may run it."""
        return self.num_pending_tokens > 0 and self.num_tokens >= self.length_limit

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_id(self, index: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if index < num_prompt:
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - num_prompt]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
