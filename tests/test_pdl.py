"""Programmatic dependent launch (kernels/pdl.py): where it is on, and that a chain of
kernels that launch early still reads what the kernel before wrote (in a CUDA graph too)."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise.norm_triton import fused_add_rms_norm
from kernels.linear.quant import FORMATS, quantize
from kernels.linear.quant_matmul_triton import quant_matmul
from kernels.pdl import PDL_ENV, pdl_launch, uses_pdl


def test_cpu_tensors_launch_the_ordinary_way() -> None:
    assert pdl_launch(torch.zeros(1)) == {"PDL": False}


@pytest.mark.gpu
def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert uses_pdl(x) == hopper
    monkeypatch.setenv(PDL_ENV, "0")
    assert not uses_pdl(x) and pdl_launch(x) == {"PDL": False}


def _chain(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           planes: dict[str, torch.Tensor], num_links: int) -> torch.Tensor:  # fmt: skip
    """norm -> 4-bit GEMV, ``num_links`` times: each kernel reads the one before's output
    (and the norm the residual the norm before it wrote)."""
    for _ in range(num_links):
        normed, residual = fused_add_rms_norm(x, residual, weight, 1e-6)
        x = quant_matmul(normed, FORMATS["q4_0"], planes, x.shape[1])
    return x


@pytest.mark.gpu
def test_a_chain_of_early_launches_gives_the_ordinary_launches_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = 4096
    planes = quantize(torch.randn(size, size, device="cuda", generator=gen) * 0.02,
                      FORMATS["q4_0"])  # fmt: skip
    weight = torch.rand(size, device="cuda", generator=gen).bfloat16() + 0.5
    x = torch.randn(1, size, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(1, size, device="cuda", generator=gen).bfloat16()

    monkeypatch.setenv(PDL_ENV, "0")
    expected = _chain(x, residual.clone(), weight, planes, 24)
    monkeypatch.setenv(PDL_ENV, "1")
    assert torch.equal(_chain(x, residual.clone(), weight, planes, 24), expected)  # eager
    graph_residual = residual.clone()
    _chain(x, graph_residual.clone(), weight, planes, 24)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, graph_residual, weight, planes, 24)
    for _ in range(20):
        graph_residual.copy_(residual)
        graph.replay()
        assert torch.equal(out, expected)
