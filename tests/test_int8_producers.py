"""The kernels that produce a quantized linear's input round it to int8 themselves where the
linear takes the int8 GEMV (RMSNorm, residual-add + RMSNorm, SiLU-and-mul): their blocks are
the rounding kernel's bits, the GEMV gives the same output from them, and a decoder layer
launches the rounding kernel only for o_proj (interpreter on CPU; the GPU test at real
sizes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kernels.linear.int8_rows_triton as int8_gemv
from engine.attention.backend import LayerOps, TritonAttentionBackend
from engine.distributed.group import TensorParallelGroup
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from engine.models.layers import DecoderLayer
from engine.quant.linear import QuantizedLinear
from kernels.elementwise.activation_triton import silu_and_mul, silu_and_mul_int8
from kernels.elementwise.norm_triton import (
    fused_add_rms_norm,
    fused_add_rms_norm_int8,
    rms_norm,
    rms_norm_int8,
)
from kernels.linear.int8_rows_triton import Int8Rows, round_rows_int8
from kernels.linear.quant import FORMATS
from kernels.linear.quant_gemv_int8_triton import quant_gemv_int8
from kernels.linear.quant_matmul_config import default_int8_gemv_config, takes_int8_rows
from kernels.linear.quant_matmul_triton import plane_arguments, quant_matmul, quant_matmul_int8_rows
from tests.test_quant_kernels import DEVICE, random_planes

CUDA = DEVICE == "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_same_rows(got: Int8Rows, expected: Int8Rows) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.xq, expected.xq)
    assert torch.equal(got.xd, expected.xd)
    assert torch.equal(got.xs, expected.xs)


@pytest.mark.parametrize("dtype", DTYPES)
# 576: a row padded to 1,024 (18 of 32 blocks) in three programs, the last ragged
@pytest.mark.parametrize("size", [64, 96, 576])
def test_norms_round_as_the_rounding_kernel(dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    x = (torch.randn(3, size, generator=gen) * 3).to(dtype).to(DEVICE)
    weight = torch.randn(size, generator=gen).to(dtype).to(DEVICE)
    assert_same_rows(rms_norm_int8(x, weight, 1e-6), round_rows_int8(rms_norm(x, weight, 1e-6)))
    residual = torch.randn(3, size, generator=gen).to(dtype).to(DEVICE)
    fused_residual = residual.clone()
    normed, residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    before = fused_residual.clone()
    rows, total = fused_add_rms_norm_int8(x, fused_residual, weight, 1e-6)
    assert torch.equal(total, residual)  # the sum, as the float kernel leaves it in place
    assert torch.equal(fused_residual, before)  # a new tensor: every chunk's program reads it
    assert_same_rows(rows, round_rows_int8(normed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 1088])  # 1,088: five programs a row, the last ragged
def test_silu_and_mul_rounds_as_the_rounding_kernel(dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    gate_up = (torch.randn(2, 2 * size, generator=gen) * 4).to(dtype).to(DEVICE)
    assert_same_rows(silu_and_mul_int8(gate_up), round_rows_int8(silu_and_mul(gate_up)))


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 7])
def test_producers_at_llama3_8b_sizes(num_rows: int) -> None:
    """bf16 rows of 4,096 (16 programs a row) and an MLP of 14,336: bit for bit on the GPU,
    where the statistics are a parallel reduction."""
    x = torch.randn(num_rows, 4096, device="cuda", dtype=torch.bfloat16) * 2
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    assert_same_rows(rms_norm_int8(x, weight, 1e-5), round_rows_int8(rms_norm(x, weight, 1e-5)))
    residual = torch.randn_like(x)
    rows, total = fused_add_rms_norm_int8(x, residual, weight, 1e-5)
    normed, residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual)
    assert_same_rows(rows, round_rows_int8(normed))
    gate_up = torch.randn(num_rows, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    assert_same_rows(silu_and_mul_int8(gate_up), round_rows_int8(silu_and_mul(gate_up)))


def test_rows_that_cannot_be_blocks_are_refused() -> None:
    weight = torch.ones(48, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_int8(torch.randn(2, 48, device=DEVICE), weight, 1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        silu_and_mul_int8(torch.randn(2, 96, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_int8(torch.randn(2, 3, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_rounded_rows_multiply_as_float_rows(name: str) -> None:
    fmt = FORMATS[name]
    num_rows = 2  # every format takes the int8 GEMV at two rows
    num_cols, size_k = 20, 8 * 32
    planes = {k: v.to(DEVICE) for k, v in random_planes(fmt, num_cols, size_k, seed=3).items()}
    x = torch.randn(num_rows, size_k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert takes_int8_rows(fmt, num_rows, size_k, x.dtype)
    rows = round_rows_int8(x)
    expected = quant_matmul(x, fmt, planes, size_k)  # rounds x by a kernel of its own
    assert torch.equal(quant_matmul_int8_rows(rows, fmt, planes, size_k), expected)
    cfg = default_int8_gemv_config(num_rows, num_cols, size_k, fmt)
    pointers = plane_arguments(fmt, planes)[:3]
    out = torch.zeros(num_rows, num_cols, device=DEVICE)
    quant_gemv_int8(rows, out, fmt, pointers, size_k, block_n=cfg.block_n, blocks=8, split_k=1)
    torch.testing.assert_close(out.to(expected.dtype), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="K=128"):  # rows of another width
        quant_gemv_int8(rows, out, fmt, pointers, 128, block_n=1, blocks=4, split_k=1)


def test_rows_that_take_no_int8_kernel_are_refused() -> None:
    fmt = FORMATS["q4_0"]
    planes = {k: v.to(DEVICE) for k, v in random_planes(fmt, 8, 64, seed=1).items()}
    rows = round_rows_int8(torch.randn(6, 64, device=DEVICE))
    assert not takes_int8_rows(fmt, 6, 64, torch.bfloat16)  # tensor cores from 5 rows
    assert not takes_int8_rows(FORMATS["q8_0"], 1, 64, torch.bfloat16)  # the float GEMV
    assert not takes_int8_rows(FORMATS["q8_0"], 33, 64, torch.bfloat16)  # float tensor cores
    with pytest.raises(ValueError, match="take no int8 kernel"):
        quant_matmul_int8_rows(rows, fmt, planes, 64)


# -- a decoder layer ---------------------------------------------------------------------------


def quantized_layer(name: str, dtype: torch.dtype, seed: int) -> DecoderLayer:
    """The tiny llama's layer 0 (hidden 64, MLP 128) with its four linears in ``name``."""
    arch = ModelArch.from_hf_config(dummy_hf_config("tiny"))
    gen = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(arch, 0, TritonAttentionBackend(), TensorParallelGroup())
    for module in (layer.self_attn, layer.mlp):
        for child, old in list(module.named_children()):
            if not isinstance(old, torch.nn.Linear):
                continue
            new = QuantizedLinear(old.in_features, old.out_features, FORMATS[name])
            new.load_rows(0, old.out_features, torch.randn(old.weight.shape, generator=gen))
            setattr(module, child, new)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = torch.rand(norm.weight.shape, generator=gen) + 0.5
    for param in layer.parameters():  # not the planes: their scales keep their own dtype
        param.data = param.data.to(dtype)
    return layer


