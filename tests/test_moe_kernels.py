"""The fused-MoE Triton kernels against their torch references (kernels/moe/moe.py).

Without CUDA the kernels run through Triton's interpreter at small sizes. Routing is random
and uneven on purpose: an expert no token picks, an expert every token picks, one token.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.triton_interpret import CUDA, DEVICE, import_kernels

KERNEL_MODULES = (
    "kernels.moe.router_triton",
    "kernels.moe.align_triton",
    "kernels.moe.grouped_gemm_triton",
    "kernels.moe.fused_moe_triton",
)


KERNELS = import_kernels(KERNEL_MODULES)
router_triton = KERNELS["router_triton"]
align_triton = KERNELS["align_triton"]
fused_moe_triton = KERNELS["fused_moe_triton"]

from kernels.moe.config import GemmTile, MoeConfig  # noqa: E402
from kernels.moe.moe import fused_moe_ref, quantize_experts_fp8, route_topk_ref  # noqa: E402

TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def uneven_logits(num_tokens: int, num_experts: int, seed: int, routing: str) -> torch.Tensor:
    """Router logits whose top choices leave expert 0 idle (``skewed``) or send every token
    to expert ``num_experts - 1`` first (``one-hot``), or are plain random."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator) * 2
    if routing == "skewed":
        logits[:, 0] = -30.0  # nobody picks expert 0
        logits[:, 1] += 3.0  # and most pick expert 1
    elif routing == "one-hot":
        logits[:, -1] = 30.0
    return logits.to(DEVICE)


# -- router -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_experts", "top_k", "renormalize", "dtype"), [
    (8, 2, True, torch.float32), (60, 4, False, torch.bfloat16), (128, 8, True, torch.bfloat16),
    (128, 8, False, torch.float32),
])  # fmt: skip
def test_route_topk_matches_reference(
    num_experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    # distinct logits, exact in bf16 (steps of 1/16): ties would make the order a coin toss
    generator = torch.Generator().manual_seed(num_experts)
    ranks = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(19)])
    logits = ((ranks - num_experts / 2) / 16).to(DEVICE, dtype)
    weights, ids = router_triton.route_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = route_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(19, device=DEVICE))


# -- sort and align ---------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["skewed", "one-hot"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"),
                         [(1, 8, 2, 16), (37, 8, 2, 16), (50, 60, 4, 32), (300, 16, 2, 16)])  # fmt: skip
