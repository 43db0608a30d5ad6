"""Turns a scheduled batch into device tensors, runs the model and samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.models.llama import LlamaForCausalLM
from engine.piecewise_graphs import PiecewiseGraphs
from engine.sampler import DeviceSample, Sampler, SamplingRow, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import PENDING_TOKEN, Sequence
from engine.spec_decode.verify import DraftVerifier, VerifiedDrafts


@dataclass(frozen=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None
    # Draft tokens verified before ``token_id``, in order: they come first, KV already cached
    accepted_draft_ids: tuple[int, ...] = ()
    draft_logprobs: tuple[TokenLogprobs | None, ...] = ()  # theirs, when asked for


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``resolve`` waits for the
    picks alone. Until then the picks feed the next step straight from device memory."""

    scheduled: list[ScheduledSeq]
    sampling_entries: list[ScheduledSeq]  # rows without drafts that sample
    sample: DeviceSample | None  # None when no such row ran
    verified: VerifiedDrafts | None = None  # rows that ran with draft tokens

    def row_of(self) -> dict[int, int]:
        """``id(seq)`` -> its row in ``sample.token_ids``."""
        return {id(entry.seq): row for row, entry in enumerate(self.sampling_entries)}

    def resolve(self) -> list[SampledToken]:
        tokens = []
        if self.sample is not None:
            out = self.sample.resolve()
            tokens = [
                SampledToken(entry.seq, token_id, logprobs)
                for entry, token_id, logprobs in zip(
                    self.sampling_entries, out.token_ids, out.logprobs, strict=True
                )
            ]
        if self.verified is not None:
            for entry, (ids, logprobs) in zip(
                self.verified.entries, self.verified.resolve(), strict=True
            ):
                token = SampledToken(
                    entry.seq, ids[-1], logprobs[-1], tuple(ids[:-1]), tuple(logprobs[:-1])
                )
                tokens.append(token)
        return tokens


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [S + N]: last token of each sequence that samples, then every position of the rows
    # with drafts; None when every token samples in that order (decode)
    logits_indices: torch.Tensor | None
    sampling_entries: list[ScheduledSeq]
    draft_entries: list[ScheduledSeq]  # rows with draft tokens: N = their tokens


