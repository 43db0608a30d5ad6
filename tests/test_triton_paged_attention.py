"""The Triton paged attention against ``paged_attention_ref``: decode, mixed batches, fp8.

CPU runs go through Triton's interpreter at small sizes (see test_triton_kernels.py for how
TRITON_INTERPRET is set); ``gpu``-marked tests run real sizes and a CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kernels.attention.paged_attention import paged_attention_ref
from tests.test_triton_kernels import CUDA, DEVICE, KERNELS

paged_attention = KERNELS["paged_attention_triton"].paged_attention
PREFIX_BLOCK_M = KERNELS["cascade_triton"].PREFIX_BLOCK_M
prefix_tiles = KERNELS["cascade_triton"].prefix_tiles
write_kv = KERNELS["kv_write_triton"].write_kv
FP8 = torch.float8_e4m3fn
POISON = 300.0  # finite in fp8 e4m3 too
# Output tolerance per q dtype: bf16/fp16 outputs are rounded once by both sides, and the
# reference rounds its probabilities to the dtype; the interpreter also truncates bf16 casts.
TOLERANCE = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3, torch.float32: 2e-5}


@dataclass
class Batch:
    """A mixed batch over a layer's slice of a [L=2, 2, NB, BS, Hkv, D] pool."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [NB, BS, Hkv] with an fp8 pool
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]
    query_start_loc: list[int]

    def run(self, window: int | None = None, **kwargs: object) -> torch.Tensor:
        num_decodes = 0
        while num_decodes < len(self.seq_lens) and self.query_len(num_decodes) == 1:
            num_decodes += 1
        call: dict[str, object] = dict(
            scale=self.q.shape[-1] ** -0.5,
            max_query_len=max(map(self.query_len, range(len(self.seq_lens)))),
            num_decodes=num_decodes, sliding_window=window,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        return paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            torch.tensor(self.query_start_loc, dtype=torch.int32, device=DEVICE),
            **{**call, **kwargs},
        )  # type: ignore[arg-type]

    def reference(self, window: int | None = None) -> torch.Tensor:
        return paged_attention_ref(
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.q.shape[-1] ** -0.5, window,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def query_len(self, b: int) -> int:
        return self.query_start_loc[b + 1] - self.query_start_loc[b]


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    write: Callable[..., None] = write_kv,
) -> Batch:
    """Random K/V written into pages scattered over the pool, through the Triton write_kv
    (``write``: e.g. the reference, for tests of attention alone)."""
    torch.manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    pages_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 3
    cache_dtype = cache_dtype or dtype
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    # Rows no sequence owns hold a large finite poison (the reference multiplies masked
    # values by zero, which NaN would survive): a kernel that reads them is far off.
    pool = torch.full(shape, POISON, device=DEVICE).to(cache_dtype)
    scales = torch.ones(shape[:-1], device=DEVICE)  # poison x poison overwhelms the GPU SDPA
    fp8 = cache_dtype == FP8
    k_scale, v_scale = (scales[1, 0], scales[1, 1]) if fp8 else (None, None)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    for pages, seq_len in zip(tables, seq_lens, strict=True):
        k, v = torch.randn(2, seq_len, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        slots = [pages[t // block_size] * block_size + t % block_size for t in range(seq_len)]
        slot_mapping = torch.tensor(slots, device=DEVICE)
        write(k, v, pool[1, 0], pool[1, 1], slot_mapping, k_scale=k_scale, v_scale=v_scale)
    width = max(pages_per_seq)
    block_tables = torch.tensor(
        [t + [num_blocks - 1] * (width - len(t)) for t in tables],
        dtype=torch.int32,
        device=DEVICE,
    )
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, device=DEVICE, dtype=dtype)
    return Batch(q, pool[1, 0], pool[1, 1], k_scale, v_scale, block_tables, seq_lens, starts)


def assert_matches_reference(batch: Batch, window: int | None = None, **kwargs: object) -> None:
    out = batch.run(window, **kwargs)
    expected = batch.reference(window)
    tol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


# Decodes first (one token each), then prefill chunks over a cached context, then a fresh prompt.
MIXED_QUERY_LENS = [1, 1, 1, 7, 19, 3, 12]
MIXED_CONTEXT_LENS = [9, 1, 70, 20, 45, 0, 0]

CONFIGS = [  # (block_size, num_heads, num_kv_heads, dtype)
    (16, 4, 4, torch.float32),
    (32, 8, 4, torch.bfloat16),
    (64, 8, 2, torch.float16),
    (16, 6, 3, torch.bfloat16),
    (32, 4, 1, torch.float32),
]


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "dtype"), CONFIGS)
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, window: int | None
) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=dtype, seed=block_size + num_heads,
    )  # fmt: skip
    assert_matches_reference(batch, window)


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [None, 40])
def test_decode_split_kv_matches_reference(num_kv_splits: int, window: int | None) -> None:
    # Splits with no tiles (8 splits over 3 tiles) must drop out of the reduction.
    batch = make_batch(
        [1, 1, 1], [150, 3, 64], block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.float32, seed=num_kv_splits,
    )  # fmt: skip
    assert_matches_reference(batch, window, num_kv_splits=num_kv_splits)