@pytest.fixture
def kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Quantized linears take their CUDA path on CPU tensors too (the interpreter runs the
    kernels), and the rows the rounding kernel rounds are counted."""
    if not CUDA:

        def forward(
            self: QuantizedLinear, x: torch.Tensor | Int8Rows, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            if isinstance(x, Int8Rows):
                return original_forward(self, x, out)
            return self.kernel_forward(x, out)

        def takes(self: QuantizedLinear, x: torch.Tensor) -> bool:
            return takes_int8_rows(self.fmt, x.shape[0], self.in_features, x.dtype)

        original_forward = QuantizedLinear.forward
        monkeypatch.setattr(QuantizedLinear, "forward", forward)
        monkeypatch.setattr(QuantizedLinear, "takes_int8_rows", takes)
    rounded: list[int] = []
    original_round = int8_gemv.round_rows_int8

    def counting_round(x: torch.Tensor) -> Int8Rows:
        rounded.append(x.shape[1])
        return original_round(x)

    monkeypatch.setattr(int8_gemv, "round_rows_int8", counting_round)
    yield rounded


def run_layer(
    layer: DecoderLayer, x: torch.Tensor, attn: torch.Tensor, first: bool
) -> list[torch.Tensor]:
    """The layer's two halves around attention (``attn`` stands in for attention's output)."""
    residual = None if first else x.flip(0).clone()
    q, k, v, residual = layer.pre_attention(x, residual)
    out, residual = layer.post_attention(attn, residual.clone())
    return [q, k, v, out, residual]


# first: layer 0, whose input norm has no residual to add (~15 s each in the interpreter);
# q8_0 at 8 rows: the int8 tensor cores
@pytest.mark.parametrize(
    ("name", "num_rows", "first"), [("q4_0", 1, False), ("q8_0", 2, True), ("q8_0", 8, False)]
)
def test_a_decoder_layer_rounds_in_its_norms_and_activation(
    kernels_on_cpu: list[int], name: str, num_rows: int, first: bool
) -> None:
    dtype = torch.bfloat16 if CUDA else torch.float32
    layer = quantized_layer(name, dtype, seed=num_rows).to(DEVICE)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_rows, 64, generator=gen).to(dtype).to(DEVICE)
    attn = torch.randn(num_rows, 64, generator=gen).to(dtype).to(DEVICE)
    fused = run_layer(layer, x, attn, first)
    assert kernels_on_cpu == [64]  # o_proj's input (attention's output) only
    kernels_on_cpu.clear()
    ops = layer.self_attn.backend.ops  # the same kernels without their int8 variants
    float_only = LayerOps(ops.rms_norm, ops.fused_add_rms_norm, ops.silu_and_mul)
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
        module.ops = float_only
    separate = run_layer(layer, x, attn, first)
    assert kernels_on_cpu == [64, 64, 64, 128]  # qkv, o, gate_up, down: each rounds its own
    for got, expected in zip(fused, separate, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("num_rows", [5, 8])
def test_rows_past_the_int8_gemv_stay_float(kernels_on_cpu: list[int], num_rows: int) -> None:
    layer = quantized_layer("q4_0", torch.float32, seed=0).to(DEVICE)
    x = torch.randn(num_rows, 64, device=DEVICE)
    q, *_ = layer.pre_attention(x, None)
    assert q.shape == (num_rows, 4, 16) and kernels_on_cpu == []  # tensor cores or the GEMM
