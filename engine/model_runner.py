"""Turns a scheduled batch into device tensors, runs the model and samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.attention.backend import PrefixGroup, SharedPrefix, find_shared_prefixes
from engine.cuda_graphs import DecodeGraphs
from engine.distributed.group import TensorParallelGroup
from engine.errors import ConfigError
from engine.host_inputs import (
    HostBatch,
    HostInputs,
    StepMessage,
    packed_int32,
    padded_tables,
    slots_of,
)
from engine.kv_cache import KVCache
from engine.kv_offload import PageMove
from engine.models.llama import LlamaForCausalLM
from engine.piecewise_graphs import PiecewiseGraphs
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import Sequence
from engine.spec_decode.verify import DraftVerifier
from engine.step_types import LaunchedStep, ModelInputs, SampledToken
from engine.structured.masks import GrammarMasks, has_grammar


class ModelRunner:
    """The only place that builds device tensors from sequences.

    Under tensor parallelism rank 0's runner sends each step to the other ranks' runners
    (``run_peer_step``) before it runs its own share of the forward.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        sampler: Sampler,
        device: torch.device,
        group: TensorParallelGroup | None = None,
        cascade: bool = False,
    ) -> None:
        """``cascade``: find each step's shared prefix (``AttentionMetadata.shared_prefix``) for
        a backend that attends it as a cascade; decode graphs are captured with it too."""
        self.model = model
        self.cascade = cascade
        self.group = group or TensorParallelGroup()
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.verifier = DraftVerifier(sampler)
        self.grammar_masks = GrammarMasks(sampler.vocab_size, device)
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs and their memory pool. Before a tensor-parallel rank leaves
        its group: a live graph that holds an NCCL all-reduce keeps its communicator, and
        tearing that communicator down then waits."""
        self.graphs = None
        self.piecewise = None

    def capture_cuda_graphs(self, max_rows: int, max_seq_len: int, max_graph_tokens: int) -> float:
        """Capture decode graphs for every batch-size bucket up to ``max_rows`` one-token rows
        (sequences, or draft positions being verified), and piecewise graphs for steps of up to
        ``max_graph_tokens`` tokens (0: none); returns the seconds it took."""
        if max_graph_tokens > 0:
            piecewise = PiecewiseGraphs(
                self.model, self.kv_cache.layers, max_graph_tokens, self.device
            )
            piecewise.capture()
            self.piecewise = piecewise
        max_blocks = -(-max_seq_len // self.block_size)
        graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, max_rows, max_blocks, max_seq_len, self.device,
            cascade=self.cascade,
        )  # fmt: skip
        graphs.capture()
        self.graphs = graphs
        return graphs.capture_s + (self.piecewise.capture_s if self.piecewise else 0.0)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, while_gpu_busy: Callable[[], None] | None = None
    ) -> list[SampledToken]:
        """Run the batch's forward and sample; ``while_gpu_busy`` is called once the forward is
        launched, before the host waits for its result (not called when nothing runs)."""
        launched = self.launch(batch)
        if launched is None:
            return []
        if while_gpu_busy is not None:
            while_gpu_busy()
        self.sample_constrained(launched)  # every grammar has its tokens already
        return launched.resolve()

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, previous: LaunchedStep | None = None
    ) -> LaunchedStep | None:
        """Queue the batch's forward and sampling on the device without waiting for them.

        ``previous``: the step before, if its picks are not resolved yet; rows whose input is
        one of them (``PENDING_TOKEN`` on the host) read it from its device tensor.
        """
        inputs = None if batch.is_empty else self.prepare_inputs(batch, previous)
        pages_move = batch.swap_out or batch.page_transfers or batch.swap_in
        if self.group.size > 1 and (inputs is not None or pages_move):
            self._send_step(batch, inputs)
        self._move_pages(batch.swap_out, batch.page_transfers, batch.swap_in)
        if inputs is None:
            return None
        logits = self._logits(inputs)
        entries = inputs.sampling_entries
        if (
            logits is not None and batch.forks
        ):  # new samples: their first token from the parent's row
            logits, entries = _with_fork_rows(logits, entries, batch.forks)
        launched = LaunchedStep(batch.scheduled, entries, None, draft_entries=inputs.draft_entries)
        if logits is None:
            return launched  # only partial prefill chunks
        launched.unsampled_logits = logits
        if has_grammar(entries) or has_grammar(inputs.draft_entries):
            return launched  # sampled once its masks are filled (sample_constrained)
        self._sample(launched)
        return launched

    def start_mask_fill(self, launched: LaunchedStep) -> None:
        """Begin filling the bitmasks of a launched step with grammars on another thread, once
        each grammar has taken every token before this step; ``sample_constrained`` waits
        (called by the next ``launch`` with this step as ``previous``, or before its picks are
        resolved)."""
        self.grammar_masks.start(launched.sampling_entries, launched.draft_entries)

    @torch.inference_mode()
    def sample_constrained(self, launched: LaunchedStep | None) -> None:
        """Sample a launched step whose rows have grammars, once each grammar has taken every
        token before this step: the bitmasks are filled on the host (while the forward may
        still run) and applied to the logits on the device, outside any CUDA graph. Nothing
        for a step already sampled (or none): whoever needs its picks first samples it."""
        if launched is None or launched.unsampled_logits is None:
            return
        self.grammar_masks.apply(
            launched.unsampled_logits, launched.sampling_entries, launched.draft_entries
        )
        self._sample(launched, after_advance=True)

    def _sample(self, launched: LaunchedStep, after_advance: bool = False) -> None:
        """Queue the sampling (and draft verification) of ``launched``'s logits.
        ``after_advance``: sampled late (a step with grammars), when each row's output
        already ends with this step's placeholder for its pick; the penalties and
        ``min_tokens`` count only the tokens before it."""
        logits, launched.unsampled_logits = launched.unsampled_logits, None
        assert logits is not None
        entries = launched.sampling_entries
        if launched.draft_entries:
            launched.verified = self.verifier.verify(logits[len(entries) :], launched.draft_entries)
            logits = logits[: len(entries)]
        if not entries:
            return
        rows = None
        if after_advance:  # grammar steps only: the rows are needed to know
            rows = [e.seq.known_sampling_row() for e in entries]
            argmax = all(r.params.is_plain_greedy and not r.suppressed_token_ids for r in rows)
        else:
            argmax = all([entry.seq.picks_argmax for entry in entries])  # a list: cheaper
        if argmax:
            sample = self.sampler.greedy_on_device(logits)  # the rows would only say "argmax"
        else:
            rows = rows or [e.seq.sampling_row() for e in entries]
            sample = self.sampler.sample_on_device(logits, rows)
        sample.start_copy()
        launched.sample = sample

    @torch.inference_mode()
    def sampling_logits(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor | None, list[ScheduledSeq]]:
        """[S, V] logits of the batch's rows that reach their last token, and those rows
        (no sampling: a draft model samples from them itself)."""
        inputs = self.prepare_inputs(batch)
        return self._logits(inputs), inputs.sampling_entries

    def _send_step(self, batch: ScheduledBatch, inputs: ModelInputs | None) -> None:
        """Rank 0: tell the other ranks what this step runs (they wait in ``run_peer_step``)."""
        host = None if inputs is None else inputs.host
        message = StepMessage(batch.swap_out, batch.page_transfers, batch.swap_in, host)
        self.group.send_step(message)
        if inputs is not None and inputs.host.has_pending:
            self.group.broadcast_tensor(inputs.input_ids)  # the picks exist on this rank only

    @torch.inference_mode()
    def run_peer_step(self, message: StepMessage) -> None:
        """On a rank other than 0: this rank's share of the step rank 0 sent (its logits are
        gathered here too, and dropped: rank 0 samples)."""
        self._move_pages(message.swap_out, message.page_transfers, message.swap_in)
        host = message.inputs
        if host is None:
            return
        inputs = self._device_inputs(host, [], [])
        if host.has_pending:
            self.group.broadcast_tensor(inputs.input_ids)
        self._logits(inputs)

    def _move_pages(
        self,
        swap_out: list[tuple[int, int]],
        transfers: list[PageMove],
        swap_in: list[tuple[int, int]],
    ) -> None:
        # Swap-outs first: their pages may be handed to other sequences in this very step.
        if swap_out:
            self.kv_cache.swap_out(*map(list, zip(*swap_out, strict=True)))
        # Then evicted prefix pages to the host tier and host hits back, before any write.
        if transfers:
            self.kv_cache.transfer(transfers)
        if swap_in:
            self.kv_cache.swap_in(*map(list, zip(*swap_in, strict=True)))

    def _logits(self, inputs: ModelInputs) -> torch.Tensor | None:
        """[S, V] logits of the sampling rows: a graph replay for decode-only steps, piecewise
        graphs around eager attention for the others (when captured)."""
        meta = inputs.meta
        decode_only = meta.max_query_len == 1
        if decode_only and self.graphs is not None and self.graphs.bucket_for(meta.num_seqs):
            logits = self.graphs.replay(inputs.input_ids, inputs.positions, meta)  # [B, V]
            if inputs.logits_indices is None:
                return logits  # the graph's buffer: sampled before the next replay writes it
            # one token per row, so a row's token index is its row (a 1-token chunk of a
            # longer prompt does not sample)
            return logits[inputs.logits_indices] if inputs.host.num_samples else None
        piecewise = self.piecewise
        if piecewise is not None and piecewise.bucket_for(inputs.input_ids.shape[0]):
            hidden = piecewise.forward(inputs.input_ids, inputs.positions, meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, meta)
        if not inputs.host.num_samples:
            return None
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

    def prepare_inputs(
        self, batch: ScheduledBatch, previous: LaunchedStep | None = None
    ) -> ModelInputs:
        host = HostBatch.of(batch, self.block_size)
        inputs = self._device_inputs(host.inputs, host.sampling_entries, host.draft_entries)
        # a constrained step's sampling, deferred to here: its masks filled beside this
        # step's scheduling and inputs, and it is queued before this step's forward
        self.sample_constrained(previous)
        if host.pending:
            self._fill_pending(inputs.input_ids, host.pending, previous)
        return inputs

    def _device_inputs(
        self,
        host: HostInputs,
        sampling_entries: list[ScheduledSeq],
        draft_entries: list[ScheduledSeq],
    ) -> ModelInputs:
        meta = self._metadata(host.tables, host.slots, host.seq_lens, host.query_start_loc)
        return ModelInputs(
            input_ids=self._tensor(host.token_ids, torch.int64),
            positions=self._tensor(host.positions, torch.int64),
            meta=meta,
            logits_indices=(
                None
                if host.logits_indices is None
                else self._tensor(host.logits_indices, torch.int64)
            ),
            sampling_entries=sampling_entries,
            draft_entries=draft_entries,
            host=host,
        )

    def _fill_pending(
        self,
        input_ids: torch.Tensor,
        pending: list[tuple[int, Sequence]],
        previous: LaunchedStep | None,
    ) -> None:
        """Copy the previous step's picks into the rows that take them as input, on device."""
        assert previous is not None and previous.sample is not None, "a pending token is lost"
        row_of = previous.row_of()
        rows = [row for row, _ in pending] + [row_of[id(seq)] for _, seq in pending]
        index = self._tensor(rows, torch.int64)  # [destinations..., sources...]: one copy
        num = len(pending)
        input_ids[index[:num]] = previous.sample.token_ids[index[num:]]

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, seq_len: int, num_sampled: int) -> None:
        """The largest step the scheduler can make, on dummy data: fresh prompts of
        ``seq_len`` tokens filling ``num_tokens``, then ``num_sampled`` rows sampled with
        top-k/top-p and penalties (the sampler's largest temporaries). Pages are taken in
        order from this runner's cache, which must hold ``num_tokens`` tokens."""
        lens = [min(seq_len, num_tokens - start) for start in range(0, num_tokens, seq_len)]
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self._forward_fresh(input_ids, lens)
        rows_index = torch.arange(num_sampled, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden[rows_index])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1)
        row = SamplingRow(params=params, prompt_token_ids=[0], output_token_ids=[], generator=None)
        self.sampler.sample(logits, [row] * num_sampled)

    @torch.inference_mode()
    def profile_decode(self, num_seqs: int) -> None:
        """A decode step of ``num_seqs`` one-token sequences (what a captured graph holds)."""
        input_ids = torch.zeros(num_seqs, dtype=torch.int64, device=self.device)
        self.model.compute_logits(self._forward_fresh(input_ids, [1] * num_seqs))

    @torch.inference_mode()
    def teacher_forced_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[L, V] float32 logits after every prefix of ``token_ids``, from one prefill that
        writes (and, with fp8 pages, quantizes) its K/V into pages 0.. of the pool first.
        For measuring a cache format's effect on an idle engine that is then thrown away:
        the block manager is not told, so its prefix cache may still name those pages."""
        if self.group.size > 1:  # the other ranks wait for steps, not for this
            raise ConfigError("teacher-forced logits need tensor_parallel_size 1")
        input_ids = self._tensor(token_ids, torch.int64)
        hidden = self._forward_fresh(input_ids, [len(token_ids)])
        return self.model.compute_logits(hidden).float()

    def _forward_fresh(self, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """The model over fresh prompts of ``lens`` tokens, placed in pages 0, 1, ..."""
        tables: list[list[int]] = []
        slots: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        for length in lens:
            first = sum(len(table) for table in tables)
            table = list(range(first, first + -(-length // self.block_size)))
            tables.append(table)
            slots += slots_of(table, 0, length, self.block_size)
            positions += range(length)
            query_start_loc.append(query_start_loc[-1] + length)
        meta = self._metadata(tables, slots, lens, query_start_loc)
        positions_t = self._tensor(positions, torch.int64)
        return self.model(input_ids, positions_t, self.kv_cache.layers, meta)

    def _metadata(
        self,
        tables: list[list[int]],
        slots: list[int],
        seq_lens: list[int],
        query_start_loc: list[int],
    ) -> AttentionMetadata:
        num_decodes = 0  # the leading sequences with one new token each
        while num_decodes < len(seq_lens) and query_start_loc[num_decodes + 1] == num_decodes + 1:
            num_decodes += 1
        if num_decodes == len(seq_lens):
            max_query_len = 1
        else:
            max_query_len = max(b - a for a, b in itertools.pairwise(query_start_loc))
        table_lens = [len(table) for table in tables]
        padded = padded_tables(tables, table_lens)
        block_tables = self._to_device(padded)
        shared_prefix = None
        if self.cascade:
            found = find_shared_prefixes(padded, table_lens, seq_lens, num_decodes, self.block_size)
            shared_prefix = None if found is None else self._shared_prefix(padded, *found)
        return AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=block_tables,
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            max_query_len=max_query_len,
            shared_prefix=shared_prefix,
        )

    def _shared_prefix(
        self, tables: np.ndarray, shares: list[int], groups: list[PrefixGroup]
    ) -> SharedPrefix:
        """``find_shared_prefixes``' cascade on the device (one copy), its decodes in the row
        tiles of the prefix kernel."""
        from kernels.attention.cascade_triton import prefix_tiles

        rows, tile_groups = prefix_tiles(
            [group.decodes for group in groups], self.model.arch.num_q_per_kv
        )
        pages = tables[[group.row for group in groups]]  # [G, W]
        parts = [np.asarray(values, dtype=np.int32) for values in (shares, rows, tile_groups)]
        packed, slices = packed_int32([*parts, pages])
        on_device = self._to_device(packed)
        lens, rows_t, groups_t, pages_t = (on_device[where] for where in slices)
        return SharedPrefix(lens, pages_t.view(pages.shape), rows_t, groups_t)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)


def _with_fork_rows(
    logits: torch.Tensor, entries: list[ScheduledSeq], forks: list[tuple[Sequence, Sequence]]
) -> tuple[torch.Tensor, list[ScheduledSeq]]:
    """Logits and entries with one more sampling row per new sample, a copy of its parent's
    row (the prompt's last position, computed once for all of them): [S + F + N, V], the
    rows with drafts (N) still last."""
    row_of = {id(entry.seq): row for row, entry in enumerate(entries)}
    rows = [row_of[id(parent)] for parent, _ in forks]
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    num_sampling = len(entries)
    fork_rows = logits[index]  # [F, V]
    logits = torch.cat([logits[:num_sampling], fork_rows, logits[num_sampling:]])
    return logits, entries + [ScheduledSeq(child, 0) for _, child in forks]