def test_decode_only_batch_needs_no_num_decodes() -> None:
    batch = make_batch([1, 1], [40, 100], block_size=32, num_heads=4, num_kv_heads=2)
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(batch.query_start_loc, dtype=torch.int32, device=DEVICE),
        scale=32**-0.5, max_query_len=1,  # num_decodes left at 0
    )  # fmt: skip
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out, batch.reference(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_fp8_cache_matches_reference(dtype: torch.dtype, num_kv_splits: int) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size=16, num_heads=8, num_kv_heads=2,
        dtype=dtype, cache_dtype=FP8, seed=7,
    )  # fmt: skip
    assert_matches_reference(batch, 10, num_kv_splits=num_kv_splits)
    # fp8 is a real approximation: the output differs from the unquantized one
    exact = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size=16, num_heads=8, num_kv_heads=2,
        dtype=dtype, seed=7,
    )  # fmt: skip
    error = (batch.run(10) - exact.run(10)).float().norm() / exact.run(10).float().norm()
    assert 1e-3 < error < 0.1


def test_writes_into_out_and_every_row() -> None:
    batch = make_batch([1, 5], [30, 10], block_size=16, num_heads=4, num_kv_heads=2)
    out = torch.full_like(batch.q, float("nan"))
    assert batch.run(out=out) is out
    assert not out.isnan().any()


def test_a_range_of_the_batch_writes_only_its_rows() -> None:
    """``first_seq``/``end_seq`` attend part of a step over its whole tensors (how the cuDNN
    path runs the chunks between its long ones): the range's rows equal the reference, the
    others stay as they were."""
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    expected = batch.reference()
    starts = batch.query_start_loc
    for first, end in [(0, 2), (0, 5), (3, 4), (4, 7), (6, 7)]:
        out = torch.full_like(batch.q, float("nan"))
        longest = max(starts[s + 1] - starts[s] for s in range(first, end))
        batch.run(out=out, first_seq=first, end_seq=end, max_query_len=longest)
        rows = slice(starts[first], starts[end])
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out[rows], expected[rows], atol=tol, rtol=tol)
        assert out[: starts[first]].isnan().all() and out[starts[end] :].isnan().all()


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def cascade(
    batch: Batch, shares: list[int], row: int = 0, num_tiles: int | None = None
) -> dict[str, torch.Tensor]:
    """``paged_attention``'s cascade arguments for one group of every decode: each decode's
    share of the prefix (tokens), the prefix's pages (``row``'s block table) and the row tiles
    (``num_tiles`` of them, if given: a graph's, with tiles to spare)."""
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    rows, tile_groups = prefix_tiles([list(range(len(shares)))], group, num_tiles)
    return dict(
        prefix_lens=int32(shares),
        prefix_pages=batch.block_tables[row : row + 1].contiguous(),
        prefix_rows=int32(rows),
        prefix_tile_groups=int32(tile_groups),
    )


