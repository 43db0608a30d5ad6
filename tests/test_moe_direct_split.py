"""The direct path's down kernel split over the slots (kernels/moe/direct_triton.py): the same
output bit for bit as the kernel that walks the slots in order, near the torch reference, its
ticket counters zero after every call, whichever slot's program finishes last.

Without CUDA the kernels run through Triton's interpreter, a program at a time.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tests.triton_interpret import CUDA, DEVICE, import_kernels

KERNELS = import_kernels(("kernels.moe.router_triton", "kernels.moe.direct_triton",
                          "kernels.moe.fused_moe_triton"))  # fmt: skip
direct_triton = KERNELS["direct_triton"]
fused_moe_triton = KERNELS["fused_moe_triton"]

from kernels.moe.config import TUNED_CONFIGS_PATH, GemmTile, MoeConfig  # noqa: E402
from kernels.moe.moe import experts_ref, quantize_experts_fp8  # noqa: E402
from kernels.moe.split_slot_buffers import SplitSlotBuffers  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER = 10, 40, 24  # H and I no multiple of the tile's N and K
TILE = GemmTile(16, 16, 4, 2)
SPLIT = replace(TILE, split_slots=True)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


@dataclass
class DirectInputs:
    """A step's direct-path inputs, down's activations made by the (tested) gate/up kernel."""

    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2 * I, H]
    w2: torch.Tensor  # [E, H, I]
    weights: torch.Tensor  # [T, top_k] float32
    ids: torch.Tensor  # [T, top_k] int32
    act: torch.Tensor  # [T * top_k, I]
    scales: dict[str, torch.Tensor]

    def down(self, tile: GemmTile, buffers: SplitSlotBuffers | None = None) -> torch.Tensor:
        out = torch.empty_like(self.x)
        return direct_triton.down_sum_direct(
            self.act, self.w2, self.weights, self.ids, tile, out, self.scales.get("w2_scale"),
            buffers,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        return experts_ref(self.x, self.w13, self.w2, self.weights, self.ids, **self.scales)


def direct_inputs(
    num_tokens: int, top_k: int, dtype: torch.dtype, fp8: bool, seed: int
) -> DirectInputs:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    w13, w2, scales = held_experts(w13.to(DEVICE), w2.to(DEVICE), dtype, fp8)
    # distinct experts per token (as top-k picks them), some shared between tokens
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in x])
    ids = ids.to(DEVICE, torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    act = direct_triton.gate_up_silu_direct(x, w13, ids, TILE, scales.get("w13_scale"))
    return DirectInputs(x, w13, w2, weights, ids, act, scales)


def held_experts(
    w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The experts' weights as a layer holds them: in ``dtype``, or (``fp8``) in float8 with
    their row scales (``w13_scale``, ``w2_scale``)."""
    if not fp8:
        return w13.to(dtype), w2.to(dtype), {}
    (w13, w13_scale), (w2, w2_scale) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    return w13, w2, {"w13_scale": w13_scale, "w2_scale": w2_scale}


def kept_tickets(buffers: SplitSlotBuffers) -> torch.Tensor:
    (slot_terms,) = buffers._terms.values()
    return slot_terms.tickets


@pytest.mark.parametrize(("dtype", "fp8"), [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True), (torch.float32, True)])  # fmt: skip
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 8), (3, 1), (4, 8)])
def test_split_slots_equals_the_slot_order_kernel(
    dtype: torch.dtype, fp8: bool, num_tokens: int, top_k: int
) -> None:
    inputs = direct_inputs(num_tokens, top_k, dtype, fp8, seed=num_tokens * top_k)
    buffers = SplitSlotBuffers()
    split = inputs.down(SPLIT, buffers)
    assert torch.equal(split, inputs.down(TILE))
    assert not kept_tickets(buffers).any()  # the last programs set their counters back
    expected = inputs.reference()
    tol = TOLERANCE[dtype] * (float(expected.abs().max()) if fp8 else 1.0)
    torch.testing.assert_close(split, expected, atol=tol, rtol=TOLERANCE[dtype])


