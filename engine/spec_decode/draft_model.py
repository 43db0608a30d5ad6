"""Drafts from a small model (``--speculative-model``) with its own page pool.

Each target sequence that decodes has a shadow sequence in the draft model's pool: the same
tokens, its own pages and its own count of computed tokens. A step first lets the draft model
catch up on the tokens it has not seen (the prompt at first, then the accepted tokens), then
samples ``k`` tokens one at a time with the request's own sampling settings, keeping the
distribution of each (what rejection sampling divides by). Draft KV of rejected drafts is
dropped by rolling the shadow back to the tokens both models agree on.

After the prompt every pass runs one token per row, the catch-up on accepted tokens included,
so that on a GPU each pass replays a decode graph (the draft has no piecewise graphs): a
two-token catch-up pass ran eagerly and cost a step 27 ms where a plain step took 0.94
(smollm2-135m, batch 1, H100). Greedy rows' passes are queued back to back, each reading
the previous pass's picks on the device, and read back once: the draft model's function
inside an 8B-sized target (bench/spec_pair.py) went from 1.44x to 1.91x plain decoding at
batch 1 and from 1.30x to 1.56x at batch 8 (H100), where each pass used to wait for its
picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampler import draw_noise, exponential_race
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import PENDING_TOKEN, Sequence
from engine.spec_decode.proposer import max_drafts
from engine.step_types import LaunchedStep

SHADOW_TENANT = "draft"


def load_draft_model(
    config: EngineConfig,
    target: LoadedModel,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_model_len: int,
) -> LoadedModel | None:
    """The ``--speculative-model``, checked against the target (None without one)."""
    name = config.speculative_model
    if name is None:
        return None
    draft = load_model(name, dtype, device, backend, max_model_len, config.seed)
    check_draft_model(target, draft, name, max_model_len)
    return draft


def check_draft_model(
    target: LoadedModel, draft: LoadedModel, draft_name: str, max_model_len: int
) -> None:
    """Refuse a draft model whose token ids mean something else than the target's, or whose
    context is shorter than the sequences it must follow."""
    if draft.arch.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"speculative_model {draft_name!r} has a context of "
            f"{draft.arch.max_position_embeddings} tokens, shorter than max_model_len "
            f"({max_model_len}): lower --max-model-len"
        )
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"speculative_model {draft_name!r} has a vocabulary of {draft.arch.vocab_size} "
            f"tokens, the model {target.arch.vocab_size}: a draft model must share the "
            "model's tokenizer"
        )
    mine, theirs = target.tokenizer, draft.tokenizer
    if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
        raise ConfigError(
            f"speculative_model {draft_name!r} has another tokenizer than the model: the "
            "same ids would be other tokens"
        )


@dataclass(eq=False)
class _Shadow:
    seq: Sequence  # in the draft pool: the target's tokens, then this step's drafts
    num_synced_outputs: int = 0  # target output tokens copied at the last sync


class DraftModelProposer:
    """Sets ``draft_token_ids`` and ``draft_probs`` by running the draft model."""

    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        num_tokens: int,
        max_batched_tokens: int,
    ) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.num_tokens = num_tokens
        self.max_batched_tokens = max_batched_tokens
        self._shadows: dict[Sequence, _Shadow] = {}

    def propose(self, running: list[Sequence]) -> None:
        live = set(running)
        for seq in [seq for seq in self._shadows if seq not in live]:
            self._drop(seq)  # finished or preempted: its draft pages go back
        wanted: dict[Sequence, int] = {}
        for seq in running:
            seq.draft_token_ids, seq.draft_probs = [], None
            k = max_drafts(seq, self.num_tokens)
            if k and self._prepare(seq, k):
                wanted[seq] = k
        if wanted:
            self._draft(wanted)

    # -- shadows -------------------------------------------------------------------------------

    def _prepare(self, seq: Sequence, k: int) -> bool:
        """Sync ``seq``'s shadow with its tokens and take pages for catching up and ``k``
        drafts; False (shadow dropped) when the draft pool is full."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = _Shadow(
                Sequence(
                    seq.request_id, seq.prompt_token_ids, seq.sampling, seq.arrival_s,
                    tenant=SHADOW_TENANT, eos_token_ids=seq.eos_token_ids, generator=seq.generator,
                )
            )  # fmt: skip
            self._shadows[seq] = shadow
        _sync(shadow, seq)
        # drafts under the request's grammar, from where its accepted tokens left it
        shadow.seq.grammar = None if seq.grammar is None else seq.grammar.copy()
        # the last of the k drafts is sampled but never run
        num_new = shadow.seq.num_uncomputed_tokens + k - 1
        if not self.block_manager.allocate_slots(shadow.seq, num_new):
            self._drop(seq)
            return False
        return True

    def _drop(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq)
        self.block_manager.free(shadow.seq)

    # -- drafting ------------------------------------------------------------------------------

    def _draft(self, wanted: dict[Sequence, int]) -> None:
        """Catch up, then sample one draft per pass. A short catch-up (the tokens the last
        verify step accepted, at most K + 1) runs as one-token passes beside the rows already
        drafting, so every pass is a decode step (a CUDA graph replay on a GPU); a long one
        (a prompt, a resumed sequence) first runs as one chunk within the token budget, and a
        row whose chunk does not reach its last token drafts nothing this step.

        When every row is greedy the passes are queued without waiting: each pass's picks
        stay on the device and feed the next pass (as asynchronous scheduling feeds a step),
        and the host reads them all once the last pass is queued. Otherwise the passes wait
        for each other: a sampled row needs the distribution of each draft, and penalties
        count the tokens drawn so far, which must be on the host."""
        shadows = {self._shadows[seq].seq: k for seq, k in wanted.items()}
        chunked, budget = ScheduledBatch(), self.max_batched_tokens
        for shadow in shadows:
            if shadow.num_uncomputed_tokens > self.num_tokens + 1 and budget:
                num_new = min(shadow.num_uncomputed_tokens, budget)
                chunked.scheduled.append(ScheduledSeq(shadow, num_new))
                budget -= num_new
        # rows whose chunk stops short of their last token: no drafts this step
        left_behind = {
            e.seq for e in chunked.scheduled if e.num_new_tokens < e.seq.num_uncomputed_tokens
        }
        # as asynchronous scheduling: a row may run ahead of its picks unless its sampling
        # reads its own past tokens (penalties; the engine's _in_flight_needs_history)
        # a grammar's mask needs each draft on the host before the next pass, too
        if all(
            s.sampling.is_greedy and not s.sampling.has_penalties and s.grammar is None
            for s in shadows
        ):
            drafted = self._draft_queued(shadows, chunked, left_behind)
        else:
            drafted = self._draft_waiting(shadows, chunked, left_behind)
        for seq in wanted:
            shadow = self._shadows[seq].seq
            probs = drafted.get(shadow)
            if probs:
                seq.draft_token_ids = shadow.output_token_ids[-len(probs) :]
                seq.draft_probs = _stack(probs)

    @staticmethod
    def _next_rows(
        shadows: dict[Sequence, int], drawn: dict[Sequence, int], left_behind: set[Sequence]
    ) -> ScheduledBatch:
        """One token each: the next catch-up token, or the draft just drawn."""
        return ScheduledBatch(
            [
                ScheduledSeq(shadow, 1)
                for shadow, k in shadows.items()
                if shadow not in left_behind and drawn[shadow] < k
            ]
        )

    def _draft_waiting(
        self, shadows: dict[Sequence, int], first: ScheduledBatch, left_behind: set[Sequence]
    ) -> dict[Sequence, list[torch.Tensor | None]]:
        """Pass by pass, each draft read back before the next pass: shadow -> the
        distributions its drafts were drawn from (None for a greedy row's)."""
        probs: dict[Sequence, list[torch.Tensor | None]] = {shadow: [] for shadow in shadows}
        batch = first
        while True:
            for shadow, (token_id, q) in self._step(batch).items():
                shadow.output_token_ids.append(token_id)
                probs[shadow].append(q)
                if shadow.grammar is not None and shadow.grammar.is_usable:
                    shadow.grammar.accept(token_id)
            batch = self._next_rows(shadows, {s: len(p) for s, p in probs.items()}, left_behind)
            if batch.is_empty:
                return probs

    def _draft_queued(
        self, shadows: dict[Sequence, int], first: ScheduledBatch, left_behind: set[Sequence]
    ) -> dict[Sequence, list[torch.Tensor | None]]:
        """Greedy rows without penalties: every pass queued behind the last, each draft a
        ``PENDING_TOKEN`` on the host until the passes are all queued, then read back at once
        (nothing reads a row's earlier drafts on the host in between; ``min_tokens`` counts
        them, which the placeholders keep right)."""
        launched: list[LaunchedStep] = []
        drawn: dict[Sequence, int] = dict.fromkeys(shadows, 0)
        batch = first
        while True:
            step = None
            if not batch.is_empty:
                step = self.runner.launch(batch, launched[-1] if launched else None)
                for entry in batch.scheduled:
                    entry.seq.num_computed_tokens += entry.num_new_tokens
            if step is not None and step.sample is not None:
                for entry in step.sampling_entries:
                    entry.seq.output_token_ids.append(PENDING_TOKEN)
                    drawn[entry.seq] += 1
                launched.append(step)
            batch = self._next_rows(shadows, drawn, left_behind)
            if batch.is_empty:
                break
        picks: dict[Sequence, list[int]] = {shadow: [] for shadow in shadows}
        for step in launched:
            for token in step.resolve():
                picks[token.seq].append(token.token_id)
        for shadow, tokens in picks.items():
            if tokens:
                shadow.output_token_ids[-len(tokens) :] = tokens
        return {shadow: [None] * len(tokens) for shadow, tokens in picks.items()}

    def _step(self, batch: ScheduledBatch) -> dict[Sequence, tuple[int, torch.Tensor | None]]:
        """Run the draft model over ``batch``; each row that reaches its last token draws
        one token: shadow -> (token, [V] the distribution it was drawn from; None for a
        greedy row, whose draft is a point mass)."""
        if batch.is_empty:
            return {}
        logits, entries = self.runner.sampling_logits(batch)
        for entry in batch.scheduled:
            entry.seq.num_computed_tokens += entry.num_new_tokens
        if logits is None:
            return {}
        self.runner.grammar_masks.apply(logits, entries, [])  # rows with grammars only
        rows = [entry.seq.sampling_row() for entry in entries]
        probs = self.runner.sampler.target_probs(logits, rows)  # [R, V]; greedy rows one-hot
        token_ids = exponential_race(probs, draw_noise(rows, probs.shape[1], probs.device))
        drawn = {}
        for row, (entry, token_id) in enumerate(zip(entries, token_ids.tolist(), strict=True)):
            # a copy: a view would keep the whole [R, V] table alive until the drafts end
            q = None if entry.seq.sampling.is_greedy else probs[row].clone()
            drawn[entry.seq] = (token_id, q)
        return drawn


def _stack(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, V] the distributions a sampled request's drafts came from; None when greedy."""
    kept = [q for q in probs if q is not None]
    return torch.stack(kept) if len(kept) == len(probs) else None


def _sync(shadow: _Shadow, seq: Sequence) -> None:
    """Give the shadow the target's tokens; KV of drafts the target rejected is dropped, and
    the last token is always left to run, for the logits of the first draft (when last
    step's drafts went unverified, the shadow had seen every token)."""
    mine, theirs = shadow.seq.output_token_ids, seq.output_token_ids
    common = shadow.num_synced_outputs
    while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
        common += 1
    del mine[common:]
    mine += theirs[common:]
    shadow.num_synced_outputs = len(theirs)
    num_valid = len(seq.prompt_token_ids) + common
    shadow.seq.num_computed_tokens = min(shadow.seq.num_computed_tokens, num_valid - 1)
