"""Kernel backends: paged attention and the per-token ops of a decoder layer.

Two families with one interface: ``torch`` (the plain-torch references in ``kernels/``: the
CPU path, and the ground truth) and ``triton`` (the Triton kernels beside them: the default on
CUDA). ``PAGESTREAM_ATTN_BACKEND=torch`` picks the references on a GPU too, for comparison.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypedDict

import numpy as np
import torch

from engine.errors import ConfigError
from kernels.attention.paged_attention import paged_attention_ref
from kernels.elementwise.activation import silu_and_mul_ref
from kernels.elementwise.norm import HeadNorms, fused_add_rms_norm_ref, rms_norm_ref
from kernels.elementwise.rotary_kv_write import rotary_write_kv_ref
from kernels.moe.moe import fused_moe_ref

if TYPE_CHECKING:
    from kernels.linear.int8_rows_triton import Int8Rows

logger = logging.getLogger(__name__)

ATTN_BACKEND_ENV = "PAGESTREAM_ATTN_BACKEND"
BACKEND_CHOICES = ("auto", "torch", "triton")
# Which kernel attends the prefill chunks of the Triton backend's steps: the Triton kernel over
# the pages, or (``sdpa``) a fused SDPA kernel over the long chunks' context copied into rows,
# cuDNN's on CUDA (kernels/attention/prefill_sdpa.py), with shapes from a few buckets
# (``sdpa-exact``: each chunk's own shapes). ``auto``: ``sdpa`` on Hopper, where it was measured
# (SDPA_MIN_SEQ_LEN's comment), else ``triton``.
PREFILL_ATTN_ENV = "PAGESTREAM_PREFILL_ATTN"
PREFILL_ATTN_CHOICES = ("auto", "triton", "sdpa", "sdpa-exact")
SDPA_AUTO_CAPABILITY_MAJOR = 9  # Hopper: H100, H200
# A chunk takes the SDPA path if it has at least SDPA_MIN_QUERY_LEN new tokens (where the copy
# of its context is small beside the attention) and a context of at least SDPA_MIN_SEQ_LEN
# tokens, in a step with at most SDPA_MAX_CHUNKS such chunks (a launch pair each); the step's
# other chunks go to the Triton prefill kernel. The path costs 0.24-0.34 ms of host time a
# chunk and layer; on an H200 (bench/results/prefill-sdpa-matrix-rows-h200.json) it wins where
# attention dominates the step (qwen3-0.6b's 32k prompts: 1.11x the Triton kernel's throughput)
# and loses where it does not (4k prompts, no context: 0.55-0.88x, the steps then bound by that
# host time), so short contexts stay on the Triton kernel.
SDPA_MIN_QUERY_LEN = 512
SDPA_MIN_SEQ_LEN = 8192
SDPA_MAX_CHUNKS = 8
# Cascade decode (``--cascade-attention on``): decodes of a step that read the same first
# pages (a shared system prompt, the samples of one prompt) attend that prefix once per tile
# of their queries instead of once per sequence (``paged_attention``'s ``prefix_lens``), when
# at least CASCADE_MIN_DECODES decodes share at least CASCADE_MIN_PREFIX_TOKENS tokens each.
# Replayed from graphs (bench/results/cascade-decode-h100.json, -h200.json), over 16-256
# decodes a 512-token prefix is a wash (0.76-1.47x the plain decode), 1,024 tokens 0.93-2.24x
# and 2,048 tokens 1.4-3.6x.
CASCADE_MIN_DECODES = 16
CASCADE_MIN_PREFIX_TOKENS = 1024
# Prefixes a step cascades at most (groups of decodes, each over its own prompt's pages), the
# most shared first; a decode graph is captured with room for this many.
CASCADE_MAX_GROUPS = 4


def sdpa_takes_chunk(query_len: int, seq_len: int) -> bool:
    """Whether a chunk of ``query_len`` new tokens, ``seq_len`` with its context, is long
    enough for the SDPA path (in a step with at most SDPA_MAX_CHUNKS such chunks)."""
    return query_len >= SDPA_MIN_QUERY_LEN and seq_len >= SDPA_MIN_SEQ_LEN


class CascadeArgs(TypedDict, total=False):
    """``paged_attention``'s cascade arguments (none: a plain decode)."""

    prefix_lens: torch.Tensor
    prefix_pages: torch.Tensor
    prefix_rows: torch.Tensor
    prefix_tile_groups: torch.Tensor


