"""Sizing the KV pool: budget flags, the profiled fraction of a GPU, and errors at start."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.attention.backend import TorchAttentionBackend, TritonAttentionBackend
from engine.config import EngineConfig
from engine.cuda_graphs import decode_graph_scratch_bytes
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec
from engine.loader.dummy import dummy_hf_config
from engine.memory import GIB, MIB, MemoryProfile, log_plan, plan_pool
from engine.models.arch import ModelArch
from kernels.attention.paged_attention_triton import UNSPLIT_MAX_CONTEXT, decode_scratch_bytes

# 2 layers x 2 (k/v) x 4 heads x 64 dims x 2 bytes = 2 KiB per token, 32 KiB per 16-token page
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
CUDA = torch.device("cuda")  # only its type is read when a profile is given


def profile(total_gib: float, used_gib: float, peak_gib: float) -> MemoryProfile:
    return MemoryProfile(
        total_bytes=int(total_gib * GIB),
        used_bytes=int(used_gib * GIB),
        weights_bytes=int(used_gib * GIB) // 2,
        activation_peak_bytes=int(peak_gib * GIB),
    )


def test_fraction_counts_weights_and_activation_peak() -> None:
    config = EngineConfig(max_seqs=100_000, max_batched_tokens=100_000)
    plan = plan_pool(config, SPEC, CUDA, 4096, profile(80, 17, 3))
    expected_bytes = int(80 * GIB * 0.9) - 17 * GIB - 3 * GIB
    assert plan.num_blocks == expected_bytes // SPEC.bytes_per_block
    assert plan.source == "--pa-memory-fraction 0.9"


def test_explicit_fraction() -> None:
    config = EngineConfig(pa_memory_fraction=0.5, max_seqs=100_000, max_batched_tokens=100_000)
    plan = plan_pool(config, SPEC, CUDA, 4096, profile(80, 17, 3))
    assert plan.num_blocks == (40 * GIB - 20 * GIB) // SPEC.bytes_per_block


def test_context_len_budget_rounds_up_to_whole_pages() -> None:
    plan = plan_pool(EngineConfig(pa_context_len=1000), SPEC, CUDA, 512, profile(80, 17, 3))
    assert plan.num_blocks == 63  # ceil(1000 / 16)


def test_budget_below_one_sequence_is_an_error_at_start() -> None:
    config = EngineConfig(pa_memory_mb=1)  # 32 pages of 16 tokens
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of 4096 tokens"):
        plan_pool(config, SPEC, CUDA, 4096, profile(80, 17, 3))


def test_fraction_with_nothing_left_is_an_error_at_start() -> None:
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        plan_pool(EngineConfig(), SPEC, CUDA, 4096, profile(80, 70, 3))


def test_memory_mb_larger_than_the_device_has_left_is_an_error() -> None:
    config = EngineConfig(pa_memory_mb=70 * 1024, max_seqs=100_000, max_batched_tokens=100_000)
    with pytest.raises(ConfigError, match=r"does not fit: the GPU has 60\.00 GiB left"):
        plan_pool(config, SPEC, CUDA, 4096, profile(80, 17, 3))


def test_pool_never_exceeds_what_max_seqs_can_use() -> None:
    config = EngineConfig(pa_memory_mb=1024, max_seqs=4)
    plan = plan_pool(config, SPEC, torch.device("cpu"), 256)
    assert plan.num_blocks == 4 * 16


def test_log_line_says_what_fits(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(max_seqs=100_000, max_batched_tokens=100_000)
    measured = profile(80, 17, 3)
    plan = plan_pool(config, SPEC, CUDA, 4096, measured)
    with caplog.at_level(logging.INFO, logger="engine.memory"):
        log_plan(plan, SPEC, measured, 4096)
    line = caplog.records[-1].getMessage()
    tokens = plan.num_blocks * 16
    assert f"= {tokens} tokens" in line
    assert f"{tokens // 4096} sequences of 4096 tokens fit" in line
    assert "activation peak 3.00 GiB" in line
    assert plan.budget_bytes <= 52 * GIB and plan.budget_bytes > 51 * GIB - MIB


def test_graph_reserve_holds_the_decode_graphs_attention_partials() -> None:
    """The memory profile's decode has one-token contexts, which never split. A graph of
    long contexts splits its keys, and a cascade's graph its prefix too: the partials come
    out of the graphs' pool, so the reserve counts the largest (one kv head: the CPU's
    nominal four SMs split it as a GPU's many split more heads)."""
    arch = ModelArch.from_hf_config(dummy_hf_config("llama3-8b"))
    arch = dataclasses.replace(arch, num_heads=4, num_kv_heads=1)
    model: Any = SimpleNamespace(attention_backend=TritonAttentionBackend(), arch=arch)
    cpu = torch.device("cpu")
    plain = decode_graph_scratch_bytes(model, 64, 8192, cpu, cascade=False)
    with_cascade = decode_graph_scratch_bytes(model, 64, 8192, cpu, cascade=True)
    assert decode_graph_scratch_bytes(model, 64, UNSPLIT_MAX_CONTEXT, cpu, cascade=False) == 0
    assert 0 < plain < with_cascade
    largest_cascade = decode_scratch_bytes(64, 4, 1, arch.head_dim, cpu, 8192, cascade=True)
    assert with_cascade >= largest_cascade > 0
    model.attention_backend = TorchAttentionBackend()  # the reference never splits
    assert decode_graph_scratch_bytes(model, 64, 8192, cpu, cascade=True) == 0
