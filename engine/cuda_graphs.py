"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step launches a few hundred small kernels whose launch cost, at small batch,
exceeds their run time. Capturing the whole forward (embedding to logits) once per bucket and
replaying it costs one launch. A step of ``n`` sequences replays the smallest bucket >= n; the
padding rows write nothing (slot -1) and read one token of page 0, and their logits are
dropped. Graphs read their inputs from static buffers that each replay refills.

With cascade decode on (``--cascade-attention``), buckets of at least CASCADE_MIN_DECODES rows
get a second graph that attends shared prefixes together (up to CASCADE_MAX_GROUPS of them),
their pages, each row's share and the prefix kernel's row tiles read from static buffers; a
step with a shared prefix replays it (padding rows share none, spare tiles hold no rows). A step
without one replays the plain graph, and so may a step with one: the plain attention over
every key gives the same result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, LayerCache
from engine.attention.backend import CASCADE_MAX_GROUPS, CASCADE_MIN_DECODES, SharedPrefix
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


def cascade_buckets(buckets: list[int], cascade: bool) -> list[int]:
    """The buckets captured a second time with cascade decode (none with it off)."""
    return [bucket for bucket in buckets if cascade and bucket >= CASCADE_MIN_DECODES]


def graph_shapes(
    model: LlamaForCausalLM, buckets: list[int], cascaded: list[int], max_seq_len: int,
    device: torch.device,
) -> Iterator[tuple[int, bool, int]]:  # fmt: skip
    """(bucket, cascade, context bound) of every decode graph ``DecodeGraphs`` captures,
    largest bucket first (smaller ones reuse its memory pool)."""
    num_kv_heads = model.arch.num_kv_heads
    for bucket in reversed(buckets):
        bounds = model.attention_backend.decode_graph_contexts(
            bucket, num_kv_heads, device, max_seq_len
        )
        for cascade in (False, True) if bucket in cascaded else (False,):
            for bound in bounds:
                yield bucket, cascade, bound


def decode_graph_scratch_bytes(
    model: LlamaForCausalLM, max_rows: int, max_seq_len: int, device: torch.device, cascade: bool
) -> int:
    """The most split-KV partials one layer's attention holds in any graph that
    ``DecodeGraphs`` captures for these settings. The graphs share one pool, and the memory
    profile's decode (one-token contexts) never splits, so the plan adds this to its reserve:
    some 13 MB for llama3-8b's cascade at 256 rows."""
    backend, arch = model.attention_backend, model.arch
    buckets = batch_size_buckets(max_rows)
    shapes = graph_shapes(model, buckets, cascade_buckets(buckets, cascade), max_seq_len, device)
    return max(
        backend.decode_scratch_bytes(
            bucket, arch.num_heads, arch.num_kv_heads, arch.head_dim, device, bound, with_prefix
        )
        for bucket, with_prefix, bound in shapes
    )


