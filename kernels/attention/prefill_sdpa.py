"""Long prefill chunks attended by a fused SDPA kernel over their pages copied into rows.

The Triton prefill kernel (``paged_attention_prefill_triton.py``) reads K and V from the pages
where they lie; on Hopper it runs at about 400 TFLOP/s, where cuDNN's fused attention, fed
contiguous rows, is reported at FlashAttention 3's 580-630 (the prefill-heavy and long-context
rows of ``bench matrix`` are bound by this kernel: docs/performance.md). For a chunk long enough
that a copy of its context is cheap beside attending over it (the copy moves ``L * Hkv * D``
values; the attention does ``4 * C * L * Hq * D`` FLOPs), this path copies the sequence's pages
into rows laid out for a fused kernel (``ChunkLayout``; on CUDA one Triton launch,
``gather_rows_triton.py``) and attends with it.

A chunk of ``C`` new tokens at the end of a context of ``L = P + C`` sees all ``P`` earlier
keys and, causally, its own ``C``. A fused kernel's causal mask is only unambiguous when it is
square, so the chunk is attended twice, over the ``P`` earlier keys with no mask and over its
own ``C`` keys with the causal mask, and the two parts are merged by their log-sum-exps
(``merge_states_ref``; ``merge_states_triton.py`` in one pass), which is exact: a softmax over
two disjoint sets of keys. A chunk with no earlier context is one causal call.

cuDNN builds a graph for each new shape, and a serving engine's chunk and context lengths
change every step; with ``buckets`` (the engine's ``sdpa``) the two parts get shapes from a few
sizes, exactly (``_attend_chunk``). A build takes 70-160 ms of host time (on an H100), during
which the whole batch waits: ``full_chunk_shapes`` lists the shapes of every full chunk, which
``build_shapes`` builds ahead, on the thread that will attend (torch keeps cuDNN's graphs per
thread; bench/results/prefill-sdpa-warm-h200.json).

``attend``, the kernel, is a parameter: the engine's ``fused_attend`` runs cuDNN's on CUDA and
plain torch (``attend_math``) on a CPU, where the tests check the split, the merge and the
layout; its GPU test checks cuDNN's. So is ``gather``, the copy out of the pages: by default
``device_gather`` picks the Triton kernel on CUDA and plain torch (``gather_rows_ref``)
elsewhere; the tests run the kernel through Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernels.attention.paged_attention import gather_context

# (q [1, Hq, Q, D], k [1, Hkv, K, D], v, causal, scale) -> (o [1, Hq, Q, D], lse [1, Hq, Q]
# float32); causal only with Q == K
Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]
]
# (o1 [H, Q, D], lse1 [H, Q], o2, lse2, out [Q, H, D]) -> None
Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (k_cache [NB, BS, Hkv, D], v_cache, block_table [max_blocks], seq_len, keys_out [N, Hkv, D],
# values_out) -> None: rows below seq_len the sequence's tokens out of its pages, then zeros
Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], None]
# Bucketed shapes (``_attend_chunk``): earlier keys in whole blocks of KEY_BLOCK; row counts
# padded to a bucket (``shape_bucket``) of at least MIN_BUCKET, geometric up to KEY_BLOCK and in
# steps of LARGE_BUCKET_STEP above
KEY_BLOCK = 2048
MIN_BUCKET = 128
LARGE_BUCKET_STEP = 512


def attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch ``Attend``: fp32 scores, GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # [1, Hq, Q, K]
    if causal:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"a causal part must be square, got {q.shape[2]} x {k.shape[2]}")
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(diagonal=1), float("-inf")
        )
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ values).to(q.dtype), lse


CUDNN_DTYPES = (torch.float16, torch.bfloat16)
CUDNN_MAX_HEAD_DIM = 128


def fused_attention_takes(pages: torch.Tensor) -> bool:
    """Whether ``fused_attend`` takes K/V of these pages (``[NB, BS, Hkv, D]``): on CUDA,
    cuDNN's 16-bit kernels with a head dim that is a multiple of 8 up to 128; elsewhere, the
    plain-torch kernel takes anything."""
    if pages.device.type != "cuda":
        return True
    head_dim = pages.shape[-1]
    return pages.dtype in CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM


def fused_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's ``Attend``: on CUDA, torch's cuDNN attention
    (``_scaled_dot_product_cudnn_attention``, which returns the log-sum-exp beside the output),
    K/V with fewer heads than q (GQA) as they are, which cuDNN takes on Hopper (16 and 32 query
    heads over 8 on an H200); elsewhere (the CPU runs of the Triton kernels under the
    interpreter), ``attend_math``. A call cuDNN refuses raises, and the engine's backend then
    attends every prefill chunk with the Triton kernel: no copy of K/V with their heads
    repeated, which the memory plan does not hold."""
    if q.device.type != "cuda":
        return attend_math(q, k, v, causal, scale)
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    out, lse = result[0], result[1]
    return out, lse.reshape(q.shape[:3]).float()


