"""The fp8 KV cache's quality report on a tiny model: fp8 stays close, and the measures can
tell a broken cache from a good one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kv_quality import greedy_agreement, measure_kv_quality


def test_fp8_cache_stays_close_to_full_precision(tiny_model_dirs: dict[str, Path]) -> None:
    record = measure_kv_quality(
        str(tiny_model_dirs["llama"]), num_prompts=4, input_len=24, output_len=12,
        device="cpu", pa_block_size=16,
    )  # fmt: skip
    results = record["results"]
    assert results["num_positions"] == 4 * 12
    # A tiny random model has near-ties, so some top-1 flips; a broken cache (wrong scale,
    # wrong page) would agree on about 1 in 320 tokens and err by the logits' whole spread.
    assert results["teacher_forced_top1_agreement"] >= 0.8
    assert 0 < results["logit_relative_error"] < 0.05
    assert 0 < results["kl_divergence_mean"] < 0.01
    assert record["settings"]["cache_type"] == "fp8_e4m3"


def testgreedy_agreement_counts_the_common_prefix() -> None:
    shares = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 0, 4], [5, 6, 7, 8]])
    assert shares["greedy_identical_share"] == 0.5
    assert shares["greedy_mean_prefix_share"] == pytest.approx((0.5 + 1.0) / 2)


def test_the_same_cache_type_measures_exactly_zero(tiny_model_dirs: dict[str, Path]) -> None:
    record = measure_kv_quality(
        str(tiny_model_dirs["llama"]), cache_type="auto", num_prompts=2, input_len=16,
        output_len=8, device="cpu",
    )  # fmt: skip
    results = record["results"]
    assert results["logit_max_abs_error"] == 0.0
    assert results["greedy_identical_share"] == 1.0
