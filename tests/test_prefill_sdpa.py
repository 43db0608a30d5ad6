"""Prefill chunks attended over their gathered pages (``kernels/attention/prefill_sdpa.py``)
against ``paged_attention_ref``: the split at the chunk's first token and the merge of the two
parts on the CPU with the plain-torch kernel; the merge and gather kernels through Triton's
interpreter; cuDNN's kernel on a GPU.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch

from engine.attention import AttentionMetadata, backend
from kernels.attention import prefill_sdpa as prefill_sdpa_module
from kernels.attention.paged_attention import write_kv_ref
from kernels.attention.prefill_sdpa import (
    ChunkLayout,
    attend_math,
    build_shapes,
    full_chunk_shapes,
    fused_attend,
    gather_rows_ref,
    merge_states_ref,
    prefill_sdpa,
    shape_bucket,
    workspace_bytes,
)
from tests.test_triton_paged_attention import TOLERANCE, Batch, make_batch
from tests.triton_interpret import CUDA, DEVICE, import_kernels

kernels = import_kernels(
    ("kernels.attention.merge_states_triton", "kernels.attention.gather_rows_triton")
)
merge_states = kernels["merge_states_triton"].merge_states
gather_rows = kernels["gather_rows_triton"].gather_rows

# decodes first (left alone by this path), then chunks over 0, a partial page, many pages
QUERY_LENS = [1, 1, 24, 9, 40, 5]
CONTEXT_LENS = [30, 3, 0, 13, 70, 1]
NUM_DECODES = 2


def gather_into_nan(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
) -> None:
    """The Triton kernel into rows of NaN: a padding row it leaves unwritten poisons its
    chunk's output (a masked value times its zero weight is NaN)."""
    keys_out.fill_(float("nan"))
    values_out.fill_(float("nan"))
    gather_rows(k_cache, v_cache, block_table, seq_len, keys_out, values_out)


def run(
    batch: Batch,
    attend: object,
    merge: object = merge_states_ref,
    first_seq: int = NUM_DECODES,
    buckets: bool = False,
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    prefill_sdpa(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, seqs=range(first_seq, len(batch.seq_lens)),
        scale=batch.q.shape[-1] ** -0.5, out=out, attend=attend,  # type: ignore[arg-type]
        merge=merge, gather=gather_into_nan, buckets=buckets,  # type: ignore[arg-type]
    )  # fmt: skip
    return out


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Key blocks of 16 and buckets from 8, so that the test's contexts span whole blocks and
    a rest, and its chunks are padded."""
    monkeypatch.setattr(prefill_sdpa_module, "KEY_BLOCK", 16)
    monkeypatch.setattr(prefill_sdpa_module, "MIN_BUCKET", 8)
    monkeypatch.setattr(prefill_sdpa_module, "LARGE_BUCKET_STEP", 8)


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype"),
    [(16, 4, 4, torch.float32), (16, 8, 2, torch.float32), (32, 6, 3, torch.bfloat16)],
)
@pytest.mark.usefixtures("small_buckets")
def test_chunks_match_the_reference_and_decodes_are_left_alone(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, buckets: bool
) -> None:
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=dtype, seed=num_heads,
    )  # fmt: skip
    out = run(batch, attend_math, buckets=buckets)
    first_chunk_row = batch.query_start_loc[NUM_DECODES]
    assert out[:first_chunk_row].isnan().all()  # the decodes' rows are the caller's
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out[first_chunk_row:], batch.reference()[first_chunk_row:], atol=tol, rtol=tol
    )


@pytest.mark.usefixtures("small_buckets")
def test_bucketed_shapes_are_few_and_exact() -> None:
    """Chunks of 9 and 40 new tokens over 13 and 70 earlier ones: the earlier keys in whole
    blocks of 16 (none, and 64), the rest (13 and 6) in the causal square, every shape a
    bucket."""
    batch = make_batch([9, 40], [13, 70], block_size=16, num_heads=4, num_kv_heads=2,
                       dtype=torch.float32)  # fmt: skip
    calls: list[tuple[int, int, bool]] = []

    def recording(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((q.shape[2], k.shape[2], causal))
        return attend_math(q, k, v, causal, scale)

    out = run(batch, recording, first_seq=0, buckets=True)
    torch.testing.assert_close(out, batch.reference(), atol=2e-5, rtol=2e-5)
    # 13 + 9 -> a square of 24; 6 + 40 -> 48, then 40 queries (bucket 40) over 64 keys
    assert calls == [(24, 24, True), (48, 48, True), (40, 64, False)]
    # geometric up to the key block (16), then steps of 8
    assert [shape_bucket(n) for n in (1, 8, 9, 13, 16, 17, 25, 100)] == [
        8,
        8,
        12,
        16,
        16,
        24,
        32,
        104,
    ]


Signature = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]


def signing(calls: set[Signature]) -> Any:
    """An ``Attend`` that records what a kernel's per-shape cache sees of each call (q's and
    k's shapes and strides, v's as k's, the mask) and returns zeros."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert (v.shape, v.stride()) == (k.shape, k.stride())
        calls.add((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), causal))
        return torch.zeros_like(q), torch.zeros(q.shape[:3], device=q.device)

    return attend