def shared_prefix_batch(
    num_decodes: int,
    prefix_pages: int,
    suffix_lens: list[int],
    prefill: tuple[list[int], list[int]] = ([], []),
    **kwargs: object,
) -> Batch:
    """``num_decodes`` decodes whose block tables begin with the same ``prefix_pages`` pages
    (the first one's), then ``suffix_lens[i]`` tokens of their own (the new one included),
    then the prefill chunks ``prefill`` (query lens, context lens)."""
    block_size = int(kwargs["block_size"])  # type: ignore[call-overload]
    prefix = prefix_pages * block_size
    query_lens = [1] * num_decodes + prefill[0]
    contexts = [prefix + n - 1 for n in suffix_lens] + prefill[1]
    batch = make_batch(query_lens, contexts, **kwargs)  # type: ignore[arg-type]
    batch.block_tables[1:num_decodes, :prefix_pages] = batch.block_tables[0, :prefix_pages]
    return batch


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype", "num_kv_splits"),
    [(16, 8, 2, torch.float32, 3), (32, 4, 1, torch.float32, 1), (16, 6, 3, torch.bfloat16, 2)],
)
def test_cascade_decode_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, num_kv_splits: int
) -> None:
    """Decodes over a shared prefix attend it together, the prefill chunks after them as
    before; suffixes of one token (the query's own) up to several pages."""
    suffixes = [1, 2 * block_size + 5, 7, block_size, 3]
    batch = shared_prefix_batch(
        5, 3, suffixes, ([5, 9], [40, 0]), block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=dtype, seed=num_kv_splits,
    )  # fmt: skip
    shares = [3 * block_size] * 5
    assert_matches_reference(batch, num_kv_splits=num_kv_splits, **cascade(batch, shares))


def test_each_decode_attends_its_own_share_of_the_prefix() -> None:
    """Shares of 0 (another prompt, or one that parted after the first page and is left
    out), of part of the prefix, and of all of it, in one step; the prefix's pages are a
    later decode's."""
    batch = make_batch(
        [1] * 6, [49, 56, 48, 67, 52, 77], block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.float32, seed=6,
    )  # fmt: skip
    tables = batch.block_tables
    tables[[1, 3, 4], :3] = tables[5, :3]  # three pages alike; decode 0 keeps its own
    tables[2, :1] = tables[5, :1]  # decode 2: the first one only
    shares = [0, 48, 16, 32, 48, 48]  # decode 3 gives two of its three
    assert_matches_reference(batch, num_kv_splits=2, **cascade(batch, shares, row=4))


def test_cascade_decode_over_several_row_tiles() -> None:
    """More (sequence, query head) rows than one prefix program holds (PREFIX_BLOCK_M)."""
    num_decodes = PREFIX_BLOCK_M // 4 + 3
    batch = shared_prefix_batch(
        num_decodes, 2, [1 + (5 * i) % 20 for i in range(num_decodes)], block_size=16,
        num_heads=8, num_kv_heads=2, dtype=torch.float32, seed=4,
    )  # fmt: skip
    assert_matches_reference(batch, num_kv_splits=1, **cascade(batch, [32] * num_decodes))


def test_cascade_decode_of_an_fp8_pool_matches_reference() -> None:
    batch = shared_prefix_batch(
        6, 2, [1, 4, 17, 30, 2, 9], block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.bfloat16, cache_dtype=FP8, seed=5,
    )  # fmt: skip
    assert_matches_reference(batch, num_kv_splits=2, **cascade(batch, [32] * 6))


