"""The host tier of the prefix cache (--kv-offload-mb): its LRU bookkeeping, bit-exact page
copies, an engine whose evicted shared prefix comes back from host memory with unchanged
tokens, and the flag combinations it refuses."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.errors import ConfigError
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_offload import HostPrefixCache, PageTransfer
from engine.memory import plan_pool
from tests.conftest import TINY_COMMON, random_prompts
from tests.test_block_manager import make_seq

VOCAB_SIZE = TINY_COMMON["vocab_size"]

# -- bookkeeping -----------------------------------------------------------------------------


def test_host_tier_evicts_least_recently_used_and_saves_each_block_once() -> None:
    tier = HostPrefixCache(2)
    assert tier.save(b"a") == 0 and tier.save(b"b") == 1
    assert tier.save(b"a") is None  # already held: no copy, but now the most recent
    assert tier.save(b"c") == 1  # "b" was the least recently used
    assert b"b" not in tier and tier.lookup(b"a") == 0 and tier.lookup(b"c") == 1
    assert (tier.num_offloaded_pages, tier.num_evictions) == (3, 1)
    assert HostPrefixCache(0).save(b"a") is None


def cached_manager(num_blocks: int, num_slots: int) -> tuple[BlockManager, list[int]]:
    """A manager of 4-token pages whose prefix cache holds one freed 3-page prompt."""
    bm = BlockManager(num_blocks, 4, host_cache=HostPrefixCache(num_slots))
    first = make_seq("first", list(range(12)))
    assert bm.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    bm.register_full_blocks(first)
    blocks = list(first.block_table)
    bm.free(first)
    return bm, blocks


def test_evicted_blocks_are_saved_then_restored_into_fresh_pages() -> None:
    bm, blocks = cached_manager(num_blocks=4, num_slots=8)
    other = make_seq("other", [50 + i for i in range(16)])
    assert bm.allocate_slots(other, 16)  # every page: the cached ones are evicted
    saved = bm.take_transfers()
    assert all(t.to_host for t in saved) and sorted(t.device_block for t in saved) == blocks
    assert bm.num_cached_blocks == 0 and bm.take_transfers() == []
    bm.free(other)

    again = make_seq("again", [*range(12), 99])
    hit = bm.match_prefix(again)
    assert (hit.device_tokens, hit.host_tokens) == (0, 12)
    restores = bm.take_transfers()
    slot_of = {t.device_block: t.host_slot for t in saved}
    # page i of the prompt comes back from the slot page i was saved to
    assert [t.host_slot for t in restores if not t.to_host] == [slot_of[b] for b in blocks]
    assert [t.device_block for t in restores if not t.to_host] == again.block_table
    assert bm.num_cached_blocks == 3  # restored pages are published on the device again
    bm.check_invariants([again])


def test_a_prefix_matches_on_the_device_then_goes_on_in_the_host_tier() -> None:
    bm, blocks = cached_manager(num_blocks=5, num_slots=8)
    # Four pages: the two never used, then the prompt's tail pages (freed first).
    taker = make_seq("taker", [70 + i for i in range(16)])
    assert bm.allocate_slots(taker, 16)
    assert sorted(t.device_block for t in bm.take_transfers()) == sorted(blocks[1:])
    bm.free(taker)
    again = make_seq("again", [*range(12), 99])
    hit = bm.match_prefix(again)
    assert (hit.device_tokens, hit.host_tokens) == (4, 8)
    assert again.block_table[0] == blocks[0]
    assert [t.to_host for t in bm.take_transfers()] == [False, False]
    bm.check_invariants([again])


def test_a_one_slot_tier_never_restores_a_slot_it_just_overwrote() -> None:
    bm = BlockManager(1, 4, host_cache=HostPrefixCache(1))
    first = make_seq("first", [*range(4), 9])
    assert bm.allocate_slots(first, 4)
    first.num_computed_tokens = 4
    bm.register_full_blocks(first)
    bm.free(first)
    second = make_seq("second", [*range(10, 14), 9])
    assert bm.allocate_slots(second, 4)  # saves "first"'s page in the only slot
    second.num_computed_tokens = 4
    bm.register_full_blocks(second)
    bm.free(second)
    bm.take_transfers()
    # Restoring "first" needs the only page, whose block must take the only slot: a miss.
    third = make_seq("third", [*range(4), 9])
    assert bm.match_prefix(third).num_tokens == 0
    assert [(t.to_host, t.host_slot) for t in bm.take_transfers()] == [(True, 0)]
    bm.free(third)
    bm.check_invariants([])


def test_pages_hold_their_blocks_through_random_steps_of_saves_and_restores() -> None:
    """Simulated memory: each page and slot holds the hash of the block written to it.

    Each step admits a few prompts that share prefixes (device hits, host hits, fresh pages),
    runs the step's transfers in order, checks every reused page holds its block, then
    "computes" the rest. A tiny pool and tier make evictions in the middle of a step common.
    """
    rng = random.Random(7)
    bm = BlockManager(6, 2, host_cache=HostPrefixCache(3))
    device: dict[int, bytes] = {}
    host: dict[int, bytes] = {}
    stems = [[rng.randrange(4) for _ in range(8)] for _ in range(3)]
    num_host_hits = 0
    for _ in range(300):
        admitted = []
        for index in range(rng.randint(1, 3)):
            seq = make_seq(f"s{index}", [*rng.choice(stems)[: rng.randint(2, 8)], 9])
            hit = bm.match_prefix(seq)
            if not bm.allocate_slots(seq, seq.num_tokens - hit.num_tokens):
                bm.free(seq)
                continue
            num_host_hits += hit.host_tokens // 2
            admitted.append((seq, hit.num_tokens // 2))
        for transfer in bm.take_transfers():
            if transfer.to_host:
                host[transfer.host_slot] = device[transfer.device_block]
            else:
                device[transfer.device_block] = host[transfer.host_slot]
        for seq, num_reused in admitted:
            for index in range(num_reused):
                assert device[seq.block_table[index]] == seq.block_hashes[index]
            seq.num_computed_tokens = seq.num_tokens
            bm.register_full_blocks(seq)
            for index in range(num_reused, len(seq.block_hashes)):
                device[seq.block_table[index]] = seq.block_hashes[index]
        for seq, _ in admitted:
            bm.free(seq)
        bm.check_invariants([])
    assert num_host_hits > 20 and bm.host_cache is not None and bm.host_cache.num_evictions > 20


# -- page copies -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_offloaded_pages_restore_bit_exact(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = KVCache(spec, 6, 0, torch.device("cpu"), num_offload_blocks=3)
    torch.manual_seed(0)
    cache.pages.copy_(torch.randn(cache.pages.shape).to(dtype))
    if cache.scales is not None:
        cache.scales.copy_(torch.rand(cache.scales.shape))
    before = cache.pages.clone(), None if cache.scales is None else cache.scales.clone()
    # Save pages 1 and 4, overwrite them (reuse), then restore them into pages 0 and 5.
    cache.transfer([PageTransfer(1, 2, to_host=True), PageTransfer(4, 0, to_host=True)])
    cache.pages[:, :, [1, 4]] = torch.zeros(()).to(dtype)
    cache.transfer([PageTransfer(0, 2, to_host=False), PageTransfer(5, 0, to_host=False)])
    for now, then in zip((cache.pages, cache.scales), before, strict=True):
        if now is None or then is None:
            continue
        assert torch.equal(now[:, :, 0].view(torch.uint8), then[:, :, 1].view(torch.uint8))
        assert torch.equal(now[:, :, 5].view(torch.uint8), then[:, :, 4].view(torch.uint8))
        assert torch.equal(now[:, :, 2:4], then[:, :, 2:4])  # the others untouched


# -- the engine ------------------------------------------------------------------------------


def run_in_order(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt alone, one after another, so the earlier ones' pages are cached (then
    evicted) by the time the later ones arrive."""
    sampling = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)
    outputs = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=sampling)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        outputs.append(tokens)
    return outputs


