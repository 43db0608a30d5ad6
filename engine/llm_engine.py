"""``LLMEngine``: the step-level engine the worker drives (and ``LLM`` wraps offline).

``add_request`` and ``abort`` may be called from any thread: they validate at once (raising
``InvalidRequestError``) and queue the change; ``step`` applies queued changes, schedules,
runs the model once and returns what every sequence that advanced produced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed.group import TensorParallelGroup
from engine.distributed.ranks import RankProcesses, check_devices, rank_device
from engine.distributed.shard import ShardPlan
from engine.errors import InvalidRequestError
from engine.inputs import (
    ChatTemplateOptions,
    PromptEncoder,
    check_request_fields,
    max_tokens_within_context,
)
from engine.loader import find_model
from engine.memory import prefer_expandable_segments
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, StepOutput
from engine.runtime import RankSetup, build_prefill_shapes, setup_rank
from engine.sample_group import SampleGroup, SampleGroups, check_num_samples, sample_seed
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus
from engine.step_profile import StepProfiler
from engine.step_types import LaunchedStep, SampledToken
from engine.structured.drafts import keep_valid_drafts
from engine.structured.grammars import GrammarCompiler

logger = logging.getLogger("pagestream.engine")


def _stop_ranks(ranks: RankProcesses, runner: weakref.ref[ModelRunner]) -> None:
    """The engine's finalizer: it holds the runner weakly, so that it keeps nothing alive."""

    def release() -> None:
        alive = runner()
        if alive is not None:
            alive.release_cuda_graphs()

    ranks.stop(release)