def test_cascade_decode_reads_the_prefix_from_the_pages_it_is_given() -> None:
    """The shares are taken at their word: over tables that do not hold those pages, the
    others' prefix is read from the first one's pages (so the cascade path is what ran)."""
    batch = make_batch(
        [1, 1, 1], [40, 50, 60], block_size=16, num_heads=4, num_kv_heads=2,
        dtype=torch.float32, seed=2,
    )  # fmt: skip
    out = batch.run(**cascade(batch, [32, 32, 32]))
    expected = batch.reference()
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out[:1], expected[:1], atol=tol, rtol=tol)
    assert not torch.allclose(out[1:], expected[1:], atol=0.1)
    none = batch.run(**cascade(batch, [0, 0, 0]))  # what a captured graph's warm-up hands it
    torch.testing.assert_close(none, expected, atol=tol, rtol=tol)
    batch.block_tables[1:, :2] = batch.block_tables[0, :2]  # now they do share them
    shared = batch.run(**cascade(batch, [32, 32, 32]))
    torch.testing.assert_close(shared, batch.reference(), atol=tol, rtol=tol)


def test_several_prefixes_cascade_in_one_call() -> None:
    """Three groups of decodes, each over its own prefix (one of them over two row tiles,
    one with shares of part of it), decodes of no group between them, then a prefill chunk;
    three query heads a kv head (a row tile of 21 decodes, 63 of its 64 rows), and the tiles
    padded with empty ones as a captured graph's are."""
    group_size, block_size = 3, 16
    per_tile = PREFIX_BLOCK_M // group_size
    members = [
        [i for i in range(40) if i % 3 != 1][: per_tile + 2],  # two tiles
        [1, 4, 7, 10],
        [13, 16],
    ]
    prefix_pages = [3, 2, 4]
    contexts = [4 * block_size + 5 + (7 * i) % 23 for i in range(40)]
    batch = make_batch(
        [1] * 40 + [6], [*contexts, 40], block_size=block_size, num_heads=2 * group_size,
        num_kv_heads=2, dtype=torch.float32, seed=9,
    )  # fmt: skip
    tables = batch.block_tables
    shares = [0] * 40
    for rows, pages in zip(members, prefix_pages, strict=True):
        tables[rows, :pages] = tables[rows[0], :pages]
        for row in rows:
            shares[row] = pages * block_size
    shares[16] = block_size  # the last group's second decode shares the first page only
    tile_rows, tile_groups = prefix_tiles(members, group_size, num_tiles=6)
    assert tile_groups == [0, 0, 1, 2, -1, -1] and len(tile_rows) == 6 * per_tile
    cascade_args = dict(
        prefix_lens=int32(shares),
        prefix_pages=tables[[rows[0] for rows in members]].contiguous(),
        prefix_rows=int32(tile_rows),
        prefix_tile_groups=int32(tile_groups),
    )
    assert_matches_reference(batch, num_kv_splits=2, **cascade_args)
    # the pages are each tile's group's: hand group 1 group 2's and its decodes go wrong
    swapped = cascade_args["prefix_pages"][[0, 2, 2]].contiguous()
    out = batch.run(num_kv_splits=2, **(cascade_args | dict(prefix_pages=swapped)))
    expected = batch.reference()
    tol = TOLERANCE[torch.float32]
    others = [row for row in range(out.shape[0]) if row not in members[1]]
    torch.testing.assert_close(out[others], expected[others], atol=tol, rtol=tol)
    assert not torch.allclose(out[members[1]], expected[members[1]], atol=0.1)


