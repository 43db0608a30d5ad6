"""The quantized matmul kernels compile for Hopper (sm_90) through Triton's own compiler and
ptxas, with no GPU: the interpreter that runs them on the CPU checks their arithmetic, not
whether the GPU compiler accepts them. Integer arguments carry the divisibility by 16 that
Triton specializes at launch, as on the device.

The compiles run in one subprocess without ``TRITON_INTERPRET`` (under it, ``@triton.jit``
makes interpreted functions that cannot be compiled).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.elementwise.activation_triton import _silu_and_mul_kernel
from kernels.elementwise.norm_triton import _rms_norm_kernel
from kernels.linear.fp8_mma_triton import _fp8_mma_kernel
from kernels.linear.int8_rows_triton import _quantize_x_kernel
from kernels.linear.quant import FORMATS
from kernels.linear.quant_gemm_triton import _quant_gemm_kernel, _quant_gemv_kernel
from kernels.linear.quant_gemv_blocked_triton import _quant_gemv_blocked_kernel
from kernels.linear.quant_gemv_int8_triton import _quant_gemv_int8_kernel
from kernels.linear.quant_gemv_kquant_triton import _quant_gemv_kquant_kernel
from kernels.linear.quant_mma_int8_triton import _quant_mma_int8_kernel
from kernels.linear.quant_mma_triton import _quant_mma_kernel

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {"q8_0": ["*fp16", "*i8"], "q4_1": ["*fp16", "*u8", "*fp16"],
                 "q4_k": ["*fp16", "*fp16", "*u8", "*u8"], "q6_k": ["*fp16", "*i8", "*u8", "*u8"],
                 "fp8": ["*fp8e4nv", "*fp32"]}  # fmt: skip
FOUR_PLANES = ["x_ptr", "out_ptr", "p0", "p1", "p2", "p3", "s0", "s1", "s2", "s3", "M", "N", "K",
               "stride_xm", "stride_om"]  # fmt: skip
THREE_PLANES = [name for name in FOUR_PLANES if name not in ("p3", "s3")]
MMA_ARGUMENTS = [*THREE_PLANES, "stride_split"]
GEMV = {"M_PAD": 4, "BLOCK_N": 16, "SPLIT_K": 2}
MMA = {"MAGIC": 0x4300, "OFFSET": 128.0, "DOT_FP32": False}  # bf16 activations
CASES = [  # (kernel, format, argument names, constexprs)
    (_quant_gemm_kernel, "q4_k", FOUR_PLANES,
     {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "IEEE_FP32": False}),
    (_quant_gemm_kernel, "fp8", FOUR_PLANES,
     {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "IEEE_FP32": False}),
    (_quant_gemv_kernel, "q6_k", FOUR_PLANES, {**GEMV, "BLOCK_K": 256, "PDL": False}),
    (_quant_gemv_blocked_kernel, "q4_1", THREE_PLANES, {**GEMV, "BLOCKS": 8, "PDL": True}),
    (_quant_gemv_blocked_kernel, "fp8", THREE_PLANES, {**GEMV, "BLOCKS": 8, "PDL": False}),
    (_quant_gemv_kquant_kernel, "q4_k", FOUR_PLANES,
     {**GEMV, "GROUPS": 4, "GROUP_SIZE": 64, "PDL": True}),
    (_quant_gemv_kquant_kernel, "q6_k", FOUR_PLANES,
     {**GEMV, "GROUPS": 2, "GROUP_SIZE": 128, "PDL": False}),
    (_quant_mma_kernel, "q4_1", MMA_ARGUMENTS,
     {**MMA, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCKS": 4, "SPLIT_K": 2, "PDL": True}),
    (_quant_mma_kernel, "q8_0", MMA_ARGUMENTS,
     {**MMA, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCKS": 4, "SPLIT_K": 1, "PDL": False}),
]  # fmt: skip
TILED = (_quant_gemm_kernel, _quant_mma_kernel)  # tl.dot kernels
FP8_MMA_ID = "_fp8_mma_kernel-fp8"


ROOT = Path(__file__).resolve().parent.parent
COMPILE_TIMEOUT_S = 300


def case_id(index: int) -> str:
    kernel, name, _, _ = CASES[index]
    return f"{kernel.fn.__name__}-{name}"  # jit and interpreted functions both keep .fn


def compile_case(index: int) -> dict[str, Any]:
    """Compile case ``index`` for sm_90: whether it assembled and used 16-byte loads."""
    kernel, name, arguments, constants = CASES[index]
    num_planes = sum(arg.startswith("p") for arg in arguments)
    planes = (POINTER_TYPES[name] * num_planes)[:num_planes]
    types = ["*bf16", "*fp32", *planes] + ["i32"] * (len(arguments) - 2 - num_planes)
    signature = dict(zip(arguments, types, strict=True))
    constexprs = {"FORMAT": FORMATS[name].kernel_id, **constants}
    signature |= {key: "constexpr" for key in constexprs}
    divisible = [i for i, arg in enumerate(arguments) if arg not in ("M", "N")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=HOPPER,
        options={"num_warps": 8 if constants.get("BLOCK_M") == 128 else 4},
    )
    ptx = compiled.asm["ptx"]
    return {"cubin": bool(compiled.asm["cubin"]), "vector": "ld.global.v4" in ptx,
            "pdl": "griddepcontrol.wait" in ptx}  # fmt: skip


FP8_MMA_ARGUMENTS = {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                     "w_scale_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                     "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32",
                     "stride_split": "i32"}  # fmt: skip
# fp8's default shape at up to 16 rows
FP8_MMA = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "SPLIT_K": 1, "DOT_FP32": False,
           "PDL": True}  # fmt: skip


def compile_fp8_mma() -> dict[str, Any]:
    """The fp8 tensor-core kernel for sm_90: whether its dot multiplies e4m3 on wgmma."""
    return _compile_tensor_core(_fp8_mma_kernel, FP8_MMA_ARGUMENTS, FP8_MMA, "e4m3")


def _compile_tensor_core(
    kernel: Any, arguments: dict[str, str], constexprs: dict[str, Any], operands: str
) -> dict[str, Any]:
    """A tensor-core kernel for sm_90: whether it assembled, and whether its dots run on
    Hopper's warpgroup MMA with ``operands`` (a PTX type suffix) rather than converted first."""
    signature = arguments | {key: "constexpr" for key in constexprs}
    divisible = [i for i, arg in enumerate(arguments) if arg not in ("M", "N")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=HOPPER, options={"num_warps": 4, "num_stages": 3},
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line and operands in line]
    return {"cubin": bool(compiled.asm["cubin"]), "wgmma": bool(wgmma),
            "pdl": "griddepcontrol.wait" in ptx}  # fmt: skip


