"""The dequantize-then-cuBLAS path of quantized linears: the Triton dequantizer against the
torch reference bit for bit, QuantizedLinear above its row threshold against the Triton GEMM
below it, and the shared scratch (interpreter on CPU, llama3-8b shapes and graphs on a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.quant.linear as linear_module
import engine.quant.scratch as scratch_module
from engine import LLM, SamplingParams
from engine.quant.linear import QuantizedLinear, allocate_dequant_scratch
from engine.quant.plan import swap_in_quantized
from engine.quant.scratch import DequantScratch
from kernels.linear.quant import FORMATS, dequantize
from kernels.linear.quant_dequant_triton import dequant_matmul, dequantize_into
from kernels.linear.quant_matmul_config import MMA_ROWS, uses_scaled_mm
from tests.test_quant_kernels import DEVICE, random_planes

CUDA = DEVICE == "cuda"


def expected_weight(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``reference.to(dtype)``; the interpreter (Triton 3.9) truncates fp32 -> bf16 casts
    where the GPU rounds to nearest even, so off the GPU the truncated bits are expected."""
    if dtype != torch.bfloat16 or CUDA:
        return reference.to(dtype)
    return (reference.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)


def on_device(planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: plane.to(DEVICE) for name, plane in planes.items()}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_into_writes_the_reference_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    # 20 rows: a ragged row tile of 16; K not a multiple of the 256-column tile where it can
    num_rows, size_k = 20, 768 if fmt.block_size == 256 else 800
    planes = random_planes(fmt, num_rows, size_k, seed=3)
    out = torch.full((num_rows, size_k), float("nan"), dtype=dtype, device=DEVICE)
    assert dequantize_into(fmt, on_device(planes), out) is out
    assert torch.equal(out.cpu(), expected_weight(dequantize(fmt, planes), dtype))


@pytest.mark.parametrize("name", ["q4_1", "q6_k"])
def test_dequant_matmul_takes_a_weight_larger_than_its_scratch_in_row_slices(name: str) -> None:
    fmt = FORMATS[name]
    planes = random_planes(fmt, 24, 256, seed=4)
    gen = torch.Generator().manual_seed(4)
    x, bias = torch.randn(5, 256, generator=gen), torch.randn(24, generator=gen)
    expected = F.linear(x, dequantize(fmt, planes), bias)
    scratch = torch.empty(10 * 256, device=DEVICE)  # slices of 10, 10 and 4 rows
    out = torch.empty(5, 24, device=DEVICE)
    got = dequant_matmul(
        x.to(DEVICE), fmt, on_device(planes), scratch, bias=bias.to(DEVICE), out=out
    )
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    with pytest.raises(ValueError, match="cannot hold a row"):
        dequant_matmul(x.to(DEVICE), fmt, on_device(planes), scratch[:100])


def quantized_linear(
    name: str, bias: bool, num_rows: int = 24, size_k: int = 256
) -> QuantizedLinear:
    fmt = FORMATS[name]
    layer = QuantizedLinear(size_k, num_rows, fmt, bias=bias, device=DEVICE)
    for plane_name, plane in random_planes(fmt, num_rows, size_k, seed=5).items():
        layer.planes()[plane_name].copy_(plane)
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(num_rows, generator=torch.Generator().manual_seed(5)))
    return layer


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_linear_above_the_threshold_equals_the_triton_gemm(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = quantized_linear(name, bias=name == "q8_0")
    # 40 rows: the Triton GEMM (past the GEMVs' 8 rows and q8_0's int8 tensor cores' 32)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    below = layer.kernel_forward(x)
    assert not layer.takes_dequant_gemm(x)
    monkeypatch.setattr(linear_module, "DEQUANT_GEMM_MIN_ROWS", 10)
    assert layer.takes_dequant_gemm(x)
    out = torch.empty(40, 24, device=DEVICE)
    above = layer.kernel_forward(x, out=out)
    assert above.data_ptr() == out.data_ptr()
    assert layer.scratch.allocated_bytes == 24 * 256 * 4
    torch.testing.assert_close(above, below, rtol=1e-5, atol=1e-5 * below.abs().max().item())


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96, bias=False)
        self.head = nn.Linear(96, 200, bias=False)


def test_a_models_quantized_linears_share_one_scratch_sized_for_the_largest_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scratch_module, "MAX_SLICE_ROWS", 128)  # the head's 200 rows: 2 slices
    model = TwoLinears()
    swap_in_quantized(model, {"up": FORMATS["q8_0"], "head": FORMATS["q4_0"]})
    assert isinstance(model.up, QuantizedLinear) and isinstance(model.head, QuantizedLinear)
    assert model.up.scratch is model.head.scratch
    assert model.head.scratch.num_elements == 128 * 96  # > the up's 96 * 64
    # steps of fewer rows never dequantize: nothing is allocated; 16-bit steps of these
    # formats take the tensor-core kernel up to a higher bound
    threshold = linear_module.DEQUANT_GEMM_MIN_ROWS
    mma_threshold = min(MMA_ROWS["q8_0"][1], MMA_ROWS["q4_0"][1])  # the first to dequantize
    cpu = torch.device("cpu")
    assert allocate_dequant_scratch(model, threshold - 1, torch.float32, cpu) == 0
    assert allocate_dequant_scratch(model, mma_threshold - 1, torch.bfloat16, cpu) == 0
    num_bytes = allocate_dequant_scratch(model, mma_threshold, torch.bfloat16, cpu)
    assert num_bytes == 128 * 96 * 2
    buffer = model.up.scratch.buffer(torch.bfloat16, torch.device("cpu"))
    assert model.head.scratch.buffer(torch.bfloat16, torch.device("cpu")) is buffer  # once
    with pytest.raises(RuntimeError, match="after the buffer exists"):
        model.up.scratch.reserve(1000, 1000)