def test_a_graph_s_spare_prefix_tiles_do_not_cut_the_splits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A captured graph's layout holds tiles for more groups than a step has; the prefix is
    split as for the busy tiles alone (a regression halved the splits, and the speed, of a
    one-group step replayed in a graph)."""
    module = KERNELS["cascade_triton"]
    real = module._prefix_kernel
    grids: list[tuple[int, int, int]] = []

    class Recording:
        def __getitem__(self, grid: tuple[int, int, int]) -> Callable[..., None]:
            grids.append(grid)
            return real[grid]  # type: ignore[no-any-return]

    monkeypatch.setattr(module, "_prefix_kernel", Recording())
    batch = shared_prefix_batch(
        8, 2, [1 + 3 * i for i in range(8)], block_size=16, num_heads=4, num_kv_heads=1,
        dtype=torch.float32, seed=11,
    )  # fmt: skip
    assert_matches_reference(batch, num_kv_splits=1, **cascade(batch, [32] * 8, num_tiles=4))
    assert_matches_reference(batch, num_kv_splits=1, **cascade(batch, [32] * 8))
    assert grids[0][0] == 4 and grids[1][0] == 1  # the grid holds the spare tiles
    assert grids[0][2] == grids[1][2] > 1


@pytest.mark.parametrize(
    ("num_kv_splits", "with_prefix"), [(1, False), (4, False), (1, True), (2, True)]
)
def test_decode_scratch_bytes_counts_what_the_decode_allocates(
    monkeypatch: pytest.MonkeyPatch, num_kv_splits: int, with_prefix: bool
) -> None:
    """The memory plan reserves ``decode_scratch_bytes`` for a graph's attention partials:
    it must be what a launch at the default split count allocates, the cascade's included."""
    module = KERNELS["paged_attention_triton"]
    real = module._allocate_partials
    allocated: list[int] = []

    def recording(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        parts = real(*args)
        allocated.append(sum(part.numel() * part.element_size() for part in parts))
        return parts  # type: ignore[no-any-return]

    monkeypatch.setattr(module, "_allocate_partials", recording)
    monkeypatch.setattr(module, "default_num_kv_splits", lambda *args: num_kv_splits)
    batch = shared_prefix_batch(
        8, 2, [1 + 3 * i for i in range(8)], block_size=16, num_heads=4, num_kv_heads=1,
        head_dim=24, dtype=torch.float32, seed=12,
    )  # fmt: skip
    args = cascade(batch, [32] * 8, num_tiles=4) if with_prefix else {}
    max_seq_len = max(batch.seq_lens)
    assert_matches_reference(batch, max_seq_len=max_seq_len, **args)
    expected = module.decode_scratch_bytes(8, 4, 1, 24, batch.q.device, max_seq_len, with_prefix)
    assert sum(allocated) == expected
    assert (expected > 0) == (num_kv_splits > 1 or with_prefix)


def test_prefix_tiles_lay_each_group_out_in_whole_tiles() -> None:
    rows, groups = prefix_tiles([[5, 1], [0, 2, 3]], 32)  # two decodes a tile
    assert (rows, groups) == ([5, 1, 0, 2, 3, -1], [0, 1, 1])
    rows, groups = prefix_tiles([], 4, num_tiles=2)
    assert rows == [-1] * 32 and groups == [-1, -1]
    with pytest.raises(ValueError, match="3 prefix tiles do not fit in 2"):
        prefix_tiles([[5, 1], [0, 2, 3]], 32, num_tiles=2)


def test_launcher_rejects_bad_arguments() -> None:
    batch = make_batch([1, 3], [10, 5], block_size=16, num_heads=4, num_kv_heads=2)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=DEVICE)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables)
    lens, pages, rows, tile_groups = cascade(batch, [16, 0]).values()
    whole = dict(
        prefix_lens=lens, prefix_pages=pages, prefix_rows=rows, prefix_tile_groups=tile_groups
    )
    cases = [
        ("seq_lens", dict(seq_lens=seq_lens.long())),
        ("query_start_loc", dict(query_start_loc=starts[:-1])),
        ("Hq must be a multiple", dict(q=batch.q[:, :3])),
        ("pool's dtype", dict(q=batch.q.half())),
        ("num_decodes", dict(num_decodes=5)),
        ("num_kv_splits", dict(num_kv_splits=0)),
        ("first_seq < end_seq", dict(first_seq=1, end_seq=1)),
        ("end_seq <= B", dict(end_seq=3)),
        ("after the 2 leading decodes", dict(num_decodes=2, first_seq=1)),
        ("go together", dict(prefix_lens=lens)),
        ("go together", dict(prefix_lens=lens, prefix_pages=pages)),
        ("go together", dict(prefix_rows=rows, prefix_tile_groups=tile_groups)),
        ("prefix_lens must be 1-d int32", whole | dict(prefix_lens=lens.long())),
        ("prefix_pages must be 2-d int32", whole | dict(prefix_pages=pages.long())),
        ("prefix_pages must be 2-d", whole | dict(prefix_pages=pages[0])),
        ("prefix_tile_groups must be 1-d", whole | dict(prefix_tile_groups=tile_groups[None])),
        (
            "must hold 32 slots for each of the 2 tiles at 2 query heads",
            whole | dict(prefix_rows=lens, prefix_tile_groups=lens),
        ),
        ("sliding window", whole | dict(sliding_window=4)),
        ("out", dict(out=batch.q.float())),
    ]
    for message, change in cases:
        call: dict[str, object] = dict(
            q=args[0], k_cache=args[1], v_cache=args[2], block_tables=args[3],
            seq_lens=seq_lens, query_start_loc=starts, scale=1.0, max_query_len=3,
        )  # fmt: skip
        call.update(change)
        with pytest.raises(ValueError, match=message):
            paged_attention(**call)  # type: ignore[arg-type]


