"""A step's picks into each sequence's output: tokens appended one by one with their stop
conditions checked (a stop inside a step's accepted drafts ends the sequence there, and the
drafts after it were never produced), text detokenized, ended sequences finished."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.outputs import StepOutput
from engine.sampler import TokenLogprobs
from engine.scheduler import Scheduler
from engine.sequence import PENDING_TOKEN, FinishReason, Sequence
from engine.step_types import SampledToken
from engine.structured.grammars import accept_one_by_one

if TYPE_CHECKING:
    from engine.structured.grammars import GrammarMatcher

logger = logging.getLogger("pagestream.engine")
# grammars taking one token each: whether each took it
AcceptTokens = Callable[[list[tuple["GrammarMatcher", int]]], list[bool]]


class OutputProcessor:
    """Appends sampled tokens to their sequences and ends those that stop.

    ``on_finished`` is told of every sequence that ends here (the engine forgets its id).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_finished: Callable[[Sequence], None],
        accept_tokens: AcceptTokens | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.on_finished = on_finished
        # grammars taking one token each, together (GrammarMasks.accept_tokens: in parallel)
        self.accept_tokens: AcceptTokens = accept_tokens or accept_one_by_one

    def append_all(
        self, tokens: list[SampledToken], on_grammars_advanced: Callable[[], None] | None = None
    ) -> list[StepOutput]:
        """Append each row's tokens, rows of ended sequences left out. Every grammar takes its
        row's tokens first; then ``on_grammars_advanced`` runs (the engine starts filling the
        next step's masks there, on another thread) and the rest (text, stop checks) follows."""
        tokens = [token for token in tokens if not token.seq.is_finished]
        grammar_ends = self._grammar_ends(tokens)
        if on_grammars_advanced is not None:
            on_grammars_advanced()
        return [
            self._append_sampled(token, end)
            for token, end in zip(tokens, grammar_ends, strict=True)
        ]

    def _grammar_ends(self, tokens: list[SampledToken]) -> list[int | None]:
        """``_grammar_end`` of each row: the rows with one token (no drafts) take theirs in
        one ``accept_tokens`` call, the others one token at a time."""
        ends: list[int | None] = [None] * len(tokens)
        single = []  # (row, grammar, token): one token to take
        for row, token in enumerate(tokens):
            grammar = token.seq.grammar
            if grammar is None:
                continue
            if token.accepted_draft_ids:
                ends[row] = _grammar_end(token)
            else:
                single.append((row, grammar, token.token_id))
        if single:
            taken = self.accept_tokens([(grammar, token_id) for _, grammar, token_id in single])
            for (row, grammar, token_id), ok in zip(single, taken, strict=True):
                ends[row] = _end_after(tokens[row].seq, grammar, token_id, 0, ok)
        return ends

    def _append_sampled(self, sampled: SampledToken, grammar_end: int | None) -> StepOutput:
        """Append a row's accepted drafts and its sampled token, stopping at the first that
        ends the sequence (``grammar_end``: the index of the one that ends its grammar); the
        tokens after it were never produced."""
        seq = sampled.seq
        new_token_ids = [*sampled.accepted_draft_ids, sampled.token_id]
        logprobs = [*sampled.draft_logprobs, sampled.logprobs]
        text_delta = ""
        for index, token_id in enumerate(new_token_ids):
            if index:  # the token before was a draft run in this step: its KV is cached
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
            ends_grammar = index == grammar_end
            text_delta += self._append_token(seq, token_id, logprobs[index], ends_grammar)
            if seq.is_finished:
                del new_token_ids[index + 1 :], logprobs[index + 1 :]
                break
        finished = seq.is_finished
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            text_delta=text_delta,
            logprobs=logprobs,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            usage=seq.usage() if finished else None,
            index=seq.sample_index,
        )

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None, ends_grammar: bool
    ) -> str:
        """Fill ``seq``'s oldest pending token and check its stop conditions; the text delta."""
        index = len(seq.output_token_ids) - seq.num_pending_tokens  # its oldest pending token
        seq.output_token_ids[index] = token_id
        seq.num_pending_tokens -= 1
        seq.output_logprobs.append(logprobs)
        text_delta = ""
        num_output = index + 1
        stop_token = self._is_stop_token(seq, token_id, num_output)
        # A stop token (EOS, stop_token_ids) ends the output without its text, as in vLLM,
        # unless include_stop_str_in_output asks for it; its id stays in the token ids.
        hidden = stop_token and not seq.sampling.include_stop_str_in_output
        if seq.detokenizer is not None and not hidden:
            delta = seq.detokenizer.add_tokens([token_id])
            text_delta = delta.text
            if delta.stopped:
                seq.stop_reason = delta.stop_reason
                self._finish(seq, FinishReason.STOP)
        if not seq.is_finished:
            reason = self._stop_reason(seq, token_id, num_output, stop_token)
            if reason is not None:
                text_delta += self._finish(seq, reason)
        if ends_grammar and not seq.is_finished:
            text_delta += self._finish(seq, FinishReason.STOP)
        return text_delta

    @staticmethod
    def _is_stop_token(seq: Sequence, token_id: int, num_output: int) -> bool:
        """Whether ``token_id``, ``seq``'s ``num_output``-th output token, ends it by itself."""
        if num_output < seq.sampling.min_tokens:
            return False
        return token_id in seq.sampling.stop_token_ids or token_id in seq.eos_token_ids

    @staticmethod
    def _stop_reason(
        seq: Sequence, token_id: int, num_output: int, stop_token: bool
    ) -> FinishReason | None:
        """Why ``seq`` ends with ``token_id``, its ``num_output``-th output token
        (``stop_token``: one that ends it by itself), if it does."""
        if stop_token:
            if token_id in seq.sampling.stop_token_ids:
                seq.stop_reason = token_id
            return FinishReason.STOP
        if len(seq.prompt_token_ids) + num_output >= seq.length_limit:  # max_tokens reached
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> str:
        """End ``seq`` now (pages freed); returns text that was held back, if any."""
        self.scheduler.finish(seq, reason)
        _drop_pending(seq)
        self.on_finished(seq)
        if seq.detokenizer is None or isinstance(seq.stop_reason, str):
            return ""  # a stop string ends the text where it matched
        text = seq.detokenizer.flush()
        if seq.detokenizer.stop_reason is not None:  # found in the last, just-completed char
            seq.stop_reason, seq.finish_reason = seq.detokenizer.stop_reason, FinishReason.STOP
        return text

    def finished_output(self, seq: Sequence) -> StepOutput:
        """Output for a sequence ended outside sampling (cancel, timeout)."""
        _drop_pending(seq)
        self.on_finished(seq)
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            text_delta="",
            logprobs=[],
            finished=True,
            finish_reason=seq.finish_reason,
            usage=seq.usage(),
            index=seq.sample_index,
        )


