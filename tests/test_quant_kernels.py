"""Quantized weight formats: the torch reference against gguf-py, the quantizers against
ggml's rounding, and the Triton matmuls against the reference (interpreter on CPU, real
sizes on a GPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels.linear.common import add_split_k_planes
from kernels.linear.fp8_rows_triton import fp8_scaled_mm, quantize_rows_fp8_triton
from kernels.linear.quant import (
    FORMATS,
    FP8_MAX,
    GGML_BLOCK_FIELDS,
    IN_SITU_FORMATS,
    QuantFormat,
    dequantize,
    planes_from_ggml,
    quantize,
    quantize_rows_fp8,
)
from kernels.linear.quant_gemv_blocked_triton import BLOCKED_FORMATS
from kernels.linear.quant_matmul_config import (
    MAX_GEMV_ROWS,
    MMA_ROWS,
    QuantMatmulConfig,
    default_config,
    default_gemm_config,
    default_gemv_config,
    default_mma_config,
    uses_scaled_mm,
)
from kernels.linear.quant_matmul_triton import quant_matmul
from kernels.linear.quant_mma_triton import MMA_FORMATS

GGML_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
SCALE_FIELDS = ("d", "dmin", "m")
# The small cases run where the kernels can: the interpreter on a CPU-only machine, the GPU
# where there is one (Triton cannot launch on CPU tensors without the interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_ggml_blocks(name: str, num_rows: int, size_k: int, seed: int = 0) -> np.ndarray:
    """Random ggml blocks: fp16 scales of a weight's size, every other byte uniform."""
    rng = np.random.default_rng(seed)
    num_blocks = size_k // FORMATS[name].block_size
    fields = []
    for field, size in GGML_BLOCK_FIELDS[name]:
        if field in SCALE_FIELDS:
            scale = rng.standard_normal((num_rows, num_blocks, 1)) * 0.01
            fields.append(scale.astype(np.float16).view(np.uint8))
        else:
            fields.append(rng.integers(0, 256, (num_rows, num_blocks, size), dtype=np.uint8))
    return np.concatenate(fields, axis=-1).reshape(num_rows, -1)