def test_kept_buffers_serve_the_next_call() -> None:
    """A second call (new routing, same shape) takes the same counters, zero again after the
    first: no allocation, no memset, the right sum."""
    buffers = SplitSlotBuffers()
    first = direct_inputs(3, 8, torch.bfloat16, fp8=False, seed=1)
    assert torch.equal(first.down(SPLIT, buffers), first.down(TILE))
    tickets = kept_tickets(buffers)
    second = direct_inputs(3, 8, torch.bfloat16, fp8=False, seed=2)
    assert not torch.equal(second.ids, first.ids)
    assert torch.equal(second.down(SPLIT, buffers), second.down(TILE))
    assert kept_tickets(buffers) is tickets and not tickets.any()
    assert buffers.allocated_bytes == 3 * HIDDEN * 4 + 3 * 8 * HIDDEN * 4


Program = tuple[int, int, int]


@dataclass
class ProgramOrder:
    order: list[Program]  # the order a launch runs its programs in; empty: the grid's own
    ran: list[Program]  # the programs run in ``order``, in turn


@pytest.fixture
def program_order(monkeypatch: pytest.MonkeyPatch) -> ProgramOrder:
    """Under the interpreter, a launch runs its programs in the order the test sets instead of
    the grid's: the order programs finish on a GPU is any."""
    if CUDA:
        pytest.skip("the interpreter's program order")
    from triton.runtime.interpreter import interpreter_builder as builder

    programs = ProgramOrder([], [])
    set_grid_idx = builder.set_grid_idx

    def set_permuted(x: int, y: int, z: int) -> None:
        if not programs.order:
            return set_grid_idx(x, y, z)
        num_x, num_y, num_z = builder.grid_dim
        assert len(programs.order) == num_x * num_y * num_z, "an order of every program"
        # the grid's n-th program (x, y, z in turn) runs order[n]
        programs.ran.append(programs.order[(x * num_y + y) * num_z + z])
        return set_grid_idx(*programs.ran[-1])

    monkeypatch.setattr(builder, "set_grid_idx", set_permuted)
    return programs


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_the_sum_ignores_which_program_finishes_last(
    program_order: ProgramOrder, order: str
) -> None:
    """Whichever slot draws a tile's last ticket sums the terms in slot order: the same bits."""
    num_tokens, top_k = 2, 8
    inputs = direct_inputs(num_tokens, top_k, torch.bfloat16, fp8=False, seed=5)
    expected = inputs.down(TILE)  # before the permutation: it has another grid
    grid = list(itertools.product(range(num_tokens), range(-(-HIDDEN // TILE.block_n)),
                                  range(top_k)))  # fmt: skip
    program_order.order = (
        grid[::-1] if order == "reversed" else random.Random(0).sample(grid, len(grid))
    )
    last_slots = {program[:2]: program[2] for program in program_order.order}
    assert set(last_slots.values()) != {top_k - 1}  # another slot sums, somewhere
    buffers = SplitSlotBuffers()
    for _ in range(2):  # and again on the counters the first call left
        assert torch.equal(inputs.down(SPLIT, buffers), expected)
        assert not kept_tickets(buffers).any()
    assert program_order.ran == 2 * program_order.order  # the order took


@pytest.mark.parametrize("kept", [True, False])
def test_fused_moe_with_a_split_slot_config(kept: bool) -> None:
    """The whole layer with a split-slot down tile, its buffers kept by the caller or made by
    the call: the slot-order config's output."""
    num_tokens, top_k = 3, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2).to(DEVICE, x.dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.2).to(DEVICE, x.dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen).to(DEVICE, x.dtype)
    args = (x, w13, w2, logits, top_k, True)
    buffers = SplitSlotBuffers() if kept else None
    split = fused_moe_triton.fused_moe(*args, MoeConfig(1, TILE, SPLIT), direct_buffers=buffers)
    assert torch.equal(split, fused_moe_triton.fused_moe(*args, MoeConfig(1, TILE, TILE)))
    assert (buffers is not None and buffers.allocated_bytes > 0) == kept


def test_split_slots_in_the_config_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``split_slots`` goes to JSON only when set: the shipped table reads and writes as
    before, and a split-slot entry comes back from a table file as it went in."""
    from bench.moe_sweep import install
    from kernels.moe import config as moe_config

    assert TILE.to_json() == {"block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}
    assert GemmTile.from_json(TILE.to_json()) == TILE and not TILE.split_slots
    assert SPLIT.to_json() == {**TILE.to_json(), "split_slots": True}
    for entry in json.loads(TUNED_CONFIGS_PATH.read_text())["entries"]:
        assert MoeConfig.from_json(entry["config"]).to_json() == entry["config"]
    split = MoeConfig(1, TILE, SPLIT)
    assert MoeConfig.from_json(json.loads(json.dumps(split.to_json()))) == split
    with pytest.raises(ValueError, match="split_slots"):
        MoeConfig(16, TILE, SPLIT)  # the sorted path's down has no slot walk to split
    with pytest.raises(ValueError, match="split_slots"):
        MoeConfig(1, SPLIT, TILE)
    shape = moe_config.MoeShape(NUM_EXPERTS, HIDDEN, INTER, 8, "bfloat16")
    table = tmp_path / "table.json"
    install([{"device": "cpu", "shape": shape.key(), "num_tokens": 1,
              "config": split.to_json()}], table)  # fmt: skip
    monkeypatch.setenv(moe_config.MOE_CONFIGS_ENV, str(table))
    moe_config._table.cache_clear()
    try:
        assert moe_config.pick_config(shape, 1, "cpu") == split
    finally:
        moe_config._table.cache_clear()


# -- on a GPU: the decode sizes of qwen3-30b-a3b, and CUDA graphs -----------------------------

QWEN3_30B = (128, 2048, 768)  # experts, hidden, expert width; top-8
GPU_TILE = GemmTile(16, 1024, 8, 2)  # the H200 table's batch-1 down tile


def qwen3_direct(num_tokens: int, fp8: bool, seed: int) -> DirectInputs:
    num_experts, hidden, inter = QWEN3_30B
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.03
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.03
    w13, w2, scales = held_experts(w13, w2, torch.bfloat16, fp8)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = KERNELS["router_triton"].route_topk(logits, 8, True)
    act = direct_triton.gate_up_silu_direct(x, w13, ids, GPU_TILE, scales.get("w13_scale"))
    return DirectInputs(x, w13, w2, weights, ids, act, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 8])
def test_split_slots_at_qwen3_30b_size(num_tokens: int, fp8: bool) -> None:
    inputs, buffers = qwen3_direct(num_tokens, fp8, seed=num_tokens), SplitSlotBuffers()
    expected = inputs.down(GPU_TILE)
    for tile in (GPU_TILE, GemmTile(64, 128, 4, 3)):
        split_tile = replace(tile, split_slots=True)
        for _ in range(3):  # the counters of the call before, on a real GPU's scheduling
            torch.testing.assert_close(inputs.down(split_tile, buffers), expected)
        assert torch.equal(inputs.down(split_tile, buffers), inputs.down(tile))
    assert all(not t.tickets.any() for t in buffers._terms.values())


@pytest.mark.gpu
def test_split_slots_replay_from_a_cuda_graph() -> None:
    """Buffers made before the capture, reused by every replay with new routing; a shape's
    first call inside a capture is refused (its counters would be zeroed only at replay)."""
    inputs, buffers = qwen3_direct(8, fp8=False, seed=1), SplitSlotBuffers()
    split = replace(GPU_TILE, split_slots=True)
    out = inputs.down(split, buffers)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = inputs.down(split, buffers)
    for seed in (2, 3):
        new = qwen3_direct(8, fp8=False, seed=seed)
        for name in ("weights", "ids", "act"):
            getattr(inputs, name).copy_(getattr(new, name))
        graph.replay()
        assert torch.equal(out, inputs.down(GPU_TILE))
    with pytest.raises(RuntimeError, match="capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        SplitSlotBuffers().take(8, 8, QWEN3_30B[1], torch.device("cuda"))