@dataclass
class _StaticInputs:
    """The buffers every captured graph reads; sized for the largest bucket."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N + 1] int32: 0, 1, ..., N (one token per sequence)
    # a cascade graph's (``SharedPrefix``): each row's share of its group's prefix in tokens,
    # the groups' pages, and the prefix kernel's row tiles (their slots' rows, their groups;
    # -1: none), as many tiles as the largest bucket may need
    prefix_lens: torch.Tensor  # [N] int32
    prefix_pages: torch.Tensor  # [CASCADE_MAX_GROUPS, max_blocks] int32
    prefix_rows: torch.Tensor  # [tiles * rows a tile] int32
    prefix_tile_groups: torch.Tensor  # [tiles] int32

    @classmethod
    def allocate(
        cls, size: int, max_blocks: int, device: torch.device, prefix_tiles: tuple[int, int]
    ) -> _StaticInputs:
        """``prefix_tiles``: (tiles, rows a tile) of the largest cascade, (0, 0) if none."""

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        num_tiles, per_tile = prefix_tiles

        return cls(
            input_ids=zeros(size, dtype=torch.int64),
            positions=zeros(size, dtype=torch.int64),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(size, max_blocks, dtype=torch.int32),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            prefix_lens=zeros(size, dtype=torch.int32),
            prefix_pages=zeros(CASCADE_MAX_GROUPS, max_blocks, dtype=torch.int32),
            prefix_rows=torch.full((num_tiles * per_tile,), -1, dtype=torch.int32, device=device),
            prefix_tile_groups=torch.full((num_tiles,), -1, dtype=torch.int32, device=device),
        )

    @property
    def prefix_rows_per_tile(self) -> int:
        return self.prefix_rows.shape[0] // max(self.prefix_tile_groups.shape[0], 1)

    def metadata(self, batch: int, max_seq_len: int, prefix_tiles: int = 0) -> AttentionMetadata:
        """Of the first ``batch`` rows; a cascade's over ``prefix_tiles`` row tiles, if any."""
        shared_prefix = None
        if prefix_tiles:
            shared_prefix = SharedPrefix(
                lens=self.prefix_lens[:batch],
                pages=self.prefix_pages,
                rows=self.prefix_rows[: prefix_tiles * self.prefix_rows_per_tile],
                tile_groups=self.prefix_tile_groups[:prefix_tiles],
            )
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
            shared_prefix=shared_prefix,
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
        # the prefix kernel's row tiles each cascade bucket's graph holds, up to
        # CASCADE_MAX_GROUPS groups of its rows
        self.cascade_tiles: dict[int, int] = {}
        per_tile = 0
        if cascade:
            from kernels.attention.cascade_triton import (
                max_prefix_tiles,
                prefix_seqs_per_tile,
            )

            group = model.arch.num_q_per_kv
            per_tile = prefix_seqs_per_tile(group)
            self.cascade_tiles = {
                bucket: max_prefix_tiles(bucket, CASCADE_MAX_GROUPS, group)
                for bucket in cascade_buckets(self.buckets, cascade)
            }
        prefix_tiles = (max(self.cascade_tiles.values(), default=0), per_tile)
        self.static = _StaticInputs.allocate(self.buckets[-1], width, device, prefix_tiles)
        # per bucket, (context bound, graph) ascending: kernels may launch differently for
        # short contexts (an unsplit decode attention), which a graph then has to hold
        self.graphs: dict[int, list[tuple[int, torch.cuda.CUDAGraph]]] = {}
        # the same for cascade decode, for the buckets of ``cascade_tiles``
        self.cascade_graphs: dict[int, list[tuple[int, torch.cuda.CUDAGraph]]] = {}
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
        shapes = graph_shapes(
            self.model, self.buckets, list(self.cascade_tiles), self.max_seq_len, self.device
        )
        for bucket, cascade, bound in shapes:
            self._forward(bucket, bound, cascade=cascade)  # compiles kernels, settles autotuning
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            mode = capture_mode(self.model)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                self._forward(bucket, bound, self.logits[:bucket], cascade)
            pool = graph.pool()
            graphs = self.cascade_graphs if cascade else self.graphs
            graphs.setdefault(bucket, []).append((bound, graph))
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
        meta = static.metadata(bucket, max_seq_len, self.cascade_tiles[bucket] if cascade else 0)
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
            self._load_prefix(meta.shared_prefix, num_seqs, bucket)
            graphs = self.cascade_graphs[bucket]
        graph = next(graph for bound, graph in graphs if bound >= meta.max_seq_len)
        graph.replay()
        return self.logits[:num_seqs]

    def _load_prefix(self, prefix: SharedPrefix, num_seqs: int, bucket: int) -> None:
        """``prefix`` into the static buffers of ``bucket``'s cascade graph: padding rows
        share nothing, tiles past the step's hold no rows."""
        static = self.static
        static.prefix_lens[:num_seqs].copy_(prefix.lens)
        static.prefix_lens[num_seqs:bucket].fill_(0)
        num_groups, width = prefix.pages.shape
        static.prefix_pages[:num_groups, :width].copy_(prefix.pages)
        num_tiles, num_rows = prefix.tile_groups.shape[0], prefix.rows.shape[0]
        tiles = self.cascade_tiles[bucket]
        static.prefix_tile_groups[:num_tiles].copy_(prefix.tile_groups)
        static.prefix_tile_groups[num_tiles:tiles].fill_(-1)
        static.prefix_rows[:num_rows].copy_(prefix.rows)
        static.prefix_rows[num_rows : tiles * static.prefix_rows_per_tile].fill_(-1)