def random_planes(
    fmt: QuantFormat, num_rows: int, size_k: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    if fmt.name == "fp8":
        gen = torch.Generator().manual_seed(seed)
        return quantize(torch.randn(num_rows, size_k, generator=gen), fmt)
    return planes_from_ggml(random_ggml_blocks(fmt.name, num_rows, size_k, seed), fmt)


# -- the reference and the quantizers ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_reference_dequantizes_like_gguf_py(name: str) -> None:
    size_k = 512
    raw = random_ggml_blocks(name, 6, size_k)
    expected = gguf_dequantize(raw, GGML_TYPES[name]).reshape(6, size_k)
    got = dequantize(FORMATS[name], planes_from_ggml(raw, FORMATS[name]))
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_quantize_writes_ggml_bits(name: str) -> None:
    weights = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    expected = planes_from_ggml(gguf_quantize(weights, GGML_TYPES[name]), FORMATS[name])
    got = quantize(torch.from_numpy(weights), FORMATS[name])
    assert got.keys() == expected.keys()
    for plane, values in expected.items():
        assert torch.equal(got[plane].view(torch.uint8), values.view(torch.uint8)), plane


def test_fp8_keeps_each_row_within_its_scale() -> None:
    weights = torch.randn(4, 64) * torch.tensor([[1e-3], [1.0], [30.0], [0.0]])
    planes = quantize(weights, FORMATS["fp8"])
    assert planes["scale"].shape == (4, 1)
    error = (dequantize(FORMATS["fp8"], planes) - weights).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value, at most amax/16 per row
    assert (error <= weights.abs().amax(dim=1, keepdim=True) / 16 + 1e-12).all()
    assert planes["w"][3].float().abs().sum() == 0


def test_bits_per_weight_match_ggml() -> None:
    bits = {name: FORMATS[name].bits_per_weight() for name in GGML_TYPES}
    assert bits == {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q4_k": 4.5, "q6_k": 6.5625}


def test_quantize_refuses_k_quants_and_ragged_rows() -> None:
    assert "q4_k" not in IN_SITU_FORMATS
    with pytest.raises(ValueError, match="only from GGUF"):
        quantize(torch.zeros(2, 256), FORMATS["q4_k"])
    with pytest.raises(ValueError, match="whole blocks"):
        quantize(torch.zeros(2, 48), FORMATS["q8_0"])


# -- the Triton kernels (interpreted on CPU) ---------------------------------------------------


def run_kernel(
    x: torch.Tensor, fmt: QuantFormat, planes: dict[str, torch.Tensor], size_k: int,
    config: QuantMatmulConfig,
) -> torch.Tensor:  # fmt: skip
    """``quant_matmul`` on DEVICE, the result back on the CPU."""
    on_device = {name: plane.to(DEVICE) for name, plane in planes.items()}
    return quant_matmul(x.to(DEVICE), fmt, on_device, size_k, config=config).cpu()


CPU_CASES = [  # (rows of x, config): both GEMVs, a K split, the GEMM with ragged tiles
    (1, QuantMatmulConfig(block_n=8, block_k=256)),
    (2, QuantMatmulConfig(block_n=8, block_k=256, blocked=False)),
    (3, QuantMatmulConfig(block_n=16, block_k=128, split_k=2)),
    (20, QuantMatmulConfig(block_m=16, block_n=16, block_k=32)),
]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(("num_rows", "config"), CPU_CASES)
def test_quant_matmul_matches_the_reference(
    name: str, num_rows: int, config: QuantMatmulConfig
) -> None:
    fmt = FORMATS[name]
    num_cols, size_k = 24, 512  # 24 columns: a ragged last tile of 16
    planes = random_planes(fmt, num_cols, size_k, seed=num_rows)
    x = torch.randn(num_rows, size_k, generator=torch.Generator().manual_seed(num_rows))
    expected = x @ dequantize(fmt, planes).T
    got = run_kernel(x, fmt, planes, size_k, config)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("name", BLOCKED_FORMATS)
@pytest.mark.parametrize("split_k", [1, 2])
def test_blocked_gemv_takes_k_in_partial_steps(name: str, split_k: int) -> None:
    fmt = FORMATS[name]
    size_k = 160  # 5 blocks of 32, in steps of 2 blocks
    planes = random_planes(fmt, 12, size_k, seed=split_k)
    x = torch.randn(5, size_k, generator=torch.Generator().manual_seed(7))
    expected = x @ dequantize(fmt, planes).T
    config = QuantMatmulConfig(block_n=8, block_k=64, split_k=split_k)
    got = run_kernel(x, fmt, planes, size_k, config)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_k_quant_gemv_takes_super_blocks_in_partial_steps(name: str, split_k: int) -> None:
    fmt = FORMATS[name]
    size_k = 768  # 3 super-blocks, in steps of 2
    planes = random_planes(fmt, 12, size_k, seed=split_k)
    x = torch.randn(3, size_k, generator=torch.Generator().manual_seed(8))
    expected = x @ dequantize(fmt, planes).T
    config = QuantMatmulConfig(block_n=8, block_k=512, split_k=split_k)
    got = run_kernel(x, fmt, planes, size_k, config)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


def test_fp8_scaled_mm_rounds_only_the_activations_beyond_the_weights() -> None:
    gen = torch.Generator().manual_seed(5)
    planes = quantize(torch.randn(48, 64, generator=gen), FORMATS["fp8"])
    x = torch.randn(32, 64, generator=gen).bfloat16()
    x_fp8, x_scale = quantize_rows_fp8(x)
    assert x_scale.shape == (32, 1)
    expected = (x_fp8.float() * x_scale) @ dequantize(FORMATS["fp8"], planes).T
    if DEVICE == "cpu" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    on_device = {name: plane.to(DEVICE) for name, plane in planes.items()}
    got = fp8_scaled_mm(x.to(DEVICE), on_device).cpu()  # on the CPU: torch's CPU _scaled_mm
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max())
    assert not uses_scaled_mm(x, FORMATS["fp8"], 48, 64)  # CPU tensors: the Triton path


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU _scaled_mm takes per-row scales; 2.11's takes per-tensor ones only."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)  # fmt: skip
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(
    ("num_rows", "size_k", "dtype"),
    [(5, 96, torch.bfloat16), (3, 5000, torch.float16), (2, 64, torch.float32)],
)
def test_fp8_row_quantization_kernel_gives_the_references_bytes(
    num_rows: int, size_k: int, dtype: torch.dtype
) -> None:
    """One program per row, the row in registers (96, 64) or read twice (5000 > 4096); a row
    of zeros keeps scale 1, a row with one huge value takes its own scale. The interpreter's
    own cast to e4m3 rounds unlike the GPU's (subnormals, carries into the exponent), so on
    the reference's values before the cast go through a Triton cast on the same device; the
    GPU test below also compares against torch's cast."""
    x = torch.randn(num_rows, size_k, generator=torch.Generator().manual_seed(11)).to(dtype)
    x = x.to(DEVICE)
    x[1] = 0.0
    x[0, size_k // 2] = 3e4
    x_fp8, scale = quantize_rows_fp8_triton(x)
    _, ref_scale = quantize_rows_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (num_rows, 1)
    assert torch.equal(scale, ref_scale) and scale[1].item() == 1.0
    before_cast = (x.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(x_fp8.view(torch.uint8), triton_cast_to_e4m3(before_cast).view(torch.uint8))


@triton.jit
def _cast_to_e4m3_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=offs < N)


def triton_cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    flat = x.flatten().contiguous()
    out = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=x.device)
    _cast_to_e4m3_kernel[(triton.cdiv(flat.numel(), 256),)](flat, out, flat.numel(), BLOCK=256)
    return out.view(x.shape)


def test_fp8_row_quantization_rejects_a_strided_row() -> None:
    with pytest.raises(ValueError, match="last stride 1"):
        quantize_rows_fp8_triton(torch.zeros(4, 8).t())


@pytest.mark.gpu
def test_fp8_row_quantization_kernel_on_gpu_gives_the_references_bytes() -> None:
    x = torch.randn(300, 14336, device="cuda").bfloat16() * 3
    x[7] = 0
    x_fp8, scale = quantize_rows_fp8_triton(x)
    ref_fp8, ref_scale = quantize_rows_fp8(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))