@pytest.mark.parametrize("cache_type", ["auto", "fp8_e4m3"])
def test_an_evicted_shared_prefix_comes_back_from_host_memory(
    cache_type: str, tiny_model_dirs: dict[str, Path]
) -> None:
    # An 8-page pool of 16 tokens: two 100-token prompts between the two chat turns take
    # every page, so the shared 48-token prefix is gone from the device when turn 2 comes.
    prefix, first, flush_a, flush_b, second = random_prompts([48, 10, 100, 100, 12], VOCAB_SIZE, 3)
    prompts = [prefix + first, flush_a, flush_b, prefix + second]
    settings: dict[str, Any] = dict(
        model=str(tiny_model_dirs["llama"]), pa_block_size=16, pa_context_len=128,
        max_model_len=128, pa_cache_type=cache_type,
    )  # fmt: skip
    plain = LLMEngine(EngineConfig(**settings))
    expected = run_in_order(plain, prompts, 8)
    assert plain.stats().num_host_hit_tokens == 0

    tiered = LLMEngine(EngineConfig(**settings, kv_offload_mb=1))
    assert run_in_order(tiered, prompts, 8) == expected
    stats = tiered.stats()
    assert stats.num_host_hit_tokens == 48  # the whole prefix, not recomputed
    assert stats.num_offloaded_pages >= 3 and stats.num_offload_evictions == 0
    assert tiered.block_manager.num_used_blocks == 0


