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