@pytest.mark.gpu
def test_fp8_rows_take_the_gemv_then_the_tensor_core_kernel_then_scaled_mm() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_mm with row-wise scales needs Hopper")
    fp8, first, scaled = FORMATS["fp8"], *MMA_ROWS["fp8"]
    for rows in (1, first, scaled - 1, scaled):
        x = torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
        mma = default_config(rows, 4096, 4096, fp8, x.dtype).mma
        assert (mma, uses_scaled_mm(x, fp8, 4096, 4096)) == (first <= rows < scaled, rows >= scaled)


@pytest.mark.parametrize(("num_rows", "block_m", "split_k"), [(5, 16, 1), (20, 16, 3)])
def test_fp8_tensor_core_kernel_gives_the_w8a8_product(
    num_rows: int, block_m: int, split_k: int
) -> None:
    """x rounded per row to e4m3 by the row kernel (the interpreter's cast, see above), times
    the e4m3 weight, both scales applied; a ragged column tile, K steps past the end."""
    fmt = FORMATS["fp8"]
    num_cols, size_k = 40, 200
    gen = torch.Generator().manual_seed(num_rows)
    planes = quantize(torch.randn(num_cols, size_k, generator=gen), fmt)
    x = torch.randn(num_rows, size_k, generator=gen).bfloat16()
    x_fp8, x_scale = (t.cpu() for t in quantize_rows_fp8_triton(x.to(DEVICE)))
    expected = (x_fp8.float() * x_scale) @ dequantize(fmt, planes).T
    config = QuantMatmulConfig(block_m=block_m, block_n=32, block_k=64, split_k=split_k,
                               mma=True)  # fmt: skip
    got = run_kernel(x, fmt, planes, size_k, config)
    assert got.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


MMA_CASES = [  # (rows, row tile, K split): one ragged row tile; two row tiles and a split
    (5, 16, 1),
    (20, 16, 2),
]


@pytest.mark.parametrize("name", MMA_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_rows", "block_m", "split_k"), MMA_CASES)
def test_tensor_core_kernels_match_the_reference(
    name: str, dtype: torch.dtype, num_rows: int, block_m: int, split_k: int
) -> None:
    fmt = FORMATS[name]
    num_cols, size_k = 40, 160  # a ragged column tile of 32; 5 blocks in steps of 2
    planes = random_planes(fmt, num_cols, size_k, seed=num_rows)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, size_k, generator=gen).to(dtype)
    expected = x.float() @ dequantize(fmt, planes).T
    config = QuantMatmulConfig(block_m=block_m, block_n=32, block_k=64, split_k=split_k,
                               mma=True)  # fmt: skip
    got = run_kernel(x, fmt, planes, size_k, config)
    assert got.dtype == dtype
    # the 16-bit rounding of each weight and of the output
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_tensor_core_kernel_refuses_float32_activations_and_k_quants() -> None:
    config = QuantMatmulConfig(block_m=16, block_n=16, block_k=64, mma=True)
    planes = random_planes(FORMATS["q4_0"], 16, 64)
    with pytest.raises(ValueError, match="x in one of"):
        quant_matmul(torch.zeros(4, 64), FORMATS["q4_0"], planes, 64, config=config)
    planes = random_planes(FORMATS["q4_k"], 16, 256)
    with pytest.raises(ValueError, match="no tensor-core path"):
        quant_matmul(torch.zeros(4, 256).bfloat16(), FORMATS["q4_k"], planes, 256, config=config)