def test_align_sorts_pairs_by_expert_into_padded_runs(
    routing: str, num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    logits = uneven_logits(num_tokens, num_experts, seed=num_tokens, routing=routing)
    ids = route_topk_ref(logits, top_k, True)[1].contiguous()
    align = align_triton.align_pairs(ids, num_experts, block_m)
    flat, num_pairs = ids.flatten().cpu(), ids.numel()
    counts = torch.bincount(flat.long(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    num_padded = int(padded.sum())
    assert int(align.num_padded.item()) == num_padded
    assert align.sorted_pairs.numel() >= num_padded  # the worst-case buffer holds it
    # each expert's run: its pairs in pair order, then the sentinel to the block's end
    slots, blocks = align.sorted_pairs.cpu(), align.block_experts.cpu()
    start = 0
    for expert in range(num_experts):
        run = slots[start : start + int(padded[expert])]
        mine = torch.nonzero(flat == expert).flatten().to(torch.int32)
        assert torch.equal(run[: len(mine)], mine), f"expert {expert}'s run"
        assert bool((run[len(mine) :] == num_pairs).all())
        run_blocks = blocks[start // block_m : (start + int(padded[expert])) // block_m]
        assert bool((run_blocks == expert).all())
        start += int(padded[expert])
    assert bool((blocks[num_padded // block_m :] == -1).all())


# -- the whole MoE MLP ------------------------------------------------------------------------

CONFIGS = {
    "table": None,
    "direct": MoeConfig(1, GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2)),
    "bm32": MoeConfig(32, GemmTile(32, 32, 4, 2), GemmTile(16, 32, 4, 2)),
}


# every routing and dtype with the table's config; the other block size on the uneven routings
FUSED_CASES = [
    *((routing, dtype, "table") for routing in ("random", "skewed", "one-hot")
      for dtype in (torch.float32, torch.bfloat16)),
    ("skewed", torch.float32, "bm32"), ("one-hot", torch.bfloat16, "bm32"),
    ("skewed", torch.bfloat16, "direct"), ("one-hot", torch.float32, "direct"),
]  # fmt: skip


@pytest.mark.parametrize(("routing", "dtype", "config"), FUSED_CASES)
@pytest.mark.parametrize(("num_tokens", "top_k", "renormalize"), [(1, 2, True), (21, 3, False)])
def test_fused_moe_matches_reference(
    routing: str, dtype: torch.dtype, config: str, num_tokens: int, top_k: int, renormalize: bool
) -> None:
    num_experts, hidden, inter = 6, 48, 40  # neither a multiple of the tiles
    generator = torch.Generator().manual_seed(num_tokens + top_k)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=generator) * 0.2).to(DEVICE, dtype)
    logits = uneven_logits(num_tokens, num_experts, seed=7, routing=routing).to(dtype)
    out = fused_moe_triton.fused_moe(x, w13, w2, logits, top_k, renormalize, config=CONFIGS[config])
    expected = fused_moe_ref(x, w13, w2, logits, top_k, renormalize)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_fused_moe_empty_batch_and_bad_shapes() -> None:
    w13, w2 = torch.zeros(4, 32, 16, device=DEVICE), torch.zeros(4, 16, 16, device=DEVICE)
    empty = torch.zeros(0, 16, device=DEVICE)
    out = fused_moe_triton.fused_moe(empty, w13, w2, torch.zeros(0, 4, device=DEVICE), 2, True)
    assert out.shape == (0, 16)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_triton.fused_moe(
            torch.zeros(3, 16, device=DEVICE), w13, w2[:, :8], torch.zeros(3, 4, device=DEVICE),
            2, True,
        )  # fmt: skip


# -- on a GPU: real sizes, and replay from a CUDA graph ---------------------------------------

QWEN3_30B_LAYER = (128, 2048, 768, 8)  # experts, hidden, expert width, top_k


def qwen3_layer(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    num_experts, hidden, inter, _ = QWEN3_30B_LAYER
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w13 = (
        torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.03
    ).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.03).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen).bfloat16()
    return x, w13, w2, logits


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 333, 2048])  # direct path up to 2 tokens
def test_fused_moe_at_qwen3_30b_size(num_tokens: int, fp8: bool) -> None:
    x, w13, w2, logits = qwen3_layer(num_tokens, seed=num_tokens)
    top_k = QWEN3_30B_LAYER[3]
    scales: dict[str, torch.Tensor] = {}
    if fp8:
        (w13, scales["w13_scale"]), (w2, scales["w2_scale"]) = (
            quantize_experts_fp8(w13),
            quantize_experts_fp8(w2),
        )
    out = fused_moe_triton.fused_moe(x, w13, w2, logits, top_k, True, **scales)
    expected = fused_moe_ref(x, w13, w2, logits, top_k, True, **scales)
    assert_bf16_close(out, expected)


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Outputs of about 1 after three bf16 roundings, each of which a different fp32 sum
    order may flip by a step: a few steps apart at most, and far less on average."""
    torch.testing.assert_close(out, expected, atol=4e-2, rtol=4e-2)
    assert float((out.float() - expected.float()).abs().mean()) < 2e-3


@pytest.mark.gpu
def test_fused_moe_replays_from_a_cuda_graph_with_new_routing() -> None:
    """No host sync, shapes fixed by the token count: a captured step is right for any
    routing it replays with (here: all tokens on one expert after random routing)."""
    x, w13, w2, logits = qwen3_layer(16, seed=1)
    top_k = QWEN3_30B_LAYER[3]
    fused_moe_triton.fused_moe(x, w13, w2, logits, top_k, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton.fused_moe(x, w13, w2, logits, top_k, True)
    for seed, skew in ((2, 0.0), (3, 40.0)):
        new_x, _, _, new_logits = qwen3_layer(16, seed=seed)
        new_logits[:, 5] += skew
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        expected = fused_moe_ref(x, w13, w2, logits, top_k, True)
        assert_bf16_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 9])  # the default's direct path, then the sorted one
def test_fused_moe_with_fp8_expert_weights(dtype: torch.dtype, num_tokens: int) -> None:
    """W8A16: float8 e4m3 weights with a scale per row against the dequantized reference."""
    num_experts, hidden, inter, top_k = 4, 48, 40, 2
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13, w13_scale = quantize_experts_fp8(
        torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    )
    w2, w2_scale = quantize_experts_fp8(
        torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    )
    logits = uneven_logits(num_tokens, num_experts, seed=3, routing="skewed").to(dtype)
    args = (x, w13.to(DEVICE), w2.to(DEVICE), logits, top_k, True)
    scales = dict(w13_scale=w13_scale.to(DEVICE), w2_scale=w2_scale.to(DEVICE))
    out = fused_moe_triton.fused_moe(*args, **scales)
    expected = fused_moe_ref(*args, **scales)
    # bf16: a few roundings apart (the interpreter truncates to bf16 where a GPU rounds to
    # nearest), so within a few steps of bf16 at the outputs' scale
    tol = TOLERANCE[dtype]
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, atol=tol * scale, rtol=tol)
    with pytest.raises(ValueError, match="float8"):
        fused_moe_triton.fused_moe(*args)  # fp8 weights without their scales


def test_config_table_from_a_sweep_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's entries merge into a table file; a lookup takes the entry of its device and
    shape at the nearest token count at or above, and the kernels run with it."""
    from bench.moe_sweep import install
    from kernels.moe import config as moe_config

    shape = moe_config.MoeShape(6, 48, 40, 2, "float32")
    tuned = MoeConfig(32, GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2))
    entry = {"device": "cpu" if not CUDA else torch.cuda.get_device_name(), "shape": shape.key(),
             "config": tuned.to_json()}  # fmt: skip
    table = tmp_path / "table.json"
    install([{**entry, "num_tokens": 8}, {**entry, "num_tokens": 64}], table)
    install([{**entry, "num_tokens": 64, "config": CONFIGS["bm32"].to_json()}], table)  # replaces
    monkeypatch.setenv(moe_config.MOE_CONFIGS_ENV, str(table))
    moe_config._table.cache_clear()
    try:
        assert moe_config.pick_config(shape, 3, entry["device"]) == tuned
        assert moe_config.pick_config(shape, 9, entry["device"]) == CONFIGS["bm32"]
        assert moe_config.pick_config(shape, 500, entry["device"]) == CONFIGS["bm32"]  # largest
        assert moe_config.pick_config(shape, 1, "another GPU").block_m == 1  # the default
        assert moe_config.pick_config(shape, 3, "another GPU").block_m == 16
        test_fused_moe_matches_reference("skewed", torch.float32, "table", 1, 2, True)
    finally:
        moe_config._table.cache_clear()