def _grammar_end(sampled: SampledToken) -> int | None:
    """Advance the row's grammar past its tokens (accepted drafts, then the sampled one); the
    index of the token that ends the output: it is complete with it and nothing but EOS may
    follow, or the grammar refuses it (its mask allowed it, so this is a bug: the sequence
    ends rather than put out text that does not parse). A token after a stop the grammar
    also takes: that sequence ends, and its grammar is not asked again."""
    grammar = sampled.seq.grammar
    if grammar is None:
        return None
    for index, token_id in enumerate([*sampled.accepted_draft_ids, sampled.token_id]):
        end = _end_after(sampled.seq, grammar, token_id, index, grammar.accept(token_id))
        if end is not None:
            return end
    return None


def _end_after(
    seq: Sequence, grammar: GrammarMatcher, token_id: int, index: int, accepted: bool
) -> int | None:
    """``index`` if the token there (which the grammar took, or refused) ends the output."""
    if not accepted:
        logger.error(
            "request %s: token %d is outside its grammar; ending it", seq.request_id, token_id
        )
        return index
    return index if grammar.is_terminated else None


def _drop_pending(seq: Sequence) -> None:
    """Forget the picks of steps in flight for an ended sequence: they were never its tokens."""
    if seq.num_pending_tokens:
        del seq.output_token_ids[-seq.num_pending_tokens :]
        seq.num_pending_tokens = 0