def test_default_config_takes_tensor_cores_from_a_few_rows_of_16_bit_activations() -> None:
    bf16, q4_0, q8_0 = torch.bfloat16, FORMATS["q4_0"], FORMATS["q8_0"]
    assert not default_config(2, 4096, 4096, q4_0, bf16).mma  # the GEMV
    five = default_config(5, 4096, 4096, q4_0, bf16)  # below: the int8-activation GEMV
    assert five.mma and (five.block_m, five.block_n, five.split_k) == (16, 64, 4)
    assert not default_config(4, 4096, 4096, q8_0, bf16).mma
    assert default_config(8, 4096, 4096, q8_0, bf16).int8_mma  # int8 tensor cores to 32 rows
    assert default_config(33, 4096, 4096, q8_0, bf16).mma
    assert not default_config(64, 4096, 4096, q4_0, torch.float32).mma  # the GEMM
    assert not default_config(64, 4096, 4096, FORMATS["q4_k"], bf16).mma
    wide = default_config(100, 28672, 4096, q4_0, bf16)  # gate_up: 128 columns, no split
    assert (wide.block_m, wide.block_n, wide.split_k) == (128, 128, 1)
    small_batch = default_config(16, 28672, 4096, q4_0, bf16)  # ... but not at 16 rows
    assert (small_batch.block_n, small_batch.split_k) == (64, 4)
    assert default_config(16, 1536, 256, q4_0, bf16).split_k == 2  # two K steps a split
    assert default_config(16, 1536, 128, q4_0, bf16).split_k == 1


def test_quant_matmul_writes_a_given_buffer_in_bf16() -> None:
    fmt = FORMATS["q4_0"]
    planes = random_planes(fmt, 16, 64)
    x = torch.randn(2, 64).bfloat16()
    out = torch.empty(2, 16, dtype=torch.bfloat16, device=DEVICE)
    config = QuantMatmulConfig(block_n=8, block_k=64)
    planes = {name: plane.to(DEVICE) for name, plane in planes.items()}
    got = quant_matmul(x.to(DEVICE), fmt, planes, 64, config=config, out=out)
    assert got.data_ptr() == out.data_ptr()
    planes = {name: plane.cpu() for name, plane in planes.items()}
    expected = x.float() @ dequantize(fmt, planes).T
    torch.testing.assert_close(
        out.cpu().float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max()
    )


def test_quant_matmul_refuses_a_wrong_width_and_missing_planes() -> None:
    fmt = FORMATS["q8_0"]
    planes = random_planes(fmt, 8, 64)
    with pytest.raises(ValueError, match=r"x \[M, 64\]"):
        quant_matmul(torch.zeros(1, 32), fmt, planes, 64)
    with pytest.raises(ValueError, match="needs planes"):
        quant_matmul(torch.zeros(1, 64), FORMATS["q4_1"], planes, 64)


def test_default_configs_fill_the_gpu() -> None:
    o_proj = default_gemv_config(4096, 4096, FORMATS["q4_0"])  # 2048 programs of 2 columns
    assert (o_proj.block_n, o_proj.block_k, o_proj.split_k, o_proj.num_warps) == (2, 1024, 1, 1)
    assert default_gemv_config(128256, 4096, FORMATS["q8_0"]).block_n == 4  # swept: 4 wins
    assert default_gemv_config(128256, 4096, FORMATS["q4_k"]).block_n == 16  # not swept
    assert default_gemv_config(256, 2048, FORMATS["q4_0"]).split_k == 2  # 128 programs
    assert default_gemv_config(576, 64, FORMATS["q4_0"]).block_k == 64  # a short K
    decode = default_gemm_config(16, 4096)  # a batch of 16: 128 column tiles, not 64
    assert (decode.block_m, decode.block_n) == (16, 32)
    prefill = default_gemm_config(8192, 4096)
    assert (prefill.block_m, prefill.block_n, prefill.num_warps) == (128, 128, 8)


