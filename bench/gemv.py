"""The GEMV kernel against cuBLAS (``F.linear``) on a model's decode shapes, CUDA only.

    python -m bench.gemv --model llama3-8b --rows 1,4 --out bench/results/gemv-h100.json
    python -m bench.gemv --model llama3-8b --tensor-parallel-size 2 --rows 1,64 --out OUT.json

For each linear of one decoder layer (a mixture of experts' router too; its experts are
``bench.moe_sweep``'s) and the LM head, and each batch size in ``--rows``,
times ``F.linear`` and every GEMV launch shape of a small grid under CUDA-graph replay (as
decode runs; each replay walks copies of the weight that outsize the L2, so each call reads
its weight from memory, as a decode step does), and the MLP's down projection with
``silu_and_mul`` fused into the GEMV against the activation kernel plus ``F.linear``.
Reports achieved bandwidth against the copy bandwidth measured in the same run, and the best
launch shape per linear.
``--tensor-parallel-size N`` times one rank's shard of each linear (qkv, gate_up and the LM
head split their outputs, o and down their inputs). ``--install`` writes, per linear, the
fastest of cuBLAS and the GEMV's launch shapes into ``kernels/linear/gemv_configs.json`` for
this GPU, where it beats the engine's current choice by more than ``INSTALL_MARGIN`` (without
an entry: the GEMV for o, down with the activation, a router and the LM head; cuBLAS for
qkv and gate_up).
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.first_calls import first_calls
from bench.kernels import measure_copy_bandwidth
from bench.records import machine_info
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from kernels.linear.gemv_triton import GemvConfig, default_config, gemv

GRID = [
    GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st)
    for n, k, s, w, st in [
        *itertools.product((4, 8, 16), (256, 512, 1024), (1, 2, 4), (4,), (3, 4)),
        # a row or two per program and one or two warps: the most programs in flight (they
        # won the MoE direct path's GEMVs at 1-8 tokens on an H200)
        *itertools.product((1, 2), (512, 1024, 2048), (1, 2), (1, 2), (2, 3)),
        *itertools.product((4, 8), (512, 1024), (1, 2), (1, 2), (3,)),
    ]
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a dummy: shape name")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="one rank's shard")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--install", action="store_true", help="write the tuned table")
    args = parser.parse_args(argv)
    tp = args.tensor_parallel_size
    arch = ModelArch.from_hf_config(dummy_hf_config(args.model))
    device = torch.device("cuda")
    copy_bytes_per_s = measure_copy_bandwidth(device)
    shapes = decode_linears(arch, tp)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (num_cols, size_k, silu_mul) in shapes.items():
            results.append(_measure(name, rows, num_cols, size_k, silu_mul, copy_bytes_per_s))
            print(json.dumps(results[-1]["summary"]), flush=True)
    record = {"kind": "gemv", "machine": machine_info(device), "model": args.model,
              "tensor_parallel_size": tp, "copy_bytes_per_s": copy_bytes_per_s,
              "results": results}  # fmt: skip
    if args.install:
        record["installed"] = install_faster(results, torch.cuda.get_device_name(device))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))


def decode_linears(arch: ModelArch, tp: int = 1) -> dict[str, tuple[int, int, bool]]:
    """The linears a decode step of ``arch`` runs, by name: (N, K, fused silu_mul) of one
    rank's shard. A mixture of experts adds its router (the experts' own GEMVs are
    ``bench.moe_sweep``'s), and has no dense MLP where every layer is sparse."""
    q_kv = arch.num_heads * arch.head_dim + 2 * arch.num_kv_heads * arch.head_dim
    shapes = {
        "qkv": (q_kv // tp, arch.hidden_size, False),
        "o": (arch.hidden_size, arch.num_heads * arch.head_dim // tp, False),
    }
    moe = arch.moe
    if moe is None or len(moe.sparse_layers) < arch.num_layers:
        shapes["gate_up"] = (2 * arch.intermediate_size // tp, arch.hidden_size, False)
        shapes["down+silu"] = (arch.hidden_size, arch.intermediate_size // tp, True)
    if moe is not None:  # every rank routes on the whole router (it is not split)
        shapes["router"] = (moe.num_experts, arch.hidden_size, False)
    shapes["lm_head"] = (-(-arch.vocab_size // tp), arch.hidden_size, False)
    return shapes


INSTALL_MARGIN = 0.03  # a choice must beat the current one by this much (noise)


def engine_default(linear: str, num_cols: int, size_k: int) -> GemvConfig | None:
    """What the engine runs ``linear`` on where the table says nothing (``None``: cuBLAS):
    the GEMV for o, down (the activation fused), a mixture of experts' router and the LM
    head, cuBLAS for qkv and gate_up."""
    from engine.models.linears import LAYER_GEMV_CONFIG, ROUTER_GEMV_CONFIG

    if linear in ("o", "down+silu"):
        return LAYER_GEMV_CONFIG
    if linear == "router":
        return ROUTER_GEMV_CONFIG
    if linear == "lm_head":
        return default_config(num_cols, size_k)
    return None


def install_faster(
    results: list[dict[str, Any]], device_name: str, path: Path | None = None
) -> dict[str, str]:
    """Install, per linear, the fastest of cuBLAS and every GEMV shape timed, where it beats
    the engine's current choice (the table's, else ``engine_default``) by ``INSTALL_MARGIN``;
    the installed keys and choices (``"cublas"`` or a config key)."""
    from kernels.linear.gemv_tuning import TUNED_PATH, install, shape_key, tuned_for

    path = path or TUNED_PATH
    chosen: dict[str, GemvConfig | None] = {}
    for result in results:
        summary, timings = result["summary"], result["timings_us"]
        silu = summary["linear"] == "down+silu"
        key = shape_key(summary["rows"], summary["N"], summary["K"], silu)
        default = engine_default(summary["linear"], summary["N"], summary["K"])
        current = choice_key(tuned_for(device_name, key, default, path))
        best = min(timings, key=timings.__getitem__)
        if timings[best] < (1 - INSTALL_MARGIN) * timings.get(current, float("inf")):
            chosen[key] = None if best == "cublas" else parse_key(best)
    if chosen:
        install(device_name, chosen, path)
    return {key: choice_key(choice) for key, choice in chosen.items()}


def choice_key(choice: GemvConfig | None) -> str:
    """A timing's key: ``"cublas"`` for ``None``, else ``config_key``."""
    return "cublas" if choice is None else config_key(choice)


def config_key(config: GemvConfig) -> str:
    return (
        f"n{config.block_n}k{config.block_k}s{config.split_k}"
        f"w{config.num_warps}st{config.num_stages}"
    )


def parse_key(key: str) -> GemvConfig:
    """``config_key``'s inverse."""
    import re

    match = re.fullmatch(r"n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)", key)
    if match is None:
        raise ValueError(f"not a GEMV config key: {key!r}")
    n, k, s, w, st = map(int, match.groups())
    return GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st)


def _measure(
    name: str, rows: int, num_cols: int, size_k: int, silu_mul: bool, copy_bytes_per_s: float
) -> dict[str, Any]:
    from kernels.elementwise.activation_triton import silu_and_mul

    x = torch.randn(rows, 2 * size_k if silu_mul else size_k, device="cuda", dtype=torch.bfloat16)
    weights = _weight_copies(num_cols, size_k)
    weight = weights[0]
    weight_bytes = weight.numel() * weight.element_size()

    def cublas(w: torch.Tensor = weight) -> torch.Tensor:
        return F.linear(silu_and_mul(x) if silu_mul else x, w)

    reference = cublas().float()
    timings = {"cublas": _time_us(cublas, weights)}
    from engine.models.linears import LAYER_GEMV_CONFIG

    configs = [*GRID, default_config(num_cols, size_k), LAYER_GEMV_CONFIG]
    results = first_calls(
        [partial(gemv, x, weight, silu_mul=silu_mul, config=config) for config in configs]
    )
    for config, got in zip(configs, results, strict=True):
        assert got is not None, (name, config)  # a GEMV tile holds no shared memory to speak of
        error = (got.float() - reference).abs().max().item()
        scale = reference.abs().max().item()
        assert error <= 2e-2 * scale + 1e-3, (name, config, error, scale)
        timings[config_key(config)] = _time_us(
            lambda w, c=config: gemv(x, w, silu_mul=silu_mul, config=c), weights
        )
    best = min((k for k in timings if k != "cublas"), key=timings.__getitem__)
    default_key = config_key(default_config(num_cols, size_k))
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


L2_MULTIPLE = 3  # the weight copies a timed replay walks hold this many L2s, at least


def _weight_copies(num_cols: int, size_k: int) -> list[torch.Tensor]:
    """Copies of one random weight, enough of them to hold ``L2_MULTIPLE`` times the GPU's
    L2: a decode step reads each layer's weights once, from memory, and a replay that read
    one copy again and again would time a weight that fits the L2 (50 MB on an H200) at the
    L2's speed."""
    weight = torch.randn(num_cols, size_k, device="cuda", dtype=torch.bfloat16) * 0.02
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    copies = -(-L2_MULTIPLE * l2_bytes // (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def _time_us(fn: Any, weights: list[torch.Tensor]) -> float:
    """Microseconds a call of ``fn`` on one of ``weights``, from a CUDA graph replay that
    calls it on each in turn."""
    import triton.testing

    def each() -> None:
        for weight in weights:
            fn(weight)

    return float(triton.testing.do_bench_cudagraph(each, rep=50)) * 1000.0 / len(weights)


if __name__ == "__main__":
    main()