# -- real sizes on a GPU ----------------------------------------------------------------------

LLAMA3_8B_SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336)]  # qkv, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(("num_cols", "size_k"), LLAMA3_8B_SHAPES)
def test_dequantize_into_is_exact_at_llama3_8b_shapes(
    name: str, num_cols: int, size_k: int
) -> None:
    fmt = FORMATS[name]
    planes = {k: v.cuda() for k, v in random_planes(fmt, num_cols, size_k).items()}
    out = torch.empty(num_cols, size_k, dtype=torch.bfloat16, device="cuda")
    dequantize_into(fmt, planes, out)
    assert torch.equal(out, dequantize(fmt, planes).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k", "q6_k", "fp8"])
def test_quantized_linear_dequantizes_for_cublas_at_prefill_rows(name: str) -> None:
    layer = quantized_linear(name, bias=False, num_rows=6144, size_k=4096)
    x = torch.randn(600, 4096, device="cuda").bfloat16()
    if uses_scaled_mm(x, layer.fmt, 6144, 4096):  # fp8 on Hopper: torch._scaled_mm stays
        assert not layer.takes_dequant_gemm(x)
        return
    assert layer.takes_dequant_gemm(x)  # 600 rows >= DEQUANT_GEMM_MIN_ROWS
    expected = x.float() @ layer.dequantized_weight().T
    got = layer(x).float()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.gpu
def test_dequant_path_replays_in_a_cuda_graph() -> None:
    layer = quantized_linear("q4_k", bias=True, num_rows=4096, size_k=4096)
    layer.bias.data = layer.bias.data.bfloat16()
    x = torch.randn(1024, 4096, device="cuda").bfloat16()
    out = torch.empty(1024, 4096, device="cuda", dtype=torch.bfloat16)
    # the engine's device has no index, x's has: one buffer for both
    num_bytes = allocate_dequant_scratch(layer, 1024, torch.bfloat16, torch.device("cuda"))
    assert num_bytes == 4096 * 4096 * 2
    layer(x, out=out)  # warm-up: the kernels compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    expected = layer(x.clone()).float()  # eager
    scale = expected.abs().max().item()  # a stale output would be another x's, far off
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * scale)
    assert layer.scratch.allocated_bytes == num_bytes


@pytest.mark.gpu
def test_first_use_inside_a_capture_is_refused() -> None:
    scratch = DequantScratch()
    scratch.reserve(16, 64)
    graph = torch.cuda.CUDAGraph()
    ones = torch.ones(4, device="cuda")
    with torch.cuda.graph(graph):
        ones.add_(1)  # the graph is not empty
        with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
            scratch.buffer(torch.bfloat16, torch.device("cuda"))


@pytest.mark.gpu
def test_engine_prefills_through_the_scratch_it_allocated_before_profiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = dict(device="cuda", max_seqs=16, max_model_len=1024, pa_memory_mb=512)
    # no prefix cache: the second generate computes what the first did (a hit would shorten
    # its prefills, whose row count picks the kernel and with it the sums' order)
    llm = LLM("dummy:smollm2-135m", quantization="q4_0", prefix_caching=False, **settings)
    linears = [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len({id(linear.scratch) for linear in linears}) == 1
    scratch_bytes = linears[0].scratch.allocated_bytes
    assert scratch_bytes > 0  # by the runtime, before its profile
    tokens = list(range(100, 800))  # 700 rows: dequantize + cuBLAS (eager)
    dequantized = llm.engine.runner.teacher_forced_logits(tokens).cpu()
    monkeypatch.setattr(linear_module, "DEQUANT_GEMM_MIN_ROWS", 1 << 30)
    no_dequant = {name: (first, 1 << 30) for name, (first, _) in MMA_ROWS.items()}
    monkeypatch.setattr(linear_module, "MMA_ROWS", no_dequant)
    gemm = llm.engine.runner.teacher_forced_logits(tokens).cpu()  # the tensor-core kernel
    relative = (dequantized - gemm).abs().mean() / gemm.std(dim=-1).mean()
    assert relative.item() < 0.05  # bf16 weights either way; the sums' order differs
    monkeypatch.undo()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [tokens, tokens[:600]]  # prefill steps replay piecewise graphs of the path
    first, second = (llm.generate(prompts, greedy, use_tqdm=False) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert linears[0].scratch.allocated_bytes == scratch_bytes  # the runtime's, never another
    del llm
    gc.collect()
