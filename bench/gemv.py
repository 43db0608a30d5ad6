"""The GEMV kernel against cuBLAS (``F.linear``) on a model's decode shapes, CUDA only.

    python -m bench.gemv --model llama3-8b --rows 1,4 --out bench/results/gemv-h100.json
    python -m bench.gemv --model llama3-8b --tensor-parallel-size 2 --rows 1,64 --out OUT.json

For each linear of one decoder layer (and the LM head) and each batch size in ``--rows``,
times ``F.linear`` and every GEMV launch shape of a small grid under CUDA-graph replay (as
decode runs), and the MLP's down projection with ``silu_and_mul`` fused into the GEMV
against the activation kernel plus ``F.linear``. Reports achieved bandwidth against the copy
bandwidth measured in the same run, and the best launch shape per linear.
``--tensor-parallel-size N`` times one rank's shard of each linear (qkv, gate_up and the LM
head split their outputs, o and down their inputs).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.kernels import measure_copy_bandwidth
from bench.records import machine_info
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from kernels.linear.gemv_triton import GemvConfig, default_config, gemv

GRID = [
    GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st)
    for n, k, s, w, st in itertools.product((4, 8, 16), (256, 512, 1024), (1, 2, 4), (4,), (3, 4))
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a dummy: shape name")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="one rank's shard")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tp = args.tensor_parallel_size
    arch = ModelArch.from_hf_config(dummy_hf_config(args.model))
    device = torch.device("cuda")
    copy_bytes_per_s = measure_copy_bandwidth(device)
    q_kv = arch.num_heads * arch.head_dim + 2 * arch.num_kv_heads * arch.head_dim
    shapes = {  # name: (N, K, fused silu_mul), of one rank's shard
        "qkv": (q_kv // tp, arch.hidden_size, False),
        "o": (arch.hidden_size, arch.num_heads * arch.head_dim // tp, False),
        "gate_up": (2 * arch.intermediate_size // tp, arch.hidden_size, False),
        "down+silu": (arch.hidden_size, arch.intermediate_size // tp, True),
        "lm_head": (-(-arch.vocab_size // tp), arch.hidden_size, False),
    }
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (num_cols, size_k, silu_mul) in shapes.items():
            results.append(_measure(name, rows, num_cols, size_k, silu_mul, copy_bytes_per_s))
            print(json.dumps(results[-1]["summary"]), flush=True)
    record = {"kind": "gemv", "machine": machine_info(device), "model": args.model,
              "tensor_parallel_size": tp, "copy_bytes_per_s": copy_bytes_per_s,
              "results": results}  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))


def _measure(
    name: str, rows: int, num_cols: int, size_k: int, silu_mul: bool, copy_bytes_per_s: float
) -> dict[str, Any]:
    from kernels.elementwise.activation_triton import silu_and_mul

    x = torch.randn(rows, 2 * size_k if silu_mul else size_k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(num_cols, size_k, device="cuda", dtype=torch.bfloat16) * 0.02
    weight_bytes = weight.numel() * weight.element_size()

    def cublas() -> torch.Tensor:
        return F.linear(silu_and_mul(x) if silu_mul else x, weight)

    reference = cublas().float()
    timings = {"cublas": _time_us(cublas)}
    for config in [*GRID, default_config(num_cols, size_k)]:
        got = gemv(x, weight, silu_mul=silu_mul, config=config)
        error = (got.float() - reference).abs().max().item()
        scale = reference.abs().max().item()
        assert error <= 2e-2 * scale + 1e-3, (name, config, error, scale)
        key = f"n{config.block_n}k{config.block_k}s{config.split_k}w{config.num_warps}st{config.num_stages}"
        timings[key] = _time_us(lambda c=config: gemv(x, weight, silu_mul=silu_mul, config=c))
    best = min((k for k in timings if k != "cublas"), key=timings.__getitem__)
    default_key = "n{0.block_n}k{0.block_k}s{0.split_k}w{0.num_warps}st{0.num_stages}".format(
        default_config(num_cols, size_k)
    )
    limit_us = weight_bytes / copy_bytes_per_s * 1e6

    def fraction(us: float) -> float:
        return round(limit_us / us, 3)

    summary = {
        "linear": name, "rows": rows, "N": num_cols, "K": size_k,
        "cublas_us": round(timings["cublas"], 2), "best": best,
        "best_us": round(timings[best], 2), "default_us": round(timings[default_key], 2),
        "limit_us": round(limit_us, 2), "cublas_of_limit": fraction(timings["cublas"]),
        "best_of_limit": fraction(timings[best]),
        "default_of_limit": fraction(timings[default_key]),
    }  # fmt: skip
    return {"summary": summary, "timings_us": timings}


def _time_us(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50)) * 1000.0


if __name__ == "__main__":
    main()