def merge_states_ref(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, out: torch.Tensor
) -> None:
    """Writes into ``out [Q, H, D]`` the merge of two parts ``o [H, Q, D], lse [H, Q]``
    attended over disjoint keys (the module docstring's formula)."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[..., None], torch.exp(lse2 - top)[..., None]
    merged = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    out.copy_(merged.transpose(0, 1))


def gather_rows_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
) -> None:
    """The plain-torch ``Gather``: ``gather_context``'s rows, then zeros."""
    keys, values = gather_context(k_cache, v_cache, block_table, seq_len)
    for rows, context in ((keys_out, keys), (values_out, values)):
        rows[:seq_len] = context
        rows[seq_len:] = 0


def device_gather(pages: torch.Tensor) -> Gather:
    """The engine's ``Gather`` for pages on this device: on CUDA the Triton kernel, K, V and
    their padding in one launch; elsewhere ``gather_rows_ref``."""
    if pages.device.type != "cuda":
        return gather_rows_ref
    from kernels.attention.gather_rows_triton import gather_rows  # triton: only where it runs

    return gather_rows


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    """``[S, H, D]`` rows -> ``[1, H, S, D]``, a view (the BSHD layout SDPA kernels take)."""
    return rows.unsqueeze(0).transpose(1, 2)


def shape_bucket(n: int) -> int:
    """The smallest bucket of at least ``n`` rows: 128, 192, 256, 384, ..., 2048 (powers of two
    and 1.5 times them), then multiples of 512. At most a third of a small bucket is padding,
    at most 511 rows of a large one (under 6% of a chunk of 8k: a padding row below the causal
    diagonal costs as much as a real one)."""
    if n > KEY_BLOCK:
        return -(-n // LARGE_BUCKET_STEP) * LARGE_BUCKET_STEP
    size = MIN_BUCKET
    while size < n:
        if size * 3 // 2 >= n:
            return size * 3 // 2
        size *= 2
    return size


@dataclass(frozen=True)
class ChunkLayout:
    """Where a chunk of ``num_queries`` new tokens at the end of its context goes in the two
    calls ``_attend_chunk`` makes: the ``whole`` earlier keys unmasked, then a causal
    ``square`` of the ``rest`` of them, the chunk's own and zeros. Its K/V rows are the
    context's then zeros, ``key_rows`` in all; its queries are padded to ``padded`` rows for
    the unmasked call."""

    whole: int  # earlier keys attended unmasked: whole KEY_BLOCKs with buckets
    rest: int  # earlier keys in the square, before the chunk's own
    square: int  # the causal call's rows: rest + num_queries, then padding
    padded: int  # the unmasked call's query rows: num_queries, then padding

    @classmethod
    def of(cls, num_queries: int, seq_len: int, buckets: bool) -> ChunkLayout:
        """With ``buckets`` the shapes come from a few sizes (``_attend_chunk``); without,
        blocks of one key and no padding: the chunk's own shapes."""
        earlier = seq_len - num_queries
        key_block = KEY_BLOCK if buckets else 1
        bucket = shape_bucket if buckets else int
        whole = earlier // key_block * key_block
        rest = earlier - whole
        return cls(whole, rest, bucket(rest + num_queries), bucket(num_queries))

    @property
    def key_rows(self) -> int:
        """K/V rows: the unmasked call's, then the square's."""
        return self.whole + self.square


def prefill_sdpa(
    q: torch.Tensor,  # [T, Hq, D], already rotated
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], holding the new tokens' K/V already
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: list[int],  # [B] context lengths, new tokens included
    query_start_loc: list[int],  # [B + 1]
    *,
    seqs: Iterable[int],  # the prefill chunks to attend; other sequences are left alone
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the rows of ``seqs`` are written
    attend: Attend,
    merge: Merge = merge_states_ref,
    gather: Gather | None = None,
    buckets: bool = True,
) -> None:
    """Attention of each chunk of ``seqs`` over its context, as ``paged_attention_ref``
    computes it (no sliding window, no fp8 pages), one sequence at a time. ``buckets``: give
    ``attend`` padded shapes from a few (``_attend_chunk``), else the chunk's own."""
    gather = gather or device_gather(k_cache)
    for seq in seqs:
        start, end = query_start_loc[seq], query_start_loc[seq + 1]
        query_len, seq_len = end - start, seq_lens[seq]
        if query_len == 0:
            continue
        layout = ChunkLayout.of(query_len, seq_len, buckets)
        keys, values = k_cache.new_empty(2, layout.key_rows, *k_cache.shape[2:])
        gather(k_cache, v_cache, block_tables[seq], seq_len, keys, values)
        _attend_chunk(q[start:end], keys, values, out[start:end], layout, scale, attend, merge)