INT8_GEMV_ID = "_quant_gemv_int8_kernel-q4_0"
INT8_GEMV_ARGUMENTS = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32",
                       "out_ptr": "*bf16", "p0": "*fp16", "p1": "*i32", "p2": "*fp16",
                       "s0": "i32", "s1": "i32", "s2": "i32", "M": "i32", "N": "i32", "K": "i32",
                       "stride_qm": "i32", "stride_sm": "i32", "stride_om": "i32"}  # fmt: skip
# q4_0's default shape at one row of a wide weight
INT8_GEMV = {"FORMAT": 1, "M_PAD": 1, "BLOCK_N": 2, "BLOCKS": 32, "SPLIT_K": 1, "ASM": True,
             "PDL": True}  # fmt: skip
X_QUANT_ID = "_quantize_x_kernel"
X_QUANT_ARGUMENTS = {"x_ptr": "*bf16", "xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32",
                     "K": "i32", "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}  # fmt: skip


# The kernels that round their output for the int8 GEMV (llama3-8b's hidden size and MLP)
NORM_INT8_ID = "_rms_norm_kernel-int8"
NORM_INT8_ARGUMENTS = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
                       "out_ptr": "*bf16", "sum_ptr": "*bf16", "xq_ptr": "*i8", "xd_ptr": "*fp32",
                       "xs_ptr": "*fp32", "eps": "fp32", "stride_xt": "i32", "stride_xh": "i32",
                       "stride_rt": "i32", "stride_ot": "i32", "stride_oh": "i32",
                       "stride_ut": "i32", "stride_qt": "i32", "stride_st": "i32"}  # fmt: skip
NORM_INT8 = {"NUM_HEADS": 1, "N": 4096, "BLOCK_N": 4096, "HAS_RESIDUAL": True,
             "ROUND_INT8": True, "CHUNK": 256, "OUT_DTYPE": tl.bfloat16, "PDL": True}  # fmt: skip
SILU_INT8_ID = "_silu_and_mul_kernel-int8"
SILU_INT8_ARGUMENTS = {"gate_up_ptr": "*bf16", "out_ptr": "*i8", "xd_ptr": "*fp32",
                       "xs_ptr": "*fp32", "stride_gt": "i32", "stride_ot": "i32",
                       "stride_st": "i32"}  # fmt: skip
SILU_INT8 = {"D": 14336, "BLOCK_D": 1024, "ROUND_INT8": True, "DTYPE": tl.bfloat16, "PDL": True}


INT8_MMA_ID = "_quant_mma_int8_kernel-q8_0"
INT8_MMA_ARGUMENTS = {"xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "out_ptr": "*fp32",
                      "p0": "*fp16", "p1": "*i8", "p2": "*fp16", "s0": "i32", "s1": "i32",
                      "s2": "i32", "M": "i32", "N": "i32", "K": "i32", "stride_qm": "i32",
                      "stride_sm": "i32", "stride_om": "i32", "stride_split": "i32"}  # fmt: skip
