"""The GEMV kernel against torch on random inputs (Triton's interpreter on the CPU, compiled on
a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise.activation import silu_and_mul_ref
from kernels.linear.gemv_triton import MAX_ROWS, GemvConfig, default_config, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize(
    ("num_cols", "size_k", "config"),
    [
        (24, 64, GemvConfig(block_n=8, block_k=32)),  # K in whole blocks
        (20, 80, GemvConfig(block_n=8, block_k=32)),  # ragged N and K
        (16, 128, GemvConfig(block_n=8, block_k=32, split_k=2)),  # K split, atomics
        (16, 100, GemvConfig(block_n=16, block_k=32, split_k=2)),  # ragged split
    ],
)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_matches_torch(
    num_rows: int, num_cols: int, size_k: int, config: GemvConfig, silu_mul: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + num_cols + size_k)
    width = 2 * size_k if silu_mul else size_k
    x = torch.randn(num_rows, width, generator=gen)
    weight = torch.randn(num_cols, size_k, generator=gen)
    expected = (silu_and_mul_ref(x) if silu_mul else x) @ weight.T
    got = gemv(x.to(DEVICE), weight.to(DEVICE), silu_mul=silu_mul, config=config).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gemv_writes_into_a_given_buffer_and_rounds_like_the_reference_in_bf16() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2 * 64, generator=gen).bfloat16()
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    out = torch.empty(2, 32, dtype=torch.bfloat16, device=DEVICE)
    result = gemv(x.to(DEVICE), weight.to(DEVICE), silu_mul=True,
                  config=GemvConfig(block_n=8, block_k=32), out=out)  # fmt: skip
    assert result.data_ptr() == out.data_ptr()
    out = out.cpu()
    expected = silu_and_mul_ref(x).float() @ weight.float().T
    # one bf16 rounding of the output, relative to the sums' scale (terms cancel)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_default_config_fills_the_gpu_and_splits_only_long_k() -> None:
    assert default_config(4096, 4096).split_k > 1  # 256 programs alone would be too few
    assert default_config(128256, 4096).split_k == 1
    wide = default_config(28672, 4096)
    assert 28672 // wide.block_n >= 512 and wide.split_k == 1


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "words"),
    [
        ((1, 64), (8, 32), "x [M, 32]"),
        ((MAX_ROWS + 1, 32), (8, 32), "1..8 rows"),
        ((0, 32), (8, 32), "1..8 rows"),
    ],
)
def test_gemv_refuses_shapes_it_cannot_take(
    x_shape: tuple[int, int], w_shape: tuple[int, int], words: str
) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(".", r"\.")):
        gemv(torch.zeros(x_shape), torch.zeros(w_shape))


@pytest.mark.parametrize(("num_experts", "hidden"), [(8, 96), (24, 2048), (8, 2560)])
def test_the_router_s_default_launch_shape_gives_torch_s_logits(
    num_experts: int, hidden: int
) -> None:
    """``ROUTER_GEMV_CONFIG`` (a program per expert, 2,048-wide K tiles) over a hidden size
    under one tile, exactly one, and one and a bit: the router logits of a decode row."""
    from bench.gemv import engine_default
    from engine.models.linears import ROUTER_GEMV_CONFIG

    assert engine_default("router", num_experts, hidden) is ROUTER_GEMV_CONFIG
    gen = torch.Generator().manual_seed(num_experts + hidden)
    x = torch.randn(1, hidden, generator=gen)
    weight = torch.randn(num_experts, hidden, generator=gen)
    got = gemv(x.to(DEVICE), weight.to(DEVICE), config=ROUTER_GEMV_CONFIG).cpu()
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("num_rows", "size_k", "config"),
    [
        (1, 96, GemvConfig(block_n=8, block_k=32)),  # K in whole blocks
        (3, 80, GemvConfig(block_n=4, block_k=32)),  # ragged K, three rows
        (2, 128, GemvConfig(block_n=8, block_k=32, split_k=2)),  # K split: atomics
    ],
)
@pytest.mark.parametrize(
    ("with_residual", "keep_normed"), [(True, False), (False, True), (True, True)]
)
def test_gemv_with_the_norm_in_its_prologue_equals_norm_then_gemv(
    num_rows: int, size_k: int, config: GemvConfig, with_residual: bool, keep_normed: bool
) -> None:
    """``RowNorm``: the residual add and RMSNorm before the product, in fp32, against
    ``fused_add_rms_norm_ref`` then a matmul; the new residual (and the normed rows, where
    kept) written apart, the old residual and x untouched."""
    from kernels.elementwise.norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.linear.gemv_triton import RowNorm

    gen = torch.Generator().manual_seed(num_rows * 100 + size_k)
    x = torch.randn(num_rows, size_k, generator=gen)
    residual = torch.randn(num_rows, size_k, generator=gen)
    norm_weight = 1.0 + 0.1 * torch.randn(size_k, generator=gen)
    weight = torch.randn(20, size_k, generator=gen)
    if with_residual:
        normed, summed = fused_add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    else:
        normed, summed = rms_norm_ref(x, norm_weight, 1e-6), x
    xd, rd = x.to(DEVICE), residual.to(DEVICE)
    new_residual, kept = torch.full_like(rd, float("nan")), torch.full_like(rd, float("nan"))
    norm = RowNorm(norm_weight.to(DEVICE), 1e-6, *((rd, new_residual) if with_residual else ()),
                   normed_out=kept if keep_normed else None)  # fmt: skip
    got = gemv(xd, weight.to(DEVICE), config=config, norm=norm).cpu()
    torch.testing.assert_close(got, normed @ weight.T, rtol=1e-4, atol=1e-4)
    if keep_normed:
        torch.testing.assert_close(kept.cpu(), normed, rtol=1e-5, atol=1e-5)
    else:
        assert kept.isnan().all()
    assert torch.equal(xd.cpu(), x) and torch.equal(rd.cpu(), residual)
    if with_residual:
        assert torch.equal(new_residual.cpu(), summed)
    else:
        assert new_residual.isnan().all()


def test_gemv_norm_rounds_as_the_norm_kernel_does_in_bf16() -> None:
    """In bf16: the new residual is the rounded sum bit for bit (on a GPU; the interpreter
    truncates fp32 -> bf16 casts, a ulp off); the product is the norm's bf16 rows times the
    weight (the rows' statistics summed in another order: within a rounding of the output)."""
    from kernels.elementwise.norm import fused_add_rms_norm_ref
    from kernels.linear.gemv_triton import RowNorm

    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(1, 256, generator=gen).bfloat16() for _ in range(2))
    norm_weight = (1.0 + 0.1 * torch.randn(256, generator=gen)).bfloat16()
    weight = (0.05 * torch.randn(64, 256, generator=gen)).bfloat16()
    normed, summed = fused_add_rms_norm_ref(x, residual.clone(), norm_weight, 1e-5)
    new_residual = torch.empty(1, 256, dtype=torch.bfloat16, device=DEVICE)
    norm = RowNorm(norm_weight.to(DEVICE), 1e-5, residual.to(DEVICE), new_residual)
    got = gemv(x.to(DEVICE), weight.to(DEVICE), config=GemvConfig(block_n=8, block_k=64),
               norm=norm).cpu()  # fmt: skip
    tol = 0.0 if DEVICE == "cuda" else 2.0**-7
    torch.testing.assert_close(new_residual.cpu(), summed, atol=tol, rtol=tol)
    expected = normed.float() @ weight.float().T
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_gemv_refuses_a_norm_it_cannot_apply() -> None:
    from kernels.linear.gemv_triton import RowNorm

    x, weight = torch.randn(1, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE)
    residual, g = torch.randn(1, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="cannot overwrite"):
        gemv(x, weight, norm=RowNorm(g, 1e-6, residual, residual))
    with pytest.raises(ValueError, match="come together"):
        gemv(x, weight, norm=RowNorm(g, 1e-6, residual))
    with pytest.raises(ValueError, match="norm weight"):
        gemv(x, weight, norm=RowNorm(torch.ones(32, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="do not combine"):
        gemv(torch.randn(1, 128, device=DEVICE), weight, silu_mul=True, norm=RowNorm(g, 1e-6))


@pytest.mark.parametrize(("num_rows", "num_experts", "top_k", "renormalize", "with_norm"),
                         [(1, 24, 4, True, False), (3, 10, 2, False, True), (1, 128, 8, True, True)])  # fmt: skip
def test_a_router_gemv_routes_as_route_topk_after_it(
    num_rows: int, num_experts: int, top_k: int, renormalize: bool, with_norm: bool
) -> None:
    """``RouteTopK``: the last program's top-k equals ``route_topk`` on the logits the GEMV
    stored, bit for bit, twice on one ticket (the last program sets it back to zero)."""
    from kernels.linear.gemv_triton import RouteTopK, RowNorm
    from kernels.moe.router_triton import route_topk

    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    weight = torch.randn(num_experts, 96, generator=gen).to(DEVICE)
    config = GemvConfig(block_n=1, block_k=64, num_warps=1)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        x = torch.randn(num_rows, 96, generator=gen).to(DEVICE)
        norm = RowNorm(torch.ones(96, device=DEVICE), 1e-6) if with_norm else None
        weights = torch.empty(num_rows, top_k, dtype=torch.float32, device=DEVICE)
        ids = torch.empty(num_rows, top_k, dtype=torch.int32, device=DEVICE)
        route = RouteTopK(top_k, renormalize, weights, ids, ticket)
        logits = gemv(x, weight, config=config, norm=norm, route=route)
        expected_weights, expected_ids = route_topk(logits, top_k, renormalize)
        assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
        assert ticket.item() == 0


def test_a_router_gemv_refuses_a_top_k_it_cannot_take() -> None:
    from kernels.linear.gemv_triton import RouteTopK

    x, weight = torch.randn(1, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    weights = torch.empty(1, 2, device=DEVICE)
    ids = torch.empty(1, 2, dtype=torch.int32, device=DEVICE)
    split = GemvConfig(block_n=4, block_k=32, split_k=2)
    with pytest.raises(ValueError, match="split_k 1"):
        gemv(x, weight, config=split, route=RouteTopK(2, True, weights, ids, ticket))
    with pytest.raises(ValueError, match="top_k"):
        gemv(x, weight, route=RouteTopK(32, True, weights, ids, ticket))
    with pytest.raises(ValueError, match="routing outputs"):
        gemv(x, weight, route=RouteTopK(2, True, weights.double(), ids, ticket))