def run_in_waves(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Three new prompts every seven steps, so admissions, preemptions and finishes mix."""
    sampling = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    tokens: dict[str, list[int]] = {}
    num_steps = 0
    while len(tokens) < len(prompts) or engine.has_unfinished_requests():
        if num_steps % 7 == 0:
            for index in range(len(tokens), min(len(tokens) + 3, len(prompts))):
                engine.add_request(f"r{index}", prompt_token_ids=prompts[index], sampling=sampling)
                tokens[f"r{index}"] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        num_steps += 1
    return tokens


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_host_tier_beside_preemption_changes_no_token(
    preemption: str, tiny_model_dirs: dict[str, Path]
) -> None:
    # A 10-page pool of 16 tokens: preemptions and evictions in the same steps as restores and swaps.
    prefixes = random_prompts([40, 56, 33], VOCAB_SIZE, seed=1)
    tails = random_prompts([5, 9, 14, 20, 3, 11, 7, 17, 25], VOCAB_SIZE, seed=2)
    prompts = [prefixes[index % 3] + tail for index, tail in enumerate(tails)]
    settings: dict[str, Any] = dict(
        model=str(tiny_model_dirs["llama"]), pa_block_size=16, pa_context_len=160,
        max_model_len=128, preemption=preemption, async_scheduling=True,
    )  # fmt: skip
    expected = run_in_waves(LLMEngine(EngineConfig(**settings)), prompts)
    tiered = LLMEngine(EngineConfig(**settings, kv_offload_mb=1))
    assert run_in_waves(tiered, prompts) == expected
    stats = tiered.stats()
    assert stats.num_preemptions > 0 and stats.num_host_hit_tokens > 0
    assert tiered.block_manager.num_used_blocks == 0


# -- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(kv_offload_mb=-1), "kv_offload_mb must be >= 0"),
        (dict(kv_offload_mb=64, prefix_caching=False), "needs --prefix-caching on"),
        (dict(kv_offload_mb=64, paged_attn="off"), "needs paged attention"),
    ],
)
def test_bad_offload_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings)


def test_a_host_tier_too_small_for_one_page_is_refused() -> None:
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=32,
                       dtype=torch.bfloat16)  # fmt: skip
    config = EngineConfig(pa_memory_mb=512, max_model_len=1024, kv_offload_mb=1)
    with pytest.raises(ConfigError, match=r"--kv-offload-mb 1 holds no page: .* 4\.00 MiB"):
        plan_pool(config, spec, torch.device("cpu"), 1024)
    plan = plan_pool(dataclasses.replace(config, kv_offload_mb=64), spec, torch.device("cpu"), 1024)
    assert plan.num_offload_blocks == 16


# -- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_pages_restore_bit_exact_through_pinned_memory(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, dtype=dtype)
    cache = KVCache(spec, 16, 0, torch.device("cuda"), num_offload_blocks=8)
    assert cache.offload_pages.is_pinned()
    cache.pages.copy_(torch.randn(cache.pages.shape, device="cuda").to(dtype))
    if cache.scales is not None:
        cache.scales.copy_(torch.rand(cache.scales.shape, device="cuda"))
    before = cache.pages.clone(), None if cache.scales is None else cache.scales.clone()
    # Queued without a sync: the save, a kernel overwriting the saved pages (a forward
    # reusing them), then the restore into other pages, all in stream order.
    cache.transfer([PageTransfer(b, b // 2, to_host=True) for b in (2, 4, 6)])
    cache.pages[:, :, 2:8].zero_()
    cache.transfer([PageTransfer(b + 8, b // 2, to_host=False) for b in (2, 4, 6)])
    torch.cuda.synchronize()
    for now, then in zip((cache.pages, cache.scales), before, strict=True):
        if now is None or then is None:
            continue
        for block in (2, 4, 6):
            restored = now[:, :, block + 8].view(torch.uint8)
            assert torch.equal(restored, then[:, :, block].view(torch.uint8)), block


@pytest.mark.gpu
def test_cuda_multiturn_with_the_host_tier_gives_the_same_replies(
    tiny_model_dirs: dict[str, Path],
) -> None:
    # Graphs and asynchronous scheduling on: restores and saves land in steps whose forward
    # also decodes other sessions. fp32, so recomputing a history gives the saved KV's tokens.
    from bench.multiturn import MultiTurnWorkload, run_multiturn

    config = EngineConfig(
        model=str(tiny_model_dirs["llama"]), device="cuda", dtype="float32", pa_block_size=16,
        pa_context_len=512, max_model_len=256, kv_offload_mb=4,
    )  # fmt: skip
    workload = MultiTurnWorkload(num_sessions=12, num_turns=3, system_len=64, user_len=(8, 24),
                                 output_len=12, concurrency=4)  # fmt: skip
    results = run_multiturn(config, workload, use_tqdm=False)["results"]
    assert results["same_replies"] == 1.0
    assert results["offload_on"]["prefix_cache"]["host_hit_tokens"] > 0
    assert results["offload_off"]["prefix_cache"]["host_hit_tokens"] == 0