class PrefixGroup(NamedTuple):
    """Decodes of a step that begin with one prompt's pages (``find_shared_prefixes``)."""

    row: int  # the row of the step's block tables whose pages are the group's prefix
    decodes: list[int]  # the decodes with a share of it, in step order


class SharedPrefix(NamedTuple):
    """A step's cascade decode on the device, as ``paged_attention``'s ``prefix_*`` take it."""

    lens: torch.Tensor  # [>= num_decodes] int32: each decode's share, in tokens (0: none)
    pages: torch.Tensor  # [G, max_blocks] int32: each group's prefix pages
    rows: torch.Tensor  # the groups' decodes in row tiles (``prefix_tiles``)
    tile_groups: torch.Tensor

    def kwargs(self) -> CascadeArgs:
        return CascadeArgs(
            prefix_lens=self.lens, prefix_pages=self.pages, prefix_rows=self.rows,
            prefix_tile_groups=self.tile_groups,
        )  # fmt: skip


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens go in the page pool and which pages each sequence reads.

    Sequences are ordered decodes first (``num_decodes`` leading sequences with one new token
    each), then prefill chunks. Device tensors are built once per step by the model runner
    (or are the static buffers of a CUDA graph) and shared by every layer. The ``*_cpu``
    lists are read on the host by the torch backend and by the Triton backend's SDPA path,
    never inside a graph capture: a graph replay leaves them stale.
    """

    slot_mapping: torch.Tensor  # [T] int64: page * block_size + row; -1 = padding, not stored
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    num_decodes: int
    max_seq_len: int
    max_query_len: int
    # A cascade decode (None: none), as ``paged_attention`` reads it on the device: each
    # decode's share of its group's prefix in tokens (``prefix_lens``, ``[num_decodes]`` int32,
    # 0: none), the groups' prefix pages (``prefix_pages``, ``[G, max_blocks]`` int32) and
    # their decodes in row tiles (``prefix_rows``, ``prefix_tile_groups``: ``prefix_tiles``)
    shared_prefix: SharedPrefix | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class LayerCache:
    """One layer's share of the page pool; scales only when pages are fp8."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv] float32
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class RopeInputs:
    """What rotates the new tokens' q and k: their positions and the model's tables."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [max_positions, D] float32 (``rope_cos_sin_cache``)
    sin: torch.Tensor


@dataclass(frozen=True)
class LayerOps:
    """The per-token ops of a decoder layer, all from one kernel family."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (normed, x + residual)
    fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # The same three with their output rounded to int8 blocks for a quantized linear that
    # takes an int8 kernel (``QuantizedLinear.takes_int8_rows``); only the Triton family has them.
    rms_norm_int8: Callable[[torch.Tensor, torch.Tensor, float], Int8Rows] | None = None
    fused_add_rms_norm_int8: (
        Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[Int8Rows, torch.Tensor]]
        | None
    ) = None
    silu_and_mul_int8: Callable[[torch.Tensor], Int8Rows] | None = None
    # (x, w13, w2, router_logits, top_k, renormalize, w13_scale=, w2_scale=) -> [T, H]:
    # a MoE layer's experts (kernels/moe/moe.py)
    fused_moe: Callable[..., torch.Tensor] = fused_moe_ref


