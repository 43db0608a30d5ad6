"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step launches a few hundred small kernels whose launch cost, at small batch,
exceeds their run time. Capturing the whole forward (embedding to logits) once per bucket and
replaying it costs one launch. A step of ``n`` sequences replays the smallest bucket >= n; the
padding rows write nothing (slot -1) and read one token of page 0, and their logits are
dropped. Graphs read their inputs from static buffers that each replay refills.

With cascade decode on (``--cascade-attention``), buckets of at least CASCADE_MIN_DECODES rows
get a second graph that attends a shared prefix together, its pages and each row's share read
from static buffers; a step with a shared prefix replays it (padding rows share none). A step
without one replays the plain graph, and so may a step with one: the plain attention over
every key gives the same result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, LayerCache
from engine.attention.backend import CASCADE_MIN_DECODES
from engine.host_inputs import TABLE_WIDTH_MULTIPLE
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # above the small buckets, every multiple of this up to max_rows


def capture_mode(model: LlamaForCausalLM) -> str:
    """``thread_local`` under tensor parallelism: NCCL's watchdog thread may query events of
    collectives enqueued before the capture, which ``global`` mode would count against it."""
    return "thread_local" if model.group.size > 1 else "global"


def batch_size_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to and including ``max_rows``."""
    buckets = [size for size in SMALL_BUCKETS if size < max_rows]
    buckets += range(BUCKET_STEP, max_rows, BUCKET_STEP)
    return sorted({*buckets, max_rows})


@dataclass
class _StaticInputs:
    """The buffers every captured graph reads; sized for the largest bucket."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N + 1] int32: 0, 1, ..., N (one token per sequence)
    prefix_pages: torch.Tensor  # [max_blocks] int32: a cascade graph's shared pages
    prefix_lens: torch.Tensor  # [N] int32: each row's share of them, in tokens

    @classmethod
    def allocate(cls, size: int, max_blocks: int, device: torch.device) -> _StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(size, dtype=torch.int64),
            positions=zeros(size, dtype=torch.int64),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(size, max_blocks, dtype=torch.int32),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            prefix_pages=zeros(max_blocks, dtype=torch.int32),
            prefix_lens=zeros(size, dtype=torch.int32),
        )

    def metadata(self, batch: int, max_seq_len: int, cascade: bool = False) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens_cpu=[1] * batch,  # not read by graph-safe backends
            query_start_loc_cpu=list(range(batch + 1)),
            num_decodes=batch,
            max_seq_len=max_seq_len,
            max_query_len=1,
            shared_prefix=(self.prefix_lens[:batch], self.prefix_pages) if cascade else None,
        )


class DecodeGraphs:
    """Captures and replays the decode forward of ``model`` for each batch-size bucket."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[LayerCache],
        max_rows: int,  # one token each: sequences, or positions of drafts being verified
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        cascade: bool = False,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.buckets = batch_size_buckets(max_rows)
        self.max_seq_len = max_seq_len
        # as wide as any step's padded tables (``host_inputs.padded_tables``)
        width = -(-max_blocks_per_seq // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        self.static = _StaticInputs.allocate(self.buckets[-1], width, device)
        # per bucket, (context bound, graph) ascending: kernels may launch differently for
        # short contexts (an unsplit decode attention), which a graph then has to hold
        self.graphs: dict[int, list[tuple[int, torch.cuda.CUDAGraph]]] = {}
        # the same for cascade decode, from CASCADE_MIN_DECODES rows (``cascade``)
        self.cascade_graphs: dict[int, list[tuple[int, torch.cuda.CUDAGraph]]] = {}
        self.cascade = cascade
        self.device = device
        # One logits buffer for every graph (each writes its leading rows), so that the graphs
        # share one pool of intermediates and keep no per-bucket outputs alive.
        # (the whole vocabulary: under tensor parallelism the graph gathers every rank's part;
        # the LM head may be quantized: the logits take the activations' dtype)
        dtype = model.embed_tokens.weight.dtype
        self.logits = torch.empty(
            self.buckets[-1], model.arch.vocab_size, dtype=dtype, device=device
        )
        self.capture_s = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so that smaller ones reuse its memory pool."""
        start_s = time.perf_counter()
        pool = None
        backend = self.model.attention_backend
        num_kv_heads = self.model.arch.num_kv_heads
        for bucket in reversed(self.buckets):
            bounds = backend.decode_graph_contexts(
                bucket, num_kv_heads, self.device, self.max_seq_len
            )
            variants = [(False, self.graphs)]
            if self.cascade and bucket >= CASCADE_MIN_DECODES:
                variants.append((True, self.cascade_graphs))
            for cascade, graphs in variants:
                graphs[bucket] = []
                for bound in bounds:
                    # compiles kernels, settles autotuning first
                    self._forward(bucket, bound, cascade=cascade)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    mode = capture_mode(self.model)
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                        self._forward(bucket, bound, self.logits[:bucket], cascade)
                    pool = graph.pool()
                    graphs[bucket].append((bound, graph))
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start_s
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d; %d of them cascade) in %.1fs",
            sum(map(len, [*self.graphs.values(), *self.cascade_graphs.values()])),
            self.buckets[0], self.buckets[-1], sum(map(len, self.cascade_graphs.values())),
            self.capture_s,
        )  # fmt: skip

    def _forward(
        self, bucket: int, max_seq_len: int, out: torch.Tensor | None = None,
        cascade: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        static = self.static
        meta = static.metadata(bucket, max_seq_len, cascade)
        hidden = self.model(
            static.input_ids[:bucket], static.positions[:bucket], self.kv_layers, meta
        )
        return self.model.compute_logits(hidden, out=out)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs`` rows, if any."""
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def replay(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        meta: AttentionMetadata,  # of the n decode rows
    ) -> torch.Tensor:  # [n, V] logits
        num_seqs = input_ids.shape[0]
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None, f"no graph holds {num_seqs} sequences"
        static = self.static
        static.input_ids[:num_seqs].copy_(input_ids)
        static.positions[:num_seqs].copy_(positions)
        static.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        static.seq_lens[:num_seqs].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        static.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        # padding rows: store nothing, attend over one token of whatever page they name
        static.slot_mapping[num_seqs:bucket].fill_(-1)
        static.seq_lens[num_seqs:bucket].fill_(1)
        graphs = self.graphs[bucket]
        if meta.shared_prefix is not None and bucket in self.cascade_graphs:
            prefix_lens, prefix_pages = meta.shared_prefix
            static.prefix_lens[:num_seqs].copy_(prefix_lens)
            static.prefix_lens[num_seqs:bucket].fill_(0)
            static.prefix_pages[: prefix_pages.shape[0]].copy_(prefix_pages)
            graphs = self.cascade_graphs[bucket]
        graph = next(graph for bound, graph in graphs if bound >= meta.max_seq_len)
        graph.replay()
        return self.logits[:num_seqs]