@pytest.mark.usefixtures("small_buckets")
def test_full_chunk_shapes_are_every_call_a_full_chunk_makes() -> None:
    """Chunks of 29-40 new tokens (a full chunk of 40, less up to 11 decodes) over contexts
    of 64-200 tokens: every call the path makes, shapes and strides alike, is one that
    ``build_shapes`` made of ``full_chunk_shapes`` (so a kernel that builds per shape has
    built it), and each of those shapes is met."""
    made: set[Signature] = set()
    shapes = full_chunk_shapes(40, 200, 64, chunk_slack=11)
    merged_at: list[int] = []  # where each merge's causal log-sum-exps start

    def merge(o1: Any, lse1: Any, o2: Any, lse2: torch.Tensor, out: Any) -> None:
        merged_at.append(lse2.storage_offset())

    device = torch.device(DEVICE)
    assert build_shapes(shapes, 4, 2, 32, torch.float32, device, signing(made), merge) == len(
        shapes
    )
    assert merged_at == [0, 1]  # the merge met both alignments of the causal part
    built = {(q[2], k[2], causal) for q, _, k, _, causal in made}
    assert built == set(shapes)  # the merged chunks built nothing new
    met: set[Signature] = set()
    gen = torch.Generator().manual_seed(0)
    samples = [(40, 160), (32, 168), (29, 171), (40, 24)]  # the edges, then at random
    for _ in range(40):
        chunk = int(torch.randint(29, 41, (1,), generator=gen))
        samples.append(
            (chunk, int(torch.randint(64 - chunk, 200 - chunk + 1, (1,), generator=gen)))
        )
    for chunk, earlier in samples:
        batch = make_batch([chunk], [earlier], block_size=16, num_heads=4, num_kv_heads=2,
                           dtype=torch.float32, seed=earlier, write=write_kv_ref)  # fmt: skip
        run(batch, signing(met), first_seq=0, buckets=True)
    assert met <= made
    # padded to 32 rows (29-32 new tokens) or 40 (33-40): over 32-160 or 16-160 earlier keys
    assert [s for s in shapes if not s[2]] == [(32, k, False) for k in range(32, 161, 16)] + [
        (40, k, False) for k in range(16, 161, 16)
    ]
    assert {(q[2], k[2], causal) for q, _, k, _, causal in met} >= {
        (40, 160, False),
        (40, 16, False),
    }


def test_full_chunk_shapes_at_serving_sizes() -> None:
    """A 4096-token chunk up to 32k of context: five causal squares (the rest of a key block
    and the chunk) and the chunk over each whole number of key blocks it can follow; none
    where no context reaches the path's minimum."""
    shapes = full_chunk_shapes(4096, 32768, 8192)
    assert [s for s in shapes if s[2]] == [(n, n, True) for n in (4096, 4608, 5120, 5632, 6144)]
    assert [k for _, k, causal in shapes if not causal] == list(range(4096, 28673, 2048))
    assert full_chunk_shapes(4096, 4096, 8192) == []