# -- GPU: real sizes --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, FP8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gpu_real_sizes_match_reference(block_size: int, cache_dtype: torch.dtype | None) -> None:
    assert CUDA
    query_lens = [1] * 24 + [300, 37, 1000]
    context_lens = [torch.randint(1, 3000, ()).item() for _ in range(24)] + [1500, 4000, 0]
    batch = make_batch(
        query_lens, context_lens, block_size=block_size, num_heads=32, num_kv_heads=8,
        head_dim=128, dtype=torch.bfloat16, cache_dtype=cache_dtype,
    )  # fmt: skip
    for window in (None, 1024):
        out, expected = batch.run(window).float(), batch.reference(window).float()
        assert ((out - expected).norm() / expected.norm()).item() < 1e-2
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_decode_is_cuda_graph_capturable() -> None:
    assert CUDA
    batch = make_batch([1] * 8, [2000] * 8, block_size=32, num_heads=32, num_kv_heads=8,
                       head_dim=128)  # fmt: skip
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(batch.q)

    def step() -> None:
        paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, starts,
            scale=128**-0.5, max_query_len=1, num_kv_splits=4, out=out,
        )  # fmt: skip

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seq_lens.sub_(500)  # shorter contexts, same graph: lengths are read on the device
    batch.seq_lens = [n - 500 for n in batch.seq_lens]
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, batch.reference(), atol=3e-2, rtol=3e-2)


def test_short_contexts_decode_unsplit_and_graphs_capture_both_variants() -> None:
    from kernels.attention.paged_attention_triton import (
        UNSPLIT_MAX_CONTEXT,
        decode_graph_contexts,
        default_num_kv_splits,
    )

    cpu = torch.device("cpu")  # NOMINAL_CPU_SMS stand in for the SMs
    split = default_num_kv_splits(1, 2, cpu)
    assert split > 1
    assert default_num_kv_splits(1, 2, cpu, UNSPLIT_MAX_CONTEXT) == 1
    assert default_num_kv_splits(1, 2, cpu, UNSPLIT_MAX_CONTEXT + 1) == split
    assert decode_graph_contexts(1, 2, cpu, 4096) == [UNSPLIT_MAX_CONTEXT, 4096]
    assert decode_graph_contexts(1, 2, cpu, UNSPLIT_MAX_CONTEXT) == [UNSPLIT_MAX_CONTEXT]
    assert decode_graph_contexts(64, 8, cpu, 4096) == [4096]  # enough programs unsplit