# q8_0's default shape at 16 rows
INT8_MMA = {"FORMAT": 0, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCKS": 4, "SPLIT_K": 4, "PDL": True}


def compile_int8_mma() -> dict[str, Any]:
    """The int8 tensor-core kernel for sm_90: whether its dots run on wgmma in int8."""
    return _compile_tensor_core(_quant_mma_int8_kernel, INT8_MMA_ARGUMENTS, INT8_MMA, ".s8.s8")


def compile_int8_producers() -> dict[str, dict[str, Any]]:
    return {
        NORM_INT8_ID: _compile_plain(_rms_norm_kernel, NORM_INT8_ARGUMENTS, NORM_INT8, 16),
        SILU_INT8_ID: _compile_plain(_silu_and_mul_kernel, SILU_INT8_ARGUMENTS, SILU_INT8),
    }


def compile_int8_gemv() -> dict[str, Any]:
    """The int8-activation GEMV for sm_90: 16-byte loads of the quants, ``dp4a`` products."""
    return _compile_plain(_quant_gemv_int8_kernel, INT8_GEMV_ARGUMENTS, INT8_GEMV, num_warps=1)


def compile_x_quant() -> dict[str, Any]:
    return _compile_plain(_quantize_x_kernel, X_QUANT_ARGUMENTS, {"BLOCKS": 8, "PDL": True})


def _compile_plain(
    kernel: Any, arguments: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4
) -> dict[str, Any]:
    signature = arguments | {key: "constexpr" for key in constexprs}
    divisible = [i for i, arg in enumerate(arguments) if arg not in ("M", "N", "K")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=HOPPER, options={"num_warps": num_warps},
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {"cubin": bool(compiled.asm["cubin"]), "vector": "ld.global.v4" in ptx,
            "dp4a": "dp4a.s32.s32" in ptx, "pdl": "griddepcontrol.wait" in ptx}  # fmt: skip


def main() -> None:
    results: dict[str, Any] = {}
    jobs = {case_id(index): functools.partial(compile_case, index) for index in range(len(CASES))}
    jobs |= {FP8_MMA_ID: compile_fp8_mma, INT8_GEMV_ID: compile_int8_gemv,
             X_QUANT_ID: compile_x_quant, INT8_MMA_ID: compile_int8_mma}  # fmt: skip
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception as error:  # reported per case by the test
            results[name] = {"error": repr(error)[:2000]}
    try:
        results |= compile_int8_producers()
    except Exception as error:
        results |= {key: {"error": repr(error)[:2000]} for key in (NORM_INT8_ID, SILU_INT8_ID)}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", "import tests.test_quant_compile as t; t.main()"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(i) for i in range(len(CASES))])
def test_kernel_compiles_for_hopper(compiled: dict[str, Any], index: int) -> None:
    kernel = CASES[index][0]
    result = compiled[case_id(index)]
    assert "error" not in result, result.get("error")
    assert result["cubin"]  # ptxas assembled it
    if kernel not in TILED:  # the GEMVs stream their quants with 16-byte loads
        assert result["vector"]
    # launched as a programmatic dependent, the kernel waits for the one before it
    assert result["pdl"] == CASES[index][3].get("PDL", False)


def test_fp8_tensor_core_kernel_compiles_to_fp8_wgmma(compiled: dict[str, Any]) -> None:
    result = compiled[FP8_MMA_ID]
    assert "error" not in result, result.get("error")
    assert result["cubin"] and result["pdl"]
    assert result["wgmma"]  # e4m3 operands on Hopper's warpgroup MMA, not upcast first


def test_int8_activation_gemv_compiles_to_dp4a(compiled: dict[str, Any]) -> None:
    result = compiled[INT8_GEMV_ID]
    assert "error" not in result, result.get("error")
    assert result["cubin"] and result["pdl"]
    assert result["vector"]  # the quants' words in 16-byte loads
    assert result["dp4a"]  # four int8 products a instruction, not the interpreter's byte loop
    rounding = compiled[X_QUANT_ID]
    assert "error" not in rounding, rounding.get("error")
    assert rounding["cubin"] and rounding["pdl"]


@pytest.mark.parametrize("kernel_id", [NORM_INT8_ID, SILU_INT8_ID])
def test_kernels_that_round_their_output_compile(compiled: dict[str, Any], kernel_id: str) -> None:
    result = compiled[kernel_id]
    assert "error" not in result, result.get("error")
    assert result["cubin"] and result["pdl"]


def test_int8_tensor_core_kernel_compiles_to_int8_wgmma(compiled: dict[str, Any]) -> None:
    result = compiled[INT8_MMA_ID]
    assert "error" not in result, result.get("error")
    assert result["cubin"] and result["pdl"]
    assert result["wgmma"]  # int8 operands on Hopper's warpgroup MMA