class AttentionBackend(Protocol):
    """Norms (Qwen3) and rotates the new q and k, writes K/V into the pool, then attends each
    new query over its context. The q/k norms and rotary live here, not among the layer's
    ops, so that the Triton backend launches one kernel for them and the KV write."""

    name: str
    ops: LayerOps
    # Whether a forward reads only device tensors of the metadata (no host lists, no syncs),
    # so that it can be captured in a CUDA graph and replayed with new contents.
    graph_safe: bool
    # Whether it attends a step's shared prefix as a cascade (else it ignores it)
    takes_shared_prefix: bool

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], not yet rotated; the Triton backend rotates it in place
        k: torch.Tensor,  # [T, Hkv, D], not yet rotated; left as it is
        v: torch.Tensor,  # [T, Hkv, D]
        rope: RopeInputs,
        cache: LayerCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        head_norms: HeadNorms | None = None,  # Qwen3: RMSNorm each q and k head before rotary
        out: torch.Tensor | None = None,  # [T, Hq, D]: where to write, else a new tensor
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def decode_graph_contexts(
        self, num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int
    ) -> list[int]:
        """Context bounds (ascending, the last ``max_seq_len``) at which a decode of
        ``num_seqs`` rows launches differently: a graph is captured for each, and a step
        replays the first that holds its longest context."""
        ...

    def decode_scratch_bytes(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
        device: torch.device, max_seq_len: int, cascade: bool,
    ) -> int:  # fmt: skip
        """Bytes a layer's attention holds for a decode of ``num_seqs`` rows with contexts
        up to ``max_seq_len`` (``cascade``: over a shared prefix) beyond what a decode of
        one-token contexts holds: the split-KV partials."""
        ...

    @property
    def prefill_attention(self) -> str:
        """What attends prefill chunks now: ``torch``, ``triton``, ``sdpa`` or ``sdpa-exact``."""
        ...

    def prefill_workspace_bytes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        """Bytes a layer's attention may hold beyond what a step over fresh prompts shows (the
        memory profile's step): a copy of a long context's K/V, say."""
        ...

    def build_prefill_shapes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        """Builds, on the calling thread, what the prefill path would otherwise build at the
        first step of each shape of a full chunk (cuDNN's graphs, which torch keeps per
        thread); the number of shapes built. Call it on the thread that steps the engine."""
        ...


TORCH_OPS = LayerOps(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    silu_and_mul=silu_and_mul_ref,
)


class TorchAttentionBackend:
    """Plain-torch paged attention: the CPU path and the reference for the Triton kernels."""

    name = "torch"
    ops = TORCH_OPS
    graph_safe = False  # it sizes its gathers from the host-side lengths
    takes_shared_prefix = False  # the reference: every sequence over its own pages
    prefill_attention = "torch"

    def decode_graph_contexts(
        self, num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int
    ) -> list[int]:
        return [max_seq_len]

    def decode_scratch_bytes(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
        device: torch.device, max_seq_len: int, cascade: bool,
    ) -> int:  # fmt: skip
        return 0  # the reference does not split

    def prefill_workspace_bytes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        return 0  # the CPU path: no device memory is planned

    def build_prefill_shapes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        return 0  # nothing is built per shape

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeInputs,
        cache: LayerCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        head_norms: HeadNorms | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = rotary_write_kv_ref(
            q, k, v, rope.positions, rope.cos, rope.sin, cache.k, cache.v, meta.slot_mapping,
            k_scale=cache.k_scale, v_scale=cache.v_scale, head_norms=head_norms,
        )  # fmt: skip
        result = paged_attention_ref(
            q,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.seq_lens_cpu,
            meta.query_start_loc_cpu,
            scale,
            sliding_window,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )
        return result if out is None else out.copy_(result)