def test_bucket_sizes() -> None:
    sizes = (1, 129, 200, 1000, 2048, 2049, 8160, 8192, 9000)
    buckets = (128, 192, 256, 1024, 2048, 2560, 8192, 8192, 9216)
    assert tuple(shape_bucket(n) for n in sizes) == buckets


def test_a_chunk_over_context_is_two_parts_merged() -> None:
    """Each chunk's own shapes: its queries see their own 16 keys causally and the 20 earlier
    ones unmasked, and the merge weighs the two by their log-sum-exps: either part alone is
    far off."""
    batch = make_batch([16], [20], block_size=16, num_heads=4, num_kv_heads=2,
                       dtype=torch.float32)  # fmt: skip
    calls: list[tuple[int, bool]] = []

    def recording(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((k.shape[2], causal))
        return attend_math(q, k, v, causal, scale)

    expected = batch.reference()
    torch.testing.assert_close(run(batch, recording, first_seq=0), expected, atol=2e-5, rtol=2e-5)
    assert calls == [(16, True), (20, False)]

    def first_only(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                   out: torch.Tensor) -> None:  # fmt: skip
        out.copy_(o1.transpose(0, 1))

    def second_only(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                    out: torch.Tensor) -> None:  # fmt: skip
        out.copy_(o2.transpose(0, 1))

    for wrong in (first_only, second_only):
        assert not torch.allclose(run(batch, attend_math, wrong, 0), expected, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_matches_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    heads, queries, head_dim = 3, 5, 24  # a head_dim under its power-of-two block
    o1, o2 = torch.randn(2, heads, queries, head_dim, device=DEVICE, dtype=dtype)
    lse1, lse2 = torch.randn(2, heads, queries, device=DEVICE) * 4
    lse2[0, 0] = lse1[0, 0] + 60  # one part all but absent: no overflow
    expected = torch.empty(queries, heads, head_dim, device=DEVICE, dtype=dtype)
    merge_states_ref(o1, lse1, o2, lse2, expected)
    # the parts' layout as cuDNN writes them (heads inside rows): strided [H, Q, D] views
    strided = torch.empty(queries, heads, head_dim, device=DEVICE, dtype=dtype).transpose(0, 1)
    strided.copy_(o1)
    out = torch.empty(queries, heads, head_dim, device=DEVICE, dtype=dtype)
    merge_states(strided, lse1, o2, lse2, out)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out[0, 0].float(), o2[0, 0].float(), atol=tol, rtol=tol)


def test_merge_kernel_refuses_mismatched_parts() -> None:
    o = torch.zeros(2, 3, 8, device=DEVICE)
    lse = torch.zeros(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="out"):
        merge_states(o, lse, o, lse, torch.zeros(2, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        merge_states(o, lse.double(), o, lse, torch.zeros(3, 2, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "num_queries", "seq_len", "whole", "key_rows"),
    [(16, 9, 13, 0, 16), (16, 24, 70, 32, 72), (32, 40, 110, 64, 112)],
)
@pytest.mark.usefixtures("small_buckets")
def test_gather_kernel_matches_the_reference(
    block_size: int, num_queries: int, seq_len: int, whole: int, key_rows: int, dtype: torch.dtype
) -> None:
    """Rows laid out for a bucketed chunk: 9 new tokens over 4 earlier ones (no whole key
    block, a square of 16 with 3 rows of padding), 24 over 46 and 40 over 70 (whole blocks,
    then the rest and the chunk in a padded square); contexts off a page boundary, their pages
    shuffled over a pool whose K and V pages interleave, more table entries than pages."""
    layout = ChunkLayout.of(num_queries, seq_len, buckets=True)
    assert (layout.whole, layout.key_rows) == (whole, key_rows)
    gen = torch.Generator().manual_seed(seq_len)
    num_blocks = -(-seq_len // block_size) + 3
    pool = torch.randn(num_blocks, 2, block_size, 2, 64, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache = pool[:, 0], pool[:, 1]  # [NB, BS, Hkv, D], strided
    block_table = torch.randperm(num_blocks, generator=gen).to(DEVICE, torch.int32)
    expected = torch.full((2, key_rows, 2, 64), float("nan"), device=DEVICE, dtype=dtype)
    got = expected.clone()
    gather_rows_ref(k_cache, v_cache, block_table, seq_len, *expected)
    gather_rows(k_cache, v_cache, block_table, seq_len, *got)
    assert torch.equal(got, expected)
    # the reference: token t from slot t % BS of page block_table[t // BS], zeros after
    tokens = torch.arange(seq_len, device=DEVICE)
    pages = block_table.long()[tokens // block_size]
    for rows, cache in zip(expected, (k_cache, v_cache), strict=True):
        assert torch.equal(rows[:seq_len], cache[pages, tokens % block_size])
        assert not rows[seq_len:].any()


def test_gather_kernel_refuses_rows_it_cannot_fill() -> None:
    pages = torch.zeros(4, 16, 2, 8, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(2, 40, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="seq_len 41"):
        gather_rows(pages, pages, table, 41, *rows)  # more than keys_out holds
    with pytest.raises(ValueError, match="seq_len 40"):
        gather_rows(pages, pages, table[:2], 40, *rows)  # more than its pages hold
    with pytest.raises(ValueError, match="must be the pool's"):
        gather_rows(pages, pages, table, 40, *rows.bfloat16())


def test_workspace_counts_the_gathered_rows() -> None:
    small = workspace_bytes(16, 8, 128, torch.bfloat16, 4096, 2048)
    large = workspace_bytes(16, 8, 128, torch.bfloat16, 32768, 2048)
    # each token of context adds its K and V rows as gathered (cuDNN takes GQA as it is)
    assert large - small == (32768 - 4096) * 2 * 8 * 128 * 2


@pytest.mark.usefixtures("small_buckets")
def test_workspace_holds_every_chunk_s_buffers() -> None:
    """Every chunk of up to 40 new tokens in a context of up to 200: its K/V rows laid out,
    its padded queries and the two parts with their log-sum-exps fit the workspace."""
    num_heads, num_kv_heads, head_dim, element = 4, 2, 32, 2
    bound = workspace_bytes(num_heads, num_kv_heads, head_dim, torch.bfloat16, 200, 40)
    for num_queries, seq_len in itertools.product(range(1, 41), range(1, 201)):
        if seq_len < num_queries:
            continue
        layout = ChunkLayout.of(num_queries, seq_len, buckets=True)
        query_rows = max(layout.square, layout.rest + layout.padded)
        rows = 2 * layout.key_rows * num_kv_heads + query_rows * num_heads
        parts = (layout.square + layout.padded) * num_heads * (head_dim * element + 4)
        assert rows * head_dim * element + parts <= bound


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8), (8, 8)])
def test_cudnn_chunks_match_the_reference(num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(
        [1, 1, 640, 256, 1024], [100, 7, 0, 1500, 3000], block_size=32, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=128, dtype=torch.bfloat16,
    )  # fmt: skip
    out = run(batch, fused_attend, merge_states)
    first_chunk_row = batch.query_start_loc[NUM_DECODES]
    torch.testing.assert_close(
        out[first_chunk_row:], batch.reference()[first_chunk_row:], atol=2.5e-2, rtol=2.5e-2
    )


def meta_of(query_lens: list[int], context: int = backend.SDPA_MIN_SEQ_LEN) -> AttentionMetadata:
    """Metadata with only what the path's choice reads: the lengths (decodes lead), each
    sequence's context ``context`` tokens beyond its new ones."""
    starts = [0, *itertools.accumulate(query_lens)]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    empty = torch.zeros(0, dtype=torch.int32)
    lens = [n + context for n in query_lens]
    return AttentionMetadata(
        slot_mapping=empty, block_tables=empty, seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens_cpu=lens,
        query_start_loc_cpu=starts, num_decodes=num_decodes, max_seq_len=max(lens),
        max_query_len=max(query_lens),
    )  # fmt: skip


def test_which_chunks_take_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "sdpa")
    triton_backend = backend.TritonAttentionBackend()
    pages = torch.zeros(1, 16, 2, 8)
    cache = backend.LayerCache(pages, pages)
    long = backend.SDPA_MIN_QUERY_LEN

    def chosen(
        query_lens: list[int], context: int = backend.SDPA_MIN_SEQ_LEN, **kwargs: Any
    ) -> list[int]:
        args = {"cache": cache, "sliding_window": None, **kwargs}
        return triton_backend._sdpa_chunks(meta_of(query_lens, context), **args)

    assert chosen([1, 1, long, 40, long + 1, 7]) == [2, 4]  # the long ones, beside the rest
    # ... over a long context: a chunk whose context is short stays on the Triton kernel
    assert chosen([1, long, long], context=0) == []
    short_context = backend.SDPA_MIN_SEQ_LEN - long - 1
    assert chosen([1, long, long + 1], context=short_context) == [2]
    assert chosen([1, 1, 40, long - 1]) == []
    assert chosen([1] + [long] * backend.SDPA_MAX_CHUNKS) == list(
        range(1, backend.SDPA_MAX_CHUNKS + 1)
    )
    assert chosen([long] * (backend.SDPA_MAX_CHUNKS + 1)) == []  # too many launches
    assert chosen([long], sliding_window=64) == []
    scales = torch.ones(1, 16, 2)
    assert chosen([long], cache=backend.LayerCache(pages, pages, scales, scales)) == []  # fp8
    assert triton_backend.prefill_attention == "sdpa"
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "triton")
    assert backend.TritonAttentionBackend()._prefill_sdpa is None
    assert backend.TritonAttentionBackend().prefill_attention == "triton"
    for choice, buckets in [("sdpa", True), ("sdpa-exact", False)]:
        monkeypatch.setenv(backend.PREFILL_ATTN_ENV, choice)
        path = backend.TritonAttentionBackend()._prefill_sdpa
        assert isinstance(path, functools.partial) and path.keywords["buckets"] is buckets


def test_auto_takes_the_cudnn_path_on_hopper_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default, ``auto``: cuDNN's path on Hopper, where it was measured; the Triton kernel
    on other GPUs and off CUDA; a choice set by hand holds on any card."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.delenv(backend.PREFILL_ATTN_ENV, raising=False)
    gpu = torch.device("cuda", 0)
    assert backend.prefill_attention_choice(gpu) == "sdpa"
    assert backend.prefill_attention_choice(torch.device("cpu")) == "triton"
    assert backend.prefill_attention_choice() == "triton"
    for other in ((8, 0), (10, 0)):
        capability[0] = other
        assert backend.prefill_attention_choice(gpu) == "triton"
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "sdpa-exact")
    assert backend.prefill_attention_choice(gpu) == "sdpa-exact"
    capability[0] = (9, 0)
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "triton")
    assert backend.prefill_attention_choice(gpu) == "triton"


def test_the_plan_reserves_the_path_s_workspace_only_where_a_chunk_can_take_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "sdpa")
    args = (16, 8, 128, torch.bfloat16)
    sdpa = backend.TritonAttentionBackend()
    long, chunk = backend.SDPA_MIN_SEQ_LEN, backend.SDPA_MIN_QUERY_LEN
    assert sdpa.prefill_workspace_bytes(*args, long, 4096) == workspace_bytes(*args, long, 4096)
    assert sdpa.prefill_workspace_bytes(*args, long - 1, 4096) == 0  # a short model
    assert sdpa.prefill_workspace_bytes(*args, long, chunk - 1) == 0  # short chunks
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "triton")
    assert backend.TritonAttentionBackend().prefill_workspace_bytes(*args, long, 4096) == 0