def _attend_chunk(
    queries: torch.Tensor,  # [C, Hq, D]
    keys: torch.Tensor,  # [layout.key_rows, Hkv, D]: the context's, the chunk's own last, zeros
    values: torch.Tensor,
    out: torch.Tensor,  # [C, Hq, D]
    layout: ChunkLayout,
    scale: float,
    attend: Attend,
    merge: Merge,
) -> None:
    """One chunk over its earlier keys (no mask) and its own (causal), the parts merged.

    With buckets the shapes come from a few sizes, exactly: a fused kernel may build itself
    for each new shape (cuDNN's graphs, hundreds of milliseconds each), and chunk and context
    lengths change from step to step. The earlier keys are attended unmasked in whole
    ``KEY_BLOCK``s; the ``rest`` of them join the causal part, a square of
    ``shape_bucket(rest + C)`` rows whose first ``rest`` queries are zeros: under the square's
    causal mask the chunk's query ``i`` (row ``rest + i``) sees exactly the ``rest`` keys and
    its own first ``i + 1``. Rows past ``rest + C`` are zero padding that no real query sees;
    the unmasked part's queries are padded to ``shape_bucket(C)`` rows. Padding rows' outputs
    are dropped. Without buckets: blocks of one key, no padding (each chunk's own shapes)."""
    num_queries, num_heads, head_dim = queries.shape
    whole, rest, square, padded = layout.whole, layout.rest, layout.square, layout.padded
    rows = queries.new_zeros(max(square, rest + padded), num_heads, head_dim)
    rows[rest : rest + num_queries] = queries
    own, lse_own = attend(
        _heads_first(rows[:square]), _heads_first(keys[whole:]), _heads_first(values[whole:]),
        True, scale,
    )  # fmt: skip
    own, lse_own = own[0, :, rest : rest + num_queries], lse_own[0, :, rest : rest + num_queries]
    if whole == 0:
        out.copy_(own.transpose(0, 1))
        return
    before, lse_before = attend(
        _heads_first(rows[rest : rest + padded]), _heads_first(keys[:whole]),
        _heads_first(values[:whole]), False, scale,
    )  # fmt: skip
    merge(before[0, :, :num_queries], lse_before[0, :, :num_queries], own, lse_own, out)