@dataclass
class _Inbox:
    """Changes queued by other threads, applied at the start of the next step."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    added: list[Sequence] = field(default_factory=list)
    groups: list[SampleGroup] = field(default_factory=list)  # of added requests with n > 1
    aborted: list[str] = field(default_factory=list)
    known_ids: set[str] = field(default_factory=set)


class LLMEngine:
    """The engine of one process; with ``tensor_parallel_size`` N > 1 it is rank 0 of N: it
    starts the other ranks, schedules and samples, and sends them each step. ``shutdown``
    stops them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = rank_device(config, 0)
        if self.device.type == "cuda":
            prefer_expandable_segments()
        self.ranks: RankProcesses | None = None
        self.group = TensorParallelGroup()
        self._stop_ranks: weakref.finalize[Any, Any] | None = None
        if config.tensor_parallel_size > 1:
            check_devices(config)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.ranks = RankProcesses(config)
        try:
            source = find_model(config.model)  # once, before any rank starts
            ShardPlan.for_arch(source.arch, 0, config.tensor_parallel_size)  # a size that fits
            with self._collectives():
                if self.ranks is not None:
                    self.group = self.ranks.start(self.device, source)
                setup = setup_rank(config, self.device, self.group, source)
        except BaseException:
            if self.ranks is not None:  # failing or stuck in the start: they are not told
                self.ranks.stop()
            raise
        self._take_setup(setup)
        if self.ranks is not None:  # at shutdown(), or at exit if it is never called
            self._stop_ranks = weakref.finalize(
                self, _stop_ranks, self.ranks, weakref.ref(self.runner)
            )

    def _take_setup(self, setup: RankSetup) -> None:
        config, runtime, backend = self.config, setup.runtime, setup.backend
        self.attention_backend = backend
        self.dtype, self.loaded = setup.dtype, setup.loaded
        self.max_model_len = setup.max_model_len
        self.tokenizer = self.loaded.tokenizer
        self.prompt_encoder = PromptEncoder(
            config.model, self.tokenizer, self.loaded.arch.vocab_size, self.max_model_len
        )
        self.eos_token_ids = self.loaded.eos_token_ids
        self.grammars = GrammarCompiler(
            self.tokenizer, self.loaded.arch.vocab_size, self.eos_token_ids
        )
        self.kv_cache, self.block_manager = runtime.kv_cache, runtime.block_manager
        self.host_pool, self.runner = runtime.host_pool, runtime.runner
        self.pool_source = runtime.plan.source
        self.scheduler = Scheduler(config, self.block_manager, self.host_pool)
        self._inbox = _Inbox()
        self.outputs = OutputProcessor(
            self.scheduler, self._forget, self.runner.grammar_masks.accept_tokens
        )
        self.async_scheduling = config.async_scheduling_wanted(self.device.type)
        self.proposer = runtime.proposer
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._in_flight: LaunchedStep | None = None  # launched, picks not yet seen
        self.step_profiler = StepProfiler(enabled=False)  # benchmarks turn it on
        self._num_steps = 0
        self._step_time_s = 0.0
        self._request_counter = itertools.count()
        self._groups = SampleGroups()  # requests with n > 1 in flight
        self._num_prefill_tokens = 0
        self._build_shapes = functools.partial(build_prefill_shapes, setup, config, self.device)
        self._prepared_threads: set[int] = set()
        torch.manual_seed(config.seed)
        logger.info(
            "engine ready: model=%s device=%s dtype=%s backend=%s prefill_attention=%s "
            "cuda_graphs=%s tensor_parallel=%d load=%.1fs",
            config.model, self.device, self.dtype, backend.name, self.prefill_attention,
            self.runner.uses_cuda_graphs, self.group.size, self.loaded.load_s,
        )  # fmt: skip

    @property
    def prefill_attention(self) -> str:
        """What attends prefill chunks on this rank: ``triton``, ``sdpa`` or ``sdpa-exact`` on
        the Triton backend (``PAGESTREAM_PREFILL_ATTN``; ``triton`` once cuDNN refused one),
        ``torch`` on the torch backend."""
        return self.attention_backend.prefill_attention

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their group (nothing to do at
        tensor_parallel_size 1), within seconds whatever state they are in. The engine cannot
        step afterwards."""
        if self._stop_ranks is not None:
            self._stop_ranks()  # runs once

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        template: ChatTemplateOptions | None = None,
        sampling: SamplingParams | None = None,
        priority: int = 0,
        tenant: str = "default",
        timeout_s: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ``InvalidRequestError``, also
        when the prompt + ``max_tokens`` exceeds the context (see ``SamplingParams``)."""
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        sampling = sampling or SamplingParams()
        token_ids = self.encode_prompt(prompt, prompt_token_ids, messages, template)
        max_tokens = max_tokens_within_context(
            sampling, len(token_ids), self.max_model_len, clamp=self.config.clamp_max_tokens
        )
        sampling = sampling.with_max_tokens(max_tokens)
        check_request_fields(priority, tenant, timeout_s)
        check_num_samples(sampling, self.config.max_seqs)
        now_s = time.monotonic()
        deadline_s = None if timeout_s is None else now_s + timeout_s
        group = None
        hide_logprobs = sampling.num_samples > sampling.n and sampling.logprobs is None
        if hide_logprobs:
            sampling = dataclasses.replace(sampling, logprobs=0)  # best_of ranks by logprob

        def sample(index: int) -> Sequence:
            return self._new_sequence(request_id, token_ids, sampling, now_s, index,
                                      priority=priority, tenant=tenant, deadline_s=deadline_s)  # fmt: skip

        seq = sample(0)
        if sampling.num_samples > 1:
            seq.forks = [sample(index) for index in range(1, sampling.num_samples)]
            group = SampleGroup([seq, *seq.forks], sampling.n, hide_logprobs=hide_logprobs)
        with self._inbox.lock:
            if request_id in self._inbox.known_ids:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            self._inbox.known_ids.add(request_id)
            self._inbox.added.append(seq)
            if group is not None:
                self._inbox.groups.append(group)
        return request_id

    def _new_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        now_s: float,
        index: int,
        **scheduling: Any,
    ) -> Sequence:
        """Sample ``index`` of a request: its own seed stream (``seed + index``) and text."""
        max_tokens = sampling.max_tokens
        assert max_tokens is not None, "set within the context by add_request"
        seed = None if sampling.seed is None else sample_seed(sampling.seed, index)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            arrival_s=now_s,
            eos_token_ids=frozenset() if sampling.ignore_eos else self.eos_token_ids,
            length_limit=len(token_ids) + max_tokens,  # within the context
            generator=None if seed is None else make_generator(seed, self.device),
            sample_index=index,
            # compiled once per constraint (cached), on the caller's thread: never on the
            # step's path; a matcher of its own per sample
            grammar=None
            if sampling.structured is None
            else self.grammars.matcher_for(sampling.structured),
            **scheduling,
        )
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=sampling.skip_special_tokens,
                stop=sampling.stop,
                include_stop_str_in_output=sampling.include_stop_str_in_output,
            )
        return seq

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are freed at the start of the next step."""
        with self._inbox.lock:
            self._inbox.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._inbox.lock:
            pending = bool(self._inbox.added or self._inbox.aborted)
        return pending or self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def encode_prompt(
        self,
        prompt: str | None = None,
        prompt_token_ids: Seq[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        template: ChatTemplateOptions | None = None,
    ) -> list[int]:
        """The prompt's token ids, checked against the vocabulary and the context length;
        ``template``: tools and keyword arguments for the chat template of ``messages``."""
        return self.prompt_encoder.encode(prompt, prompt_token_ids, messages, template)

    # -- stepping ------------------------------------------------------------------------------

    def step(self, while_gpu_busy: Callable[[], None] | None = None) -> list[StepOutput]:
        """Run one engine step; outputs of every sequence that advanced or ended.

        ``while_gpu_busy`` runs once the step's forward is launched, before the host waits for
        it: a caller on another thread can hand off the previous step's outputs there, so that
        their processing overlaps the GPU's work instead of this thread's (they share the GIL).

        With asynchronous scheduling the step schedules and launches the next forward before
        it looks at the picks of the one before, which is still on the device: each decode
        row's input comes from the device, and the returned outputs are that earlier step's.
        The host's work (scheduling, inputs, stop checks, detokenizing) then overlaps the GPU's.

        Under tensor parallelism a rank that died raises ``EngineDeadError`` here.
        """
        self.prepare_thread()
        # the whole step: a dead peer can also leave this rank waiting for its picks
        with self._collectives():
            return self._step(while_gpu_busy)

    def prepare_thread(self) -> None:
        """Build, once per thread, what this thread's steps would otherwise build the first
        time they meet it: the prefill path's kernels for each shape of a full chunk, which
        torch keeps per thread (``AttentionBackend.build_prefill_shapes``; seconds, and only
        with cuDNN's path on). ``step`` calls it; a caller that steps on a thread of its own
        calls it there first, before any request waits on that thread."""
        thread = threading.get_ident()
        if thread not in self._prepared_threads:
            self._prepared_threads.add(thread)
            self._build_shapes()

    def _step(self, while_gpu_busy: Callable[[], None] | None) -> list[StepOutput]:
        start_s = time.perf_counter()
        profiler = self.step_profiler
        profiler.begin_step()
        outputs = self._apply_inbox()
        if self._in_flight is not None and self._in_flight_needs_history():
            outputs += self._process(self._take_in_flight())  # its picks feed penalties
        if self.proposer is not None:
            # drafts are checked against the grammars next: the step in flight is sampled
            self.runner.sample_constrained(self._in_flight)
            self.proposer.propose(self.scheduler.running)
            keep_valid_drafts(self.scheduler.running)
        batch = self.scheduler.schedule(time.monotonic())
        outputs += [self.outputs.finished_output(seq) for seq in batch.finished]
        profiler.before_launch(self.device)
        launched = self.runner.launch(batch, self._in_flight)
        profiler.after_launch()
        if launched is not None and while_gpu_busy is not None:
            while_gpu_busy()
        self._advance(batch)
        previous, self._in_flight = self._in_flight, launched
        constrained = None  # launched, its sampling deferred until its grammars are ready
        if launched is not None and launched.unsampled_logits is not None:
            constrained = launched
        if previous is not None:  # its tokens advance the grammars, then constrained's masks
            outputs += self._process(previous, constrained)  # fill beside the rest of it
        # constrained is sampled by the next step's launch, once that step is scheduled and
        # its inputs built: the fill goes on meanwhile (or by _process, before its picks)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._process(self._take_in_flight())
        if self._groups:
            outputs = self._groups.collect(outputs, self._forget_id)
        profiler.end_step(batch.scheduled)
        self._num_steps += 1
        self._step_time_s += time.perf_counter() - start_s
        return outputs

    def _collectives(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.ranks is None else self.ranks.collectives()

    def _take_in_flight(self) -> LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        return launched

    def _in_flight_needs_history(self) -> bool:
        """Whether a row of the step in flight samples from its own past tokens (penalties):
        its pick must be seen before the next step is scheduled."""
        assert self._in_flight is not None
        return any(e.seq.sampling.has_penalties for e in self._in_flight.sampling_entries)

    def _apply_inbox(self) -> list[StepOutput]:
        with self._inbox.lock:
            added, self._inbox.added = self._inbox.added, []
            aborted, self._inbox.aborted = self._inbox.aborted, []
            groups, self._inbox.groups = self._inbox.groups, []
        for group in groups:
            self._groups.add(group)
        for new_seq in added:
            self.scheduler.add(new_seq)
        outputs = []
        for request_id in aborted:
            for seq in self.scheduler.find_all(request_id):
                self.scheduler.finish(seq, FinishReason.CANCELLED)
                outputs.append(self.outputs.finished_output(seq))
        return outputs

    def _advance(self, batch: ScheduledBatch) -> None:
        """The batch's tokens are computed (launched); each sampling row gets a pending output
        token. The blocks a chunk filled are published at once: the next step, scheduled
        while this one runs, may read them (``BlockManager.register_full_blocks``)."""
        bm = self.block_manager
        for entry in batch.scheduled:
            seq = entry.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prefill chunk
                num_prompt_left = seq.num_prompt_tokens - seq.num_computed_tokens
                self._num_prefill_tokens += min(entry.num_new_tokens, num_prompt_left)
            # drafts count once accepted (see OutputProcessor.append_sampled)
            seq.num_computed_tokens += entry.num_new_tokens - len(entry.draft_token_ids)
            if entry.num_new_tokens > 1 and not entry.draft_token_ids:
                bm.register_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # it samples
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
        for _, sample in batch.forks:  # its first token comes from its parent's row
            sample.output_token_ids.append(PENDING_TOKEN)
            sample.num_pending_tokens += 1

    def _process(
        self, launched: LaunchedStep, constrained: LaunchedStep | None = None
    ) -> list[StepOutput]:
        """Take in a launched step's picks: tokens, stop checks, prefix-cache blocks. Once
        its tokens have advanced the grammars, the masks of ``constrained`` (the next step,
        launched, with grammars) start filling on another thread."""
        self.runner.sample_constrained(launched)  # if deferred: its grammars have their tokens
        wait_start_s = time.perf_counter()
        tokens = launched.resolve()  # waits for the device's picks
        self.step_profiler.add_wait(time.perf_counter() - wait_start_s)
        if self.proposer is not None:
            self._count_drafts(launched, tokens)
        start_fill = None
        if constrained is not None:
            start_fill = functools.partial(self.runner.start_mask_fill, constrained)
        outputs = self.outputs.append_all(tokens, start_fill)
        bm = self.block_manager
        for entry in launched.scheduled:
            seq = entry.seq
            if entry.draft_token_ids and not seq.is_finished:
                bm.trim(seq)  # pages taken for rejected drafts
            # every computed token is known now: a filled block can be published for sharing
            if not seq.is_finished and seq.num_computed_tokens // bm.block_size > (
                seq.num_registered_blocks
            ):
                bm.register_full_blocks(seq)
        return outputs

    def _count_drafts(self, launched: LaunchedStep, tokens: list[SampledToken]) -> None:
        self._num_draft_tokens += sum(len(entry.draft_token_ids) for entry in launched.scheduled)
        self._num_accepted_tokens += sum(len(token.accepted_draft_ids) for token in tokens)

    def _forget(self, seq: Sequence) -> None:
        """An ended sequence's id may be used again (that of a request with n > 1 once its
        last sample ends: ``_collect_samples``)."""
        if seq.request_id in self._groups:
            return
        self._forget_id(seq.request_id)

    def _forget_id(self, request_id: str) -> None:
        with self._inbox.lock:
            self._inbox.known_ids.discard(request_id)

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        host = bm.host_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_pages_used=bm.num_used_blocks,
            num_pages_free=bm.num_free_blocks,
            prefix_hit_rate=bm.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            step_time_s=self._step_time_s,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
            num_device_hit_tokens=self.scheduler.num_device_hit_tokens,
            num_host_hit_tokens=self.scheduler.num_host_hit_tokens,
            num_deferred_admissions=self.scheduler.num_deferred_admissions,
            num_prefill_tokens=self._num_prefill_tokens,
            num_offloaded_pages=host.num_offloaded_pages if host is not None else 0,
            num_offload_evictions=host.num_evictions if host is not None else 0,
        )

    def sequence(self, request_id: str) -> Sequence | None:
        return self.scheduler.find(request_id)


__all__ = ["EngineStats", "LLMEngine", "SequenceStatus", "StepOutput"]