# -- real sizes on a GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("num_rows", [1, 4, 8, 9, 300])
@pytest.mark.parametrize(("num_cols", "size_k"), [(6144, 4096), (4096, 14336), (1536, 576)])
def test_quant_matmul_on_gpu_at_real_sizes(
    name: str, num_rows: int, num_cols: int, size_k: int
) -> None:
    if size_k % FORMATS[name].block_size:
        pytest.skip(f"{name} needs K in whole {FORMATS[name].block_size}-blocks")
    if name == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    fmt = FORMATS[name]
    planes = {k: v.cuda() for k, v in random_planes(fmt, num_cols, size_k).items()}
    x = torch.randn(num_rows, size_k, device="cuda").bfloat16()
    x_used = x.float()
    w8a8 = name == "fp8" and default_config(num_rows, num_cols, size_k, fmt, x.dtype).mma
    if w8a8 or uses_scaled_mm(x, fmt, num_cols, size_k):
        x_fp8, x_scale = quantize_rows_fp8(x)  # W8A8: the activations are rounded too
        x_used = x_fp8.float() * x_scale
    expected = x_used @ dequantize(fmt, planes).T
    # bf16 output rounding and bf16 weight tiles in the GEMM, relative to the sums' scale
    scale = expected.abs().max().item()
    got = quant_matmul(x, fmt, planes, size_k).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2 * scale)
    if num_rows <= MAX_GEMV_ROWS:  # the element-wise GEMV too (the k-quants' only one)
        config = dataclasses.replace(default_gemv_config(num_cols, size_k, fmt), blocked=False)
    else:  # the Triton GEMM
        config = default_gemm_config(num_rows, num_cols)
    expected = x.float() @ dequantize(fmt, planes).T  # a given config never takes _scaled_mm
    got = quant_matmul(x, fmt, planes, size_k, config=config).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("name", MMA_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_forms_the_dequantize_paths_weights(
    name: str, dtype: torch.dtype
) -> None:
    """One-hot rows read single weights out: the tensor-core kernel's are the bits that
    dequantize-then-cuBLAS multiplies (a prefix-cache hit changes a prefill's row count,
    and with it the path; the logits must not change with it)."""
    fmt = FORMATS[name]
    num_cols, size_k = 1536, 576
    planes = {k: v.cuda() for k, v in random_planes(fmt, num_cols, size_k, seed=4).items()}
    columns = torch.arange(0, size_k, 7, device="cuda")  # 83 rows: two row tiles and ragged
    x = torch.zeros(len(columns), size_k, device="cuda", dtype=dtype)
    x[torch.arange(len(columns)), columns] = 1.0
    # the kernel's shape at these rows (whether or not MMA_ROWS makes it their default) in
    # row tiles of 64: two, the second ragged
    config = dataclasses.replace(default_mma_config(len(columns), num_cols, size_k, fmt),
                                 block_m=64)  # fmt: skip
    assert config.mma
    got = quant_matmul(x, fmt, planes, size_k, config=config)
    expected = dequantize(fmt, planes).to(dtype)[:, columns].T
    assert torch.equal(got, expected)


def test_split_k_planes_are_added_in_order_into_a_strided_output() -> None:
    gen = torch.Generator().manual_seed(11)
    planes = torch.randn(3, 5, 700, generator=gen).to(DEVICE)  # 3,500 outputs: ragged tiles
    wide = torch.full((5, 800), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = wide[:, 50:750]  # row stride 800
    add_split_k_planes(out, planes)
    expected = ((planes[0] + planes[1]) + planes[2]).to(torch.bfloat16)
    if DEVICE == "cpu":  # the interpreter truncates fp32 -> bf16 where the GPU rounds
        summed = (planes[0] + planes[1]) + planes[2]
        expected = (summed.view(torch.int32) & -(1 << 16)).view(torch.float32).bfloat16()
    assert torch.equal(out, expected)
    assert wide[:, :50].isnan().all() and wide[:, 750:].isnan().all()  # nothing else written
    add_split_k_planes(out, out)  # no planes (no K split): nothing to add
    assert torch.equal(out, expected)
