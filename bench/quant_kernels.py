"""The quantized matmuls against cuBLAS bf16 on a model's linear shapes, CUDA only.

    python -m bench.quant_kernels --model llama3-8b --formats q8_0,q4_0,q4_1,q4_k,q6_k,fp8 \\
        --rows 1,16,4096 --output-json bench/results/quant-kernels-llama3-8b-h100.json

For each linear of one decoder layer and the LM head, each format and each row count, times
``quant_matmul`` (the default launch shape and a small grid of others) and ``F.linear`` on the
bf16 weight under CUDA-graph replay. Reports the time against the packed weight's streaming
limit (its bytes over the copy bandwidth measured in the same run) and the best launch shape,
the data for tuning ``default_gemv_config`` / ``default_gemm_config``.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F

from bench.kernels import measure_copy_bandwidth
from bench.records import machine_info, save
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from kernels.quant import (
    FORMATS,
    IN_SITU_FORMATS,
    QuantFormat,
    dequantize,
    empty_planes,
    plane_bytes,
    quantize,
)
from kernels.quant_matmul_triton import (
    MAX_GEMV_ROWS,
    QuantMatmulConfig,
    default_gemm_config,
    default_gemv_config,
    quant_matmul,
)

DEVICE = "cuda"
GEMV_GRID = [  # (block_n, block_k, split_k) around the default: each shape compiles once
    QuantMatmulConfig(block_n=n, block_k=k, split_k=split)
    for n, k, split in ((8, 256, 1), (16, 256, 1), (32, 256, 1), (16, 512, 1), (16, 256, 2),
                        (16, 256, 4))
]  # fmt: skip
GEMM_GRID = [
    QuantMatmulConfig(block_m=m, block_n=n, block_k=k, num_warps=w)
    for m, n, k, w in ((32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8), (128, 128, 32, 8),
                       (128, 64, 64, 4))
]  # fmt: skip


def linear_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Linear name -> (N, K) of one decoder layer and the LM head."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "qkv": (q_size + 2 * kv_size, arch.hidden_size),
        "o": (arch.hidden_size, q_size),
        "gate_up": (2 * arch.intermediate_size, arch.hidden_size),
        "down": (arch.hidden_size, arch.intermediate_size),
        "lm_head": (arch.vocab_size, arch.hidden_size),
    }


def measure(
    fmt: QuantFormat, rows: int, num_cols: int, size_k: int, copy_bytes_per_s: float
) -> dict[str, Any]:
    """Timings of one (format, rows, shape) against cuBLAS bf16, checked against the reference."""
    if fmt.name in IN_SITU_FORMATS:
        planes = quantize(torch.randn(num_cols, size_k, device=DEVICE) * 0.02, fmt)
    else:  # no in-situ k-quants: random blocks of the right shape
        planes = _random_planes(fmt, num_cols, size_k)
    dense = dequantize(fmt, planes).bfloat16()
    x = torch.randn(rows, size_k, device=DEVICE, dtype=torch.bfloat16)
    reference = F.linear(x, dense).float()
    timings = {"cublas_bf16": _time_us(lambda: F.linear(x, dense))}
    default = (default_gemv_config(num_cols, size_k, fmt) if rows <= MAX_GEMV_ROWS
               else default_gemm_config(rows, num_cols))  # fmt: skip
    grid = GEMV_GRID if rows <= MAX_GEMV_ROWS else GEMM_GRID
    for config in [default, *grid]:
        got = quant_matmul(x, fmt, planes, size_k, config=config).float()
        scale = reference.abs().max().item()
        assert (got - reference).abs().max().item() <= 3e-2 * scale + 1e-3, (fmt.name, config)
        timings[_key(config)] = _time_us(
            lambda c=config: quant_matmul(x, fmt, planes, size_k, config=c)
        )
    limit_us = plane_bytes(planes) / copy_bytes_per_s * 1e6
    best = min((k for k in timings if k != "cublas_bf16"), key=timings.__getitem__)
    summary = {
        "format": fmt.name, "rows": rows, "N": num_cols, "K": size_k,
        "limit_us": round(limit_us, 2), "cublas_bf16_us": round(timings["cublas_bf16"], 2),
        "default_us": round(timings[_key(default)], 2), "best": best,
        "best_us": round(timings[best], 2),
        "default_of_limit": round(limit_us / timings[_key(default)], 3),
        "best_of_limit": round(limit_us / timings[best], 3),
    }  # fmt: skip
    return {"summary": summary, "timings_us": timings}


def _random_planes(fmt: QuantFormat, num_rows: int, size_k: int) -> dict[str, torch.Tensor]:
    """Uniform random quant bytes, small positive fp16 scales."""
    planes = empty_planes(fmt, num_rows, size_k, DEVICE)
    for plane in planes.values():
        if plane.dtype == torch.float16:
            plane.copy_(torch.rand_like(plane, dtype=torch.float32) * 1e-3)
        else:
            plane.view(torch.uint8).copy_(torch.randint_like(plane.view(torch.uint8), 0, 256))
    return planes


def _key(config: QuantMatmulConfig) -> str:
    return (f"m{config.block_m}n{config.block_n}k{config.block_k}s{config.split_k}"
            f"w{config.num_warps}{'b' if config.blocked else ''}")  # fmt: skip


def _time_us(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50)) * 1000.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a dummy: shape name")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1,q4_k,q6_k,fp8")
    parser.add_argument("--rows", default="1,16,4096")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    arch = ModelArch.from_hf_config(dummy_hf_config(args.model))
    copy_bytes_per_s = measure_copy_bandwidth("cuda")
    results = []
    for fmt_name, rows in itertools.product(args.formats.split(","),
                                            (int(r) for r in args.rows.split(","))):  # fmt: skip
        for name, (num_cols, size_k) in linear_shapes(arch).items():
            result = measure(FORMATS[fmt_name], rows, num_cols, size_k, copy_bytes_per_s)
            result["summary"]["linear"] = name
            results.append(result)
            print(result["summary"], flush=True)
    record = {"kind": "quant_kernels", "machine": machine_info("cuda"),
              "settings": {"model": args.model, "formats": args.formats, "rows": args.rows},
              "copy_bytes_per_s": copy_bytes_per_s, "results": results}  # fmt: skip
    save(record, args.output_json)


if __name__ == "__main__":
    main()