class TritonAttentionBackend:
    """The Triton kernels of ``kernels/``: the default on CUDA. ``prefill_attention``: what
    attends the prefill chunks (``prefill_attention_choice``, which ``get_attention_backend``
    makes for the device; None: read from the environment for no device in particular)."""

    name = "triton"
    graph_safe = True
    takes_shared_prefix = True

    def __init__(self, prefill_attention: str | None = None) -> None:
        # Imported here: a CPU-only install never needs triton at import time.
        from kernels.attention.paged_attention_triton import decode_graph_contexts, paged_attention
        from kernels.elementwise.activation_triton import silu_and_mul, silu_and_mul_int8
        from kernels.elementwise.norm_triton import (
            fused_add_rms_norm,
            fused_add_rms_norm_int8,
            rms_norm,
            rms_norm_int8,
        )
        from kernels.elementwise.rotary_kv_write_triton import rotary_write_kv
        from kernels.moe.fused_moe_triton import fused_moe
        from kernels.moe.split_slot_buffers import SplitSlotBuffers

        self.ops = LayerOps(
            rms_norm,
            fused_add_rms_norm,
            silu_and_mul,
            rms_norm_int8=rms_norm_int8,
            fused_add_rms_norm_int8=fused_add_rms_norm_int8,
            silu_and_mul_int8=silu_and_mul_int8,
            # the model's MoE layers run one after another: one set of split-slot buffers
            fused_moe=functools.partial(fused_moe, direct_buffers=SplitSlotBuffers()),
        )
        self._rotary_write_kv = rotary_write_kv
        self._paged_attention = paged_attention
        self._decode_graph_contexts = decode_graph_contexts
        self._prefill_sdpa: Callable[..., None] | None = None
        self._fused_choice = prefill_attention or prefill_attention_choice()
        if self._fused_choice != "triton":
            from kernels.attention import prefill_sdpa
            from kernels.attention.merge_states_triton import merge_states

            self._prefill_sdpa = functools.partial(
                prefill_sdpa.prefill_sdpa, attend=prefill_sdpa.fused_attend, merge=merge_states,
                buckets=self._fused_choice == "sdpa",
            )  # fmt: skip
            self._fused_attention_takes = prefill_sdpa.fused_attention_takes

    @property
    def prefill_attention(self) -> str:
        """``PAGESTREAM_PREFILL_ATTN``'s choice, or ``triton`` once cuDNN refused a chunk."""
        return "triton" if self._prefill_sdpa is None else self._fused_choice

    def decode_graph_contexts(
        self, num_seqs: int, num_kv_heads: int, device: torch.device, max_seq_len: int
    ) -> list[int]:
        return self._decode_graph_contexts(num_seqs, num_kv_heads, device, max_seq_len)

    def decode_scratch_bytes(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
        device: torch.device, max_seq_len: int, cascade: bool,
    ) -> int:  # fmt: skip
        from kernels.attention.paged_attention_triton import decode_scratch_bytes

        return decode_scratch_bytes(
            num_seqs, num_heads, num_kv_heads, head_dim, device, max_seq_len, cascade
        )

    def prefill_workspace_bytes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        if self._prefill_sdpa is None or not sdpa_takes_chunk(max_query_len, max_seq_len):
            return 0  # no chunk of this model takes the path
        from kernels.attention.prefill_sdpa import workspace_bytes

        return workspace_bytes(num_heads, num_kv_heads, head_dim, dtype, max_seq_len, max_query_len)

    def build_prefill_shapes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, max_seq_len: int, max_query_len: int,
    ) -> int:  # fmt: skip
        """With the bucketed SDPA path on a GPU, every full chunk's shapes
        (``prefill_sdpa.full_chunk_shapes``; 22 for qwen3-0.6b's 40k context, built in 0.9 s on
        an H200), once per thread, instead of a stall of the whole batch at the first step that
        meets each (70-160 ms apiece, probed on an H100). ``sdpa-exact``'s
        shapes are a chunk's own, too many to build ahead; on a CPU nothing is built."""
        if self._prefill_sdpa is None or self._fused_choice != "sdpa" or device.type != "cuda":
            return 0
        if max_query_len < SDPA_MIN_QUERY_LEN:
            return 0
        pages = torch.empty(0, 1, num_kv_heads, head_dim, dtype=dtype, device=device)
        if not self._fused_attention_takes(pages):
            return 0
        from kernels.attention import prefill_sdpa
        from kernels.attention.merge_states_triton import merge_states

        shapes = prefill_sdpa.full_chunk_shapes(max_query_len, max_seq_len, SDPA_MIN_SEQ_LEN)
        try:
            return prefill_sdpa.build_shapes(
                shapes, num_heads, num_kv_heads, head_dim, dtype, device,
                prefill_sdpa.fused_attend, merge_states,
            )  # fmt: skip
        except RuntimeError as error:  # as in forward
            self._fused_refused(error)
            return 0

    def _fused_refused(self, error: RuntimeError) -> None:
        """The fused kernel refused a shape or the card: the Triton kernel from now on."""
        logger.warning(
            "%s=%s: the fused kernel refused a prefill chunk (%s); the Triton kernel attends "
            "every prefill chunk from now on",
            PREFILL_ATTN_ENV, self.prefill_attention, str(error)[:300],
        )  # fmt: skip
        self._prefill_sdpa = None

    def _sdpa_chunks(
        self, meta: AttentionMetadata, cache: LayerCache, sliding_window: int | None
    ) -> list[int]:
        """The step's prefill chunks that go to the SDPA path: the long ones over a long
        context, if there are at most SDPA_MAX_CHUNKS, over pages the fused kernel takes (not
        fp8; on CUDA 16-bit, head dim up to 128), with no sliding window, and not inside a graph
        capture (the path reads the step's host-side lengths); else none."""
        if not sdpa_takes_chunk(meta.max_query_len, meta.max_seq_len):
            return []  # most steps, in O(1) for each layer
        if sliding_window is not None or cache.k_scale is not None:
            return []
        if not self._fused_attention_takes(cache.k):  # an fp32 model on CUDA, say
            return []
        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        chunks = [
            seq
            for seq in range(meta.num_decodes, meta.num_seqs)
            if sdpa_takes_chunk(starts[seq + 1] - starts[seq], seq_lens[seq])
        ]
        if len(chunks) > SDPA_MAX_CHUNKS:
            return []
        if (
            chunks
            and meta.seq_lens.device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        ):
            return []
        return chunks

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeInputs,
        cache: LayerCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        head_norms: HeadNorms | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # one launch: q normed (Qwen3) and rotated in place, k into the pages beside v
        self._rotary_write_kv(
            q, k, v, rope.positions, rope.cos, rope.sin, cache.k, cache.v, meta.slot_mapping,
            k_scale=cache.k_scale, v_scale=cache.v_scale, head_norms=head_norms,
        )  # fmt: skip
        if self._prefill_sdpa is not None and meta.num_decodes < meta.num_seqs:
            long_chunks = self._sdpa_chunks(meta, cache, sliding_window)
            if long_chunks:
                try:
                    return self._attend_with_sdpa(q, cache, meta, scale, long_chunks, out)
                except RuntimeError as error:  # a shape or card cuDNN refuses: Triton from here
                    self._fused_refused(error)
        return self._paged_attention(
            q,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale=scale,
            max_query_len=meta.max_query_len,
            num_decodes=meta.num_decodes,
            max_seq_len=meta.max_seq_len,
            sliding_window=sliding_window,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            out=out,
            **_cascade(meta, sliding_window),
        )

    def _attend_with_sdpa(
        self,
        q: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
        scale: float,
        long_chunks: list[int],
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decodes by the Triton decode kernel, ``long_chunks`` by ``prefill_sdpa``, and
        each run of other chunks between them by the Triton prefill kernel, over the step's
        own tensors with the run's range (``paged_attention``'s ``first_seq``: never slices,
        whose pointers Triton would compile another kernel for)."""
        assert self._prefill_sdpa is not None
        if out is None:
            out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        runs, first = [], 0  # [first, end) sequence ranges for the Triton kernels
        for seq in [*long_chunks, meta.num_seqs]:
            if seq > first:
                runs.append((first, seq))
            first = seq + 1
        cascade = _cascade(meta, None)  # the path takes no window
        for first, end in runs:
            longest = max(starts[seq + 1] - starts[seq] for seq in range(first, end))
            self._paged_attention(
                q, cache.k, cache.v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                scale=scale, max_query_len=longest, num_decodes=meta.num_decodes,
                max_seq_len=meta.max_seq_len, out=out, first_seq=first, end_seq=end,
                **cascade,  # the decodes: run 0
            )  # fmt: skip
        self._prefill_sdpa(
            q, cache.k, cache.v, meta.block_tables, meta.seq_lens_cpu, meta.query_start_loc_cpu,
            seqs=long_chunks, scale=scale, out=out,
        )  # fmt: skip
        return out


def _cascade(meta: AttentionMetadata, sliding_window: int | None) -> CascadeArgs:
    """The step's cascade as ``paged_attention``'s ``prefix_*`` arguments, unless the layer's
    window hides keys of it (a model whose layers alternate windows attends its windowed
    ones plainly)."""
    if sliding_window is not None or meta.shared_prefix is None:
        return CascadeArgs()
    return meta.shared_prefix.kwargs()


def find_shared_prefixes(
    tables: np.ndarray, table_lens: list[int], seq_lens: list[int], num_decodes: int,
    block_size: int,
) -> tuple[list[int], list[PrefixGroup]] | None:  # fmt: skip
    """A step's cascade: each of its ``num_decodes`` decodes' share of its group's prefix, in
    tokens, and the groups, ``tables`` being the padded ``[B, W]`` block tables, decodes
    first; None when no CASCADE_MIN_DECODES decodes share CASCADE_MIN_PREFIX_TOKENS.

    A group is the decodes that begin with one page (a system prompt), the most common first
    page first, CASCADE_MAX_GROUPS at most. Its prefix is the pages of its first decode; a
    decode's share is the run of leading pages its table names alike, below the page of its
    own last token, if at least CASCADE_MIN_PREFIX_TOKENS, else 0. A group needs
    CASCADE_MIN_DECODES decodes with a share; the decodes of no group, and prompts that part
    early, attend as ever."""
    if num_decodes < CASCADE_MIN_DECODES:
        return None
    rows = tables[:num_decodes]
    # pages a decode may give: its own, whose tokens all lie before its query
    own = np.minimum(
        table_lens[:num_decodes], (np.asarray(seq_lens[:num_decodes]) - 1) // block_size
    )
    firsts, counts = np.unique(rows[:, 0], return_counts=True)
    shares = np.zeros(num_decodes, dtype=np.int64)
    groups: list[PrefixGroup] = []
    order = np.argsort(-counts, kind="stable")
    for first, count in zip(firsts[order], counts[order], strict=True):
        if count < CASCADE_MIN_DECODES or len(groups) == CASCADE_MAX_GROUPS:
            break
        members = np.flatnonzero(rows[:, 0] == first)
        row = int(members[0])
        width = int(own[row])
        alike = np.cumprod(rows[members, :width] == rows[row, :width], axis=1).sum(axis=1)
        share = np.minimum(alike, own[members]) * block_size
        share[share < CASCADE_MIN_PREFIX_TOKENS] = 0
        if np.count_nonzero(share) >= CASCADE_MIN_DECODES:
            shares[members] = share
            groups.append(PrefixGroup(row, members[share > 0].tolist()))
    return (shares.tolist(), groups) if groups else None


def prefill_attention_choice(device: torch.device | None = None) -> str:
    """``PAGESTREAM_PREFILL_ATTN`` for a backend on ``device``: ``triton``, ``sdpa`` or
    ``sdpa-exact``; ``auto`` (the default) is ``sdpa`` on a Hopper GPU, else ``triton``."""
    choice = os.environ.get(PREFILL_ATTN_ENV, "auto")
    if choice not in PREFILL_ATTN_CHOICES:
        raise ConfigError(
            f"{PREFILL_ATTN_ENV}={choice!r}: expected one of {', '.join(PREFILL_ATTN_CHOICES)}"
        )
    if choice != "auto":
        return choice
    on_hopper = (
        device is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == SDPA_AUTO_CAPABILITY_MAJOR
    )
    return "sdpa" if on_hopper else "triton"


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA, torch elsewhere; ``PAGESTREAM_ATTN_BACKEND`` overrides the choice.
    ``PAGESTREAM_PREFILL_ATTN`` is checked on every backend: a wrong value is an error, not
    ignored where the torch backend has no use for it."""
    prefill = prefill_attention_choice(device)
    choice = os.environ.get(ATTN_BACKEND_ENV, "auto")
    if choice not in BACKEND_CHOICES:
        raise ConfigError(
            f"{ATTN_BACKEND_ENV}={choice!r}: expected one of {', '.join(BACKEND_CHOICES)}"
        )
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return TritonAttentionBackend(prefill)
    return TorchAttentionBackend()
