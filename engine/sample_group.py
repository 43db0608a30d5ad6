"""n > 1 and best_of: the samples of one request, and how their outputs are handed out.

The first sample computes the prompt; the others start when its last prompt token runs,
sharing its pages and its logits row (``Scheduler._fork_samples``). Each sample streams its
own outputs, tagged with its ``index``; the request ends with its last sample, whose output
carries the usage of all of them (the prompt counted once). With ``best_of`` > ``n`` the
outputs are held back until every sample has ended, then the ``n`` with the highest
cumulative logprob (the sum of their sampled tokens' logprobs under the model) come back as
indexes ``0..n-1``, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, SequenceStatus, Usage


@dataclass(eq=False)
class SampleGroup:
    """The ``samples`` of one request (the first one computes the prompt) and the ``n``
    of them returned. ``hide_logprobs``: best_of asked for logprobs only to rank them."""

    samples: list[Sequence]
    n: int
    hide_logprobs: bool = False
    num_unfinished: int = 0
    _held: dict[int, StepOutput] = field(default_factory=dict)  # best_of, merged per sample

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.samples)

    @property
    def selects(self) -> bool:
        """More samples run than come back (best_of > n): outputs wait for the ranking."""
        return len(self.samples) > self.n

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    def collect(self, out: StepOutput) -> list[StepOutput]:
        """What to hand out for one sample's step output (``finished`` meaning that the
        sample ended): itself, the ends of samples that never started, or nothing yet."""
        outputs = [out]
        parent = self.samples[0]
        if out.finished and out.index == 0 and parent.forks:  # cancelled or timed out early
            outputs += [self._never_started(child, out) for child in parent.forks]
            parent.forks = []
        handed: list[StepOutput] = []
        for item in outputs:
            item.sample_finished, item.finished = item.finished, False
            if item.sample_finished:
                self.num_unfinished -= 1
            if self.selects:
                self._hold(item)
            else:
                handed.append(item)
        if self.selects:
            return self._best() if self.is_finished else []
        if self.is_finished:
            self._end(handed[-1])
        return handed

    def usage(self) -> Usage:
        parent = self.samples[0]
        num_output = sum(sample.num_output_tokens for sample in self.samples)
        return Usage(parent.num_prompt_tokens, num_output, parent.num_cached_tokens)

    def _never_started(self, child: Sequence, parent_out: StepOutput) -> StepOutput:
        child.status = SequenceStatus.FINISHED
        child.finish_reason = parent_out.finish_reason or FinishReason.CANCELLED
        return StepOutput(child.request_id, [], "", [], finished=True,
                          finish_reason=child.finish_reason, index=child.sample_index)  # fmt: skip

    def _end(self, last: StepOutput) -> None:
        last.finished = True
        last.usage = self.usage()

    def _hold(self, out: StepOutput) -> None:
        held = self._held.get(out.index)
        if held is None:
            self._held[out.index] = out
            return
        held.new_token_ids += out.new_token_ids
        held.text_delta += out.text_delta
        held.logprobs += out.logprobs
        held.sample_finished = out.sample_finished
        held.finish_reason, held.stop_reason = out.finish_reason, out.stop_reason

    def _best(self) -> list[StepOutput]:
        """The ``n`` held samples of highest cumulative logprob, renumbered best first."""
        ranked = sorted(self.samples, key=cumulative_logprob, reverse=True)[: self.n]
        best = []
        for rank, sample in enumerate(ranked):
            out = self._held[sample.sample_index]
            out.index = rank
            if self.hide_logprobs:
                out.logprobs = [None] * len(out.logprobs)
            best.append(out)
        self._end(best[-1])
        return best


def cumulative_logprob(seq: Sequence) -> float:
    """The sum of ``seq``'s sampled tokens' logprobs (those it has; ``-inf`` for none at all
    when it has tokens: a sample that could not be ranked comes last)."""
    known = [lp.logprob for lp in seq.output_logprobs if lp is not None]
    if seq.output_token_ids and not known:
        return float("-inf")
    return sum(known)


class SampleGroups:
    """The groups of the requests with several samples in flight, by request id."""

    def __init__(self) -> None:
        self._groups: dict[str, SampleGroup] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, group: SampleGroup) -> None:
        self._groups[group.samples[0].request_id] = group

    def collect(self, outputs: list[StepOutput], forget: Callable[[str], None]) -> list[StepOutput]:
        """Outputs of requests with several samples through their groups (the others pass
        as they are); ``forget`` is told of each request whose last sample ended."""
        collected = []
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:
                collected.append(out)
                continue
            collected += group.collect(out)
            if group.is_finished:
                del self._groups[out.request_id]
                forget(out.request_id)
        return collected


def check_num_samples(sampling: SamplingParams, max_seqs: int) -> None:
    """The samples of a request run at once: no more of them than ``max_seqs``."""
    if sampling.num_samples > max_seqs:
        name = "n" if sampling.best_of is None else "best_of"
        raise InvalidRequestError(
            name, f"{sampling.num_samples} samples cannot run at once: at most max_seqs "
            f"({max_seqs})",
        )  # fmt: skip


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed: ``seed + index``, kept within the 64 bits a generator takes."""
    value = seed + index
    return value - 2**64 if value >= 2**64 else value