@pytest.fixture
def split_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The decode split settings read afresh from the environment this test sets (they are
    read once per process), and forgotten after it."""
    module = KERNELS["paged_attention_triton"]
    readers = (module.target_programs_per_sm, module.balanced_splits)

    def forget() -> None:
        for reader in readers:
            reader.cache_clear()

    forget()
    yield monkeypatch
    monkeypatch.undo()
    forget()


def test_the_programs_per_sm_that_split_decodes_come_from_the_environment(
    split_settings: pytest.MonkeyPatch,
) -> None:
    monkeypatch = split_settings
    from kernels.attention import paged_attention_triton as module
    from kernels.attention.paged_attention_common import num_sms

    cpu = torch.device("cpu")
    sms = num_sms(cpu)
    # the default: two programs per SM; a launch of that many programs or more is unsplit
    assert module.default_num_kv_splits(2 * sms, 1, cpu) == 1
    assert module.default_num_kv_splits(sms, 1, cpu) == 2
    monkeypatch.setenv(module.PROGRAMS_PER_SM_ENV, "16")
    module.target_programs_per_sm.cache_clear()
    assert module.target_programs_per_sm() == 16
    assert module.default_num_kv_splits(2 * sms, 1, cpu) == 8  # 16 SMs' worth of programs
    assert module.default_num_kv_splits(16 * sms, 1, cpu) == 1
    assert module.default_num_kv_splits(1, 1, cpu) == module.MAX_KV_SPLITS  # capped
    assert module.default_num_kv_splits(1, 1, cpu, module.UNSPLIT_MAX_CONTEXT) == 1
    for bad in ("0", "2.5", "many", str(module.MAX_PROGRAMS_PER_SM + 1)):
        monkeypatch.setenv(module.PROGRAMS_PER_SM_ENV, bad)
        module.target_programs_per_sm.cache_clear()
        with pytest.raises(ValueError, match=module.PROGRAMS_PER_SM_ENV):
            module.default_num_kv_splits(1, 1, cpu)


@pytest.mark.parametrize(("num_kv_splits", "window"), [(2, None), (3, 40), (8, None)])
def test_balanced_splits_match_reference_over_uneven_contexts(
    split_settings: pytest.MonkeyPatch, num_kv_splits: int, window: int | None
) -> None:
    """``PAGESTREAM_DECODE_SPLITS=balanced`` cuts every decode's context in runs of the batch's
    longest over the split count (tiles of 128 tokens here): a 3-token context fills one
    split, a 700-token one all of them, and the splits left empty drop out of the reduction;
    a prefill follows the decodes."""
    module = KERNELS["paged_attention_triton"]
    split_settings.setenv(module.SPLITS_ENV, "balanced")
    assert module.balanced_splits()
    batch = make_batch(
        [1, 1, 1, 1, 9], [700, 3, 260, 1, 300], block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.float32, seed=num_kv_splits,
    )  # fmt: skip
    assert_matches_reference(batch, window, num_kv_splits=num_kv_splits, num_decodes=4)


def test_balanced_splits_of_a_cascade_decode_match_reference(
    split_settings: pytest.MonkeyPatch,
) -> None:
    split_settings.setenv(KERNELS["paged_attention_triton"].SPLITS_ENV, "balanced")
    suffixes = [1, 2 * 16 + 5, 7, 16, 3]
    batch = shared_prefix_batch(
        5, 3, suffixes, ([5, 9], [40, 0]), block_size=16, num_heads=8, num_kv_heads=2,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    assert_matches_reference(batch, num_kv_splits=3, **cascade(batch, [3 * 16] * 5))


def test_an_unknown_split_mode_is_refused(split_settings: pytest.MonkeyPatch) -> None:
    module = KERNELS["paged_attention_triton"]
    split_settings.setenv(module.SPLITS_ENV, "fair")
    with pytest.raises(ValueError, match="even, balanced"):
        module.balanced_splits()