class ModelRunner:
    """The only place that builds device tensors from sequences."""

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.verifier = DraftVerifier(sampler)
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    def capture_cuda_graphs(self, max_seqs: int, max_seq_len: int, max_graph_tokens: int) -> float:
        """Capture decode graphs for every batch-size bucket, and piecewise graphs for steps of
        up to ``max_graph_tokens`` tokens (0: none); returns the seconds it took."""
        if max_graph_tokens > 0:
            piecewise = PiecewiseGraphs(
                self.model, self.kv_cache.layers, max_graph_tokens, self.device
            )
            piecewise.capture()
            self.piecewise = piecewise
        max_blocks = -(-max_seq_len // self.block_size)
        graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, max_seqs, max_blocks, max_seq_len, self.device
        )
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
        return launched.resolve()

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, previous: LaunchedStep | None = None
    ) -> LaunchedStep | None:
        """Queue the batch's forward and sampling on the device without waiting for them.

        ``previous``: the step before, if its picks are not resolved yet; rows whose input is
        one of them (``PENDING_TOKEN`` on the host) read it from its device tensor.
        """
        # Swap-outs first: their pages may be handed to other sequences in this very step.
        if batch.swap_out:
            self.kv_cache.swap_out(*map(list, zip(*batch.swap_out, strict=True)))
        # Then evicted prefix pages to the host tier and host hits back, before any write.
        if batch.page_transfers:
            self.kv_cache.transfer(batch.page_transfers)
        if batch.swap_in:
            self.kv_cache.swap_in(*map(list, zip(*batch.swap_in, strict=True)))
        if batch.is_empty:
            return None
        inputs = self.prepare_inputs(batch, previous)
        logits = self._logits(inputs)
        entries = inputs.sampling_entries
        if logits is None:
            return LaunchedStep(batch.scheduled, entries, None)  # only partial prefill chunks
        verified = None
        if inputs.draft_entries:
            verified = self.verifier.verify(logits[len(entries) :], inputs.draft_entries)
            logits = logits[: len(entries)]
        if not entries:
            return LaunchedStep(batch.scheduled, entries, None, verified)
        if all([_plain_greedy(entry.seq) for entry in entries]):  # a list: cheaper than a genexpr
            sample = self.sampler.greedy_on_device(logits)  # the rows would only say "argmax"
        else:
            rows = [self._sampling_row(e.seq) for e in entries]
            sample = self.sampler.sample_on_device(logits, rows)
        sample.start_copy()
        return LaunchedStep(batch.scheduled, entries, sample, verified)

    @torch.inference_mode()
    def sampling_logits(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor | None, list[ScheduledSeq]]:
        """[S, V] logits of the batch's rows that reach their last token, and those rows
        (no sampling: a draft model samples from them itself)."""
        inputs = self.prepare_inputs(batch)
        return self._logits(inputs), inputs.sampling_entries

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
            return logits[inputs.logits_indices] if inputs.sampling_entries else None
        num_sampling = len(inputs.sampling_entries) + len(inputs.draft_entries)
        piecewise = self.piecewise
        if piecewise is not None and piecewise.bucket_for(inputs.input_ids.shape[0]):
            hidden = piecewise.forward(inputs.input_ids, inputs.positions, meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, meta)
        if not num_sampling:
            return None
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

    def prepare_inputs(
        self, batch: ScheduledBatch, previous: LaunchedStep | None = None
    ) -> ModelInputs:
        token_ids: list[int] = []
        pending: list[tuple[int, Sequence]] = []  # rows whose input token is still on the device
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_entries: list[ScheduledSeq] = []
        draft_indices: list[int] = []
        draft_entries: list[ScheduledSeq] = []
        bs = self.block_size
        for entry in batch.scheduled:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            if entry.draft_token_ids:  # its last token, then drafts: logits at every position
                token_ids += [seq.token_id(start), *entry.draft_token_ids]
                positions += range(start, end)
                slots += self._slots(seq.block_table, start, end)
                draft_indices += range(len(token_ids) - entry.num_new_tokens, len(token_ids))
                draft_entries.append(entry)
            elif end - start == 1:  # a decode step (most rows): no lists to build
                token_id = seq.token_id(start)
                if token_id == PENDING_TOKEN:
                    pending.append((len(token_ids), seq))
                token_ids.append(token_id)
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                token_ids += seq.token_ids(start, end)
                positions += range(start, end)
                slots += self._slots(seq.block_table, start, end)
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            if entry.samples and not entry.draft_token_ids:
                logits_indices.append(len(token_ids) - 1)
                sampling_entries.append(entry)
        logits_indices += draft_indices
        tables = [entry.seq.block_table for entry in batch.scheduled]
        meta = self._metadata(tables, slots, seq_lens, query_start_loc)
        input_ids = self._tensor(token_ids, torch.int64)
        if pending:
            self._fill_pending(input_ids, pending, previous)
        return ModelInputs(
            input_ids=input_ids,
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logits_indices=(
                None
                if _is_identity(logits_indices, len(token_ids), bool(draft_entries))
                else self._tensor(logits_indices, torch.int64)
            ),
            sampling_entries=sampling_entries,
            draft_entries=draft_entries,
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
            slots += self._slots(table, 0, length)
            positions += range(length)
            query_start_loc.append(query_start_loc[-1] + length)
        meta = self._metadata(tables, slots, lens, query_start_loc)
        positions_t = self._tensor(positions, torch.int64)
        return self.model(input_ids, positions_t, self.kv_cache.layers, meta)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[pos // bs] * bs + pos % bs for pos in range(start, end)]

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
        return AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._block_tables(tables),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            max_query_len=max_query_len,
        )

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.sampling
        suppressed: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            suppressed = (*seq.eos_token_ids, *params.stop_token_ids)
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            suppressed_token_ids=suppressed,
        )

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """[B, max_blocks] int32, rows padded with page 0 (never read past a row's length)."""
        # Row copies into numpy: a quarter of the time of padding 256 Python lists.
        padded = np.zeros((len(tables), max(len(table) for table in tables)), dtype=np.int32)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        host = torch.from_numpy(padded)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)


def _plain_greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is the argmax of its logits (see ``_sampling_row``)."""
    params = seq.sampling
    return params.is_plain_greedy and len(seq.output_token_ids) >= params.min_tokens


def _is_identity(logits_indices: list[int], num_tokens: int, has_drafts: bool) -> bool:
    """Whether the logits rows are every token in order (then no gather is needed)."""
    if len(logits_indices) != num_tokens:
        return False
    # without drafts the rows are in batch order; draft rows come after the others
    return not has_drafts or logits_indices == list(range(num_tokens))