def test_sweep_point_picks_checks_and_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/moe_sweep.py's plumbing at a tiny shape, a made-up clock (no GPU to time on):
    the fastest tiles win, the chosen path is checked against the reference."""
    from bench import moe_sweep
    from engine.loader.dummy import dummy_hf_config
    from engine.models.arch import ModelArch
    from kernels.moe import config as moe_config

    grid = [GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2)]
    monkeypatch.setattr(moe_sweep, "TILE_GRID", grid)
    monkeypatch.setattr(moe_sweep, "DIRECT_GRID", grid)
    monkeypatch.setattr(moe_sweep, "BLOCK_MS", (16, 32))
    clock = iter(range(1000, 0, -1))  # every call looks faster than the one before
    monkeypatch.setattr(moe_sweep, "time_us", lambda fn: float(next(clock)))
    arch = ModelArch.from_hf_config(dummy_hf_config("tiny-moe"))
    # 5 tokens: 10 pairs, the direct path competes (its down split over the slots timed last,
    # "fastest"); 40: 80 pairs, not
    for fp8, tokens, block_m in ((False, 5, 1), (True, 40, 32)):
        weights = moe_sweep.make_weights(arch, tp=1, fp8=fp8, seed=0, device=DEVICE)
        entry = moe_sweep.sweep_point(moe_sweep.make_layer(arch, weights, tokens), "cpu")
        assert entry["checked"], entry
        assert entry["shape"] == f"E8_H64_I32_k2_bfloat16{'_w8' if fp8 else ''}"
        config = MoeConfig.from_json(entry["config"])
        direct = block_m == 1
        assert config.gate_up == grid[1]  # the later, "faster" ones
        assert config.down == replace(grid[1], split_slots=direct)
        assert config.block_m == block_m
        assert ("block_m=1 split_slots" in entry["candidates_us"]) == direct
        if direct:  # each direct down kernel's best tile
            assert entry["direct"]["slot_order"]["tile"] == grid[1].to_json()
            assert entry["direct"]["split_slots"]["tile"]["split_slots"]
        layer_shape = moe_sweep.make_layer(arch, weights, tokens).shape
        default = moe_config.default_config(layer_shape, tokens)
        assert entry["default_config"] == default.to_json()
        assert entry["default_fused_us"] > entry["fused_us"]  # timed first: the "slowest"


def test_sweep_point_keeps_the_default_where_it_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is a candidate of its own: where it times fastest as a whole layer (here
    every call looks slower than the one before, and it is timed first), it is the entry."""
    from bench import moe_sweep
    from engine.loader.dummy import dummy_hf_config
    from engine.models.arch import ModelArch
    from kernels.moe import config as moe_config

    grid = [GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2)]
    monkeypatch.setattr(moe_sweep, "TILE_GRID", grid)
    monkeypatch.setattr(moe_sweep, "DIRECT_GRID", grid)
    monkeypatch.setattr(moe_sweep, "BLOCK_MS", (16, 32))
    clock = iter(range(1, 1000))
    monkeypatch.setattr(moe_sweep, "time_us", lambda fn: float(next(clock)))
    arch = ModelArch.from_hf_config(dummy_hf_config("tiny-moe"))
    weights = moe_sweep.make_weights(arch, tp=1, fp8=False, seed=0, device=DEVICE)
    layer = moe_sweep.make_layer(arch, weights, 40)
    entry = moe_sweep.sweep_point(layer, "cpu")
    default = moe_config.default_config(layer.shape, 40)
    assert entry["checked"] and entry["config"] == entry["default_config"] == default.to_json()
    assert entry["fused_us"] == entry["default_fused_us"]


