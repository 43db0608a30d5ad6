"""The prefill kernel's tile shapes against ``paged_attention_ref``, and its config table.

Every case has sequences of several lengths, fresh and over a cached context, so that the
kernel's three runs of key tiles (window edge, unmasked bulk, diagonal) all occur. On the CPU
through Triton's interpreter (see test_triton_paged_attention.py), at small sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.attention import prefill_tuning
from kernels.attention.paged_attention import write_kv_ref
from kernels.attention.prefill_tuning import FALLBACK, HOPPER, PrefillConfig, default_config
from tests.test_triton_paged_attention import (
    FP8,
    POISON,
    assert_matches_reference,
    make_batch,
)

# A fresh prompt, a chunk over a context, a short chunk: keys past several whole tiles
QUERY_LENS = [37, 21, 6]
CONTEXT_LENS = [0, 45, 70]

CASES = [  # (block_size, num_heads, num_kv_heads, config, window, cache_dtype)
    # BLOCK_N a multiple of the page: one table entry per page, broadcast
    (16, 4, 4, PrefillConfig(16, 32, 4, 2), None, None),
    # BLOCK_N smaller than the page: one entry per tile
    (32, 8, 4, PrefillConfig(32, 16, 4, 2), None, None),
    # page size neither divides nor is divided by BLOCK_N: one entry per key
    (24, 8, 2, PrefillConfig(32, 16, 4, 2), None, None),
    # sliding windows: edge tiles before the bulk, GQA 4 and 2
    (16, 8, 2, PrefillConfig(16, 16, 4, 2), 19, None),
    (32, 4, 2, PrefillConfig(32, 64, 4, 2), 40, None),
    # fp8 pages, GQA 2, with a window
    (16, 4, 2, PrefillConfig(32, 32, 4, 2), 30, FP8),
    # TMA loads, a tile per page (the last page's rows past the end are garbage: zeroed),
    # then with the bulk loop warp-specialized, and with a window (warp specialization with 8
    # warps: Triton 3.6 fails to compile 4-warp ones of this loop on a GPU)
    (16, 8, 2, PrefillConfig(32, 16, 4, 2, tma=True), None, None),
    (16, 4, 2, PrefillConfig(64, 16, 8, 3, tma=True, warp_specialize=True), None, None),
    (32, 4, 4, PrefillConfig(32, 32, 4, 2, tma=True), 40, None),
    (16, 4, 2, PrefillConfig(32, 16, 4, 2, tma=True), 30, FP8),  # scales by page and row
    (16, 4, 2, PrefillConfig(32, 32, 8, 2, warp_specialize=True), None, None),
]


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "config", "window", "cache_dtype"), CASES
)
def test_prefill_configs_match_reference(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    config: PrefillConfig,
    window: int | None,
    cache_dtype: torch.dtype | None,
) -> None:
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=16, dtype=torch.bfloat16, cache_dtype=cache_dtype,
        seed=block_size + num_heads, write=write_kv_ref,
    )  # fmt: skip
    assert_matches_reference(batch, window, prefill_config=config)


def test_prefill_after_decodes_with_a_window_wider_than_the_context() -> None:
    # decodes first (first_seq > 0); one token block per sequence at BLOCK_M 64, GQA 1
    batch = make_batch(
        [1, 1, 9, 30], [5, 40, 60, 3], block_size=16, num_heads=2, num_kv_heads=2,
        head_dim=16, dtype=torch.float32, seed=3, write=write_kv_ref,
    )  # fmt: skip
    assert_matches_reference(batch, 500, prefill_config=PrefillConfig(64, 16, 4, 2))


# -- the config table --------------------------------------------------------------------------


def test_config_keys_round_trip_and_bad_configs_are_refused() -> None:
    assert PrefillConfig.from_key("m128n128w8s3") == HOPPER
    assert PrefillConfig.from_key(FALLBACK.key) == FALLBACK
    for bad in (dict(block_m=48), dict(block_n=8), dict(num_warps=3), dict(num_stages=0)):
        fields = dict(block_m=64, block_n=64, num_warps=4, num_stages=2) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrefillConfig(**fields)
    with pytest.raises(ValueError, match="not a prefill config key"):
        PrefillConfig.from_key("m128n64w8")
    hopper_options = PrefillConfig(128, 32, 8, 3, tma=True, warp_specialize=True)
    assert hopper_options.key == "m128n32w8s3-tma-ws"
    assert PrefillConfig.from_key(hopper_options.key) == hopper_options
    assert PrefillConfig.from_key("m64n64w4s2-ws") == PrefillConfig(64, 64, 4, 2, False, True)
    with pytest.raises(ValueError, match="not a prefill config key"):
        PrefillConfig.from_key("m128n64w8s3-ws-tma")  # one order only


def test_tma_tiles_ignore_nan_in_the_rows_past_a_sequence() -> None:
    # A TMA tile is a whole page; the rows past the sequence's end may hold anything. With
    # them NaN, the output still equals the reference (taken while they were finite).
    batch = make_batch(
        [13, 5], [0, 20], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16,
        dtype=torch.bfloat16, seed=2, write=write_kv_ref,
    )  # fmt: skip
    expected = batch.reference()
    for cache in (batch.k_cache, batch.v_cache):
        cache[cache == POISON] = float("nan")
    out = batch.run(prefill_config=PrefillConfig(32, 16, 4, 2, tma=True))
    torch.testing.assert_close(out, expected, atol=2.5e-2, rtol=2.5e-2)


def test_a_tma_config_needs_a_tile_of_one_page() -> None:
    batch = make_batch(
        [9], [20], block_size=16, num_heads=2, num_kv_heads=2, head_dim=16,
        dtype=torch.bfloat16, seed=1, write=write_kv_ref,
    )  # fmt: skip
    with pytest.raises(ValueError, match="block_n must be the page size, 16"):
        assert_matches_reference(batch, None, prefill_config=PrefillConfig(32, 32, 4, 2, True))


def test_defaults_by_capability_head_dim_and_dtype() -> None:
    assert default_config(128, torch.bfloat16, (9, 0)) == HOPPER
    assert default_config(64, torch.float16, (9, 0)) == HOPPER
    assert default_config(256, torch.bfloat16, (9, 0)) == FALLBACK  # the tiles would not fit
    assert default_config(128, torch.float32, (9, 0)) == FALLBACK
    assert default_config(128, torch.bfloat16, (8, 0)) == FALLBACK
    q, pool = torch.zeros(4, 16, 128), torch.zeros(3, 32, 8, 128)
    assert prefill_tuning.config_for(q, pool) == FALLBACK  # the interpreter


def test_measured_table_wins_over_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prefill_configs.json"
    monkeypatch.setattr(prefill_tuning, "TUNED_PATH", path)
    # a GPU, as far as the lookup can tell: its name and capability
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    prefill_tuning.install("GPU X", {})  # clears the caches, writes an empty entry
    gpu = torch.device("cuda", 0)
    args = (gpu, 128, 2, torch.bfloat16, torch.bfloat16)
    key = prefill_tuning.table_key(128, 2, torch.bfloat16, torch.bfloat16, 32)
    assert key == "d=128,group=2,q=bfloat16,kv=bfloat16,page=32"
    assert prefill_tuning._cached_config_for(*args, 32) == HOPPER  # nothing measured yet
    tuned = PrefillConfig(128, 128, 8, 2)
    prefill_tuning.install("GPU X", {key: tuned})
    prefill_tuning.install("GPU Y", {key: FALLBACK})  # another card's rows stay its own
    assert json.loads(path.read_text())["GPU X"] == {key: "m128n128w8s2"}
    assert prefill_tuning._cached_config_for(*args, 32) == tuned
    assert prefill_tuning._cached_config_for(*args, 16) == HOPPER  # another page size
    prefill_tuning._cached_config_for.cache_clear()  # the real table for later tests
    prefill_tuning._table.cache_clear()