def full_chunk_shapes(
    max_query_len: int, max_seq_len: int, min_seq_len: int, chunk_slack: int = 511
) -> list[tuple[int, int, bool]]:
    """``(query rows, key rows, causal)`` of every call ``_attend_chunk`` makes with buckets
    for a chunk of ``max_query_len - chunk_slack`` to ``max_query_len`` new tokens (a full
    chunk, less a step's decodes) whose context, its own tokens included, is at least
    ``min_seq_len`` and at most ``max_seq_len`` tokens: the shapes a run of long prompts meets.
    Shorter chunks (a prompt's last) may meet others."""
    low = max(1, max_query_len - chunk_slack)
    if max_seq_len < max(min_seq_len, low):
        return []
    squares = {shape_bucket(n) for n in range(low, max_query_len + KEY_BLOCK)}
    shapes = [(square, square, True) for square in sorted(squares)]
    by_bucket: dict[int, list[int]] = {}  # padded rows -> the chunk lengths padded to them
    for num_queries in range(low, max_query_len + 1):
        by_bucket.setdefault(shape_bucket(num_queries), []).append(num_queries)
    for rows, lengths in sorted(by_bucket.items()):
        # earlier keys: from what the shortest context needs to what the longest allows
        first = max(min_seq_len - lengths[-1], 0) // KEY_BLOCK * KEY_BLOCK
        wholes = range(max(first, KEY_BLOCK), max_seq_len - lengths[0] + 1, KEY_BLOCK)
        shapes += [(rows, whole, False) for whole in wholes]
    return shapes


def build_shapes(
    shapes: Iterable[tuple[int, int, bool]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    attend: Attend,
    merge: Merge | None = None,
) -> int:
    """Calls ``attend`` once on zeros of each shape, laid out as ``_attend_chunk`` lays its
    calls (views of ``[S, H, D]`` rows): what a kernel builds per shape and thread, it then
    holds; with ``merge``, also two full chunks through ``_attend_chunk``. Returns how many
    shapes were called."""
    shapes = list(shapes)
    if not shapes:
        return 0
    max_q = max(rows for rows, _, _ in shapes)
    max_k = max(keys for _, keys, _ in shapes)
    queries = torch.zeros(max_q, num_heads, head_dim, dtype=dtype, device=device)
    keys = torch.zeros(max_k, num_kv_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    for rows, num_keys, causal in shapes:
        part = _heads_first(keys[:num_keys])
        attend(_heads_first(queries[:rows]), part, part, causal, scale)
    if merge is not None:
        _merge_chunks(shapes, queries, keys, scale, attend, merge)
    return len(shapes)


def _merge_chunks(
    shapes: list[tuple[int, int, bool]],
    queries: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    attend: Attend,
    merge: Merge,
) -> None:
    """Two full chunks through ``_attend_chunk`` on the built shapes, so that what the merge
    compiles per layout (a JIT kernel specializes on its pointers' alignment: the causal
    part's log-sum-exps start ``rest`` floats in) is compiled too: ``rest`` of 0 and 1."""
    unmasked = [(rows, num_keys) for rows, num_keys, causal in shapes if not causal]
    if not unmasked:
        return
    # a full chunk's padded length, after the shortest whole number of key blocks
    num_queries = max(rows for rows, _ in unmasked)
    whole = min(num_keys for _, num_keys in unmasked)
    out = torch.empty_like(queries[:num_queries])
    for rest in (0, 1):
        layout = ChunkLayout.of(num_queries, whole + rest + num_queries, buckets=True)
        context = keys.new_zeros(layout.key_rows, *keys.shape[1:])  # as gathered: zeros
        _attend_chunk(queries[:num_queries], context, context, out, layout, scale, attend, merge)


def workspace_bytes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int,
    max_query_len: int,
) -> int:
    """Bytes this path holds at most beside a layer's usual temporaries: one sequence's K and
    V rows laid out (``ChunkLayout``: its context, then the causal square's padding), the padded
    queries, the two parts and their log-sum-exps."""
    element = torch.tensor([], dtype=dtype).element_size()
    # the square holds rest + C rows (rest < KEY_BLOCK) padded to a bucket
    most_padding = max(shape_bucket(n) - n for n in range(1, KEY_BLOCK + max_query_len))
    rows = 2 * (max_seq_len + most_padding) * num_kv_heads * head_dim * element  # K/V
    square = shape_bucket(KEY_BLOCK + max_query_len) + shape_bucket(max_query_len)
    queries = square * num_heads * head_dim * element  # the queries padded
    parts = 2 * square * num_heads * (head_dim * element + 4)  # the two parts, their lse
    return rows + queries + parts