def test_default_config_takes_the_direct_path_while_pairs_rarely_share_an_expert() -> None:
    """A row per program, K in steps of 1024, where at most half the experts see a pair
    (Mixtral's 8: up to 2 tokens; qwen3-30b-a3b's 128 at top-8: up to 2, by the pair cap);
    the sorted path beyond; float32 halves K."""
    from kernels.moe import config as moe_config

    mixtral = moe_config.MoeShape(8, 4096, 7168, 2, "bfloat16")
    qwen3 = moe_config.MoeShape(128, 2048, 768, 8, "bfloat16")
    gemv = GemmTile(1, 1024, 1, 2)
    for shape, direct_up_to in ((mixtral, 2), (qwen3, 2)):
        for tokens in (1, 2, 3, 4, 8):
            config = moe_config.default_config(shape, tokens)
            if tokens <= direct_up_to:
                assert config == MoeConfig(1, gemv, gemv), (shape, tokens)
            else:
                assert config.block_m >= 16, (shape, tokens)
    assert moe_config.default_config(replace(mixtral, dtype="float32"), 1).gate_up.block_k == 512


@pytest.mark.parametrize("config", ["table", "direct"])
def test_a_garbage_row_leaves_the_other_tokens_alone(config: str) -> None:
    """A padding row of a captured batch may hold NaN: it must route to real experts and
    take no other token's place in the sorted layout."""
    num_tokens, num_experts, hidden, inter, top_k = 6, 6, 48, 40, 3
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(DEVICE)
    logits = uneven_logits(num_tokens, num_experts, seed=9, routing="random")
    x[2], logits[2] = float("nan"), float("nan")
    _, ids = router_triton.route_topk(logits, top_k, True)
    assert bool(((ids >= 0) & (ids < num_experts)).all())
    out = fused_moe_triton.fused_moe(x, w13, w2, logits, top_k, True, config=CONFIGS[config])
    rest = [0, 1, 3, 4, 5]
    expected = fused_moe_ref(x[rest], w13, w2, logits[rest], top_k, True)
    torch.testing.assert_close(out[rest], expected, atol=1e-4, rtol=1e-4)
