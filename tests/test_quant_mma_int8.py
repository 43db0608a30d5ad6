"""The int8 tensor-core kernel (q8_0 decode batches of 8-32 rows by default; q4_0/q4_1 too when
asked): against the dequantized weight times x rounded as the int8 GEMV rounds it (interpreter
on CPU, wgmma on a GPU), the rows a producer rounded against float rows, the default it is."""

from __future__ import annotations

import pytest
import torch

from kernels.linear.int8_rows_triton import round_rows_int8
from kernels.linear.quant import FORMATS, dequantize
from kernels.linear.quant_matmul_config import INT8_MMA_ROWS, default_config, takes_int8_rows
from kernels.linear.quant_matmul_triton import plane_arguments, quant_matmul, quant_matmul_int8_rows
from kernels.linear.quant_mma_int8_triton import quant_mma_int8
from tests.test_quant_gemv_int8 import ragged_case, rounded
from tests.test_quant_kernels import DEVICE, random_planes


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize(("num_rows", "split_k"), [(3, 1), (17, 2)])
def test_kernel_is_the_dequantized_weight_times_rounded_x(
    name: str, num_rows: int, split_k: int
) -> None:
    # a ragged 16-column tile; a ragged K step and uneven splits
    fmt, size_k = FORMATS[name], 40 * 32
    x, expected, pointers = ragged_case(name, num_rows, seed=split_k)
    out = torch.zeros(expected.shape, device=DEVICE)
    quant_mma_int8(x.to(DEVICE), out, fmt, pointers, size_k, block_m=16, block_n=16, blocks=3,
                   split_k=split_k)  # fmt: skip
    # exact integer dots; the float32 scale products and sums in another order
    scale = expected.abs().max()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5 * scale)
    rows_out = torch.zeros_like(out)  # the same rows, rounded by their producer
    quant_mma_int8(round_rows_int8(x.to(DEVICE)), rows_out, fmt, pointers, size_k, block_m=16,
                   block_n=16, blocks=3, split_k=split_k)  # fmt: skip
    assert torch.equal(rows_out, out)


def test_kernel_refuses_what_it_cannot_multiply() -> None:
    fmt = FORMATS["q4_k"]
    planes = plane_arguments(fmt, {k: v.to(DEVICE) for k, v in random_planes(fmt, 4, 256).items()})
    out = torch.zeros(16, 4, device=DEVICE)
    with pytest.raises(ValueError, match="no int8 tensor-core path"):
        quant_mma_int8(torch.randn(16, 256, device=DEVICE), out, fmt, planes[:3], 256,
                       block_m=16, block_n=16, blocks=2, split_k=1)  # fmt: skip
    q8 = FORMATS["q8_0"]
    planes = plane_arguments(q8, {k: v.to(DEVICE) for k, v in random_planes(q8, 4, 256).items()})
    with pytest.raises(ValueError, match="K=256"):
        quant_mma_int8(round_rows_int8(torch.randn(16, 128, device=DEVICE)), out, q8,
                       planes[:3], 256, block_m=16, block_n=16, blocks=2, split_k=1)  # fmt: skip


def test_q8_0_batches_of_8_to_32_rows_take_it_by_default() -> None:
    bf16, q8_0 = torch.bfloat16, FORMATS["q8_0"]
    low, high = INT8_MMA_ROWS["q8_0"]
    assert (low, high) == (8, 33)
    for rows in (8, 16, 32):
        config = default_config(rows, 4096, 4096, q8_0, bf16)
        assert config.int8_mma and not config.mma
        assert takes_int8_rows(q8_0, rows, 4096, bf16)  # its producer may round the rows
    assert default_config(33, 4096, 4096, q8_0, bf16).mma  # the float tensor cores again
    assert default_config(7, 4096, 4096, q8_0, bf16).int8_x  # the int8 GEMV below
    assert not default_config(8, 4096, 4096, FORMATS["q4_0"], bf16).int8_mma
    assert default_config(16, 4096, 14336, q8_0, bf16).split_k == 4
    assert default_config(8, 64, 256, q8_0, bf16).split_k == 1  # two K steps a split at least


def test_quant_matmul_takes_it_at_eight_rows() -> None:
    fmt = FORMATS["q8_0"]
    planes = random_planes(fmt, 40, 512, seed=5)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(5))
    device_planes = {k: v.to(DEVICE) for k, v in planes.items()}
    got = quant_matmul(x.to(DEVICE), fmt, device_planes, 512)
    expected = rounded(x) @ dequantize(fmt, planes).T
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    rows = round_rows_int8(x.to(DEVICE))
    assert torch.equal(quant_matmul_int8_rows(rows, fmt, device_planes, 512), got)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [8, 16, 32])
@pytest.mark.parametrize(("num_cols", "size_k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_at_llama3_8b_shapes(num_rows: int, num_cols: int, size_k: int) -> None:
    fmt = FORMATS["q8_0"]
    planes = {k: v.cuda() for k, v in random_planes(fmt, num_cols, size_k, seed=2).items()}
    x = torch.randn(num_rows, size_k, device="cuda", dtype=torch.bfloat16)
    assert default_config(num_rows, num_cols, size_k, fmt, x.dtype).int8_mma
    got = quant_matmul(x, fmt, planes, size_k).float()
    expected = rounded(x.float().cpu()).cuda() @ dequantize(fmt, planes).T
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
