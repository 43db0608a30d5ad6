"""Quantized decode on int8 activations against the paths it replaced, in one process.

    python -m bench.int8_paths --model dummy:llama3-8b --formats q4_0 --off producers \\
        --batches 1,2,4 --rounds 6
    python -m bench.int8_paths --model dummy:llama3-8b --formats q8_0 --off int8-mma \\
        --batches 8,16,32 --rounds 4 --bf16

Two paths have no engine flag, being the defaults where they were measured faster, so this
bench builds an engine with one of them off beside the one that ships, each format:
- ``producers``: the norms and SiLU round a quantized linear's input to int8 blocks
  themselves (kernels/elementwise/norm_triton.py, kernels/elementwise/activation_triton.py);
  off, each linear launches the rounding kernel (``engine.models.layers.takes_int8_rows``
  patched out);
- ``int8-mma``: q8_0 batches of ``INT8_MMA_ROWS`` on int8 tensor cores
  (kernels/linear/quant_mma_int8_triton.py); off, the float tensor-core kernel.
The patch holds while the engine is built, so its decode CUDA graphs keep that path (steps
that run eagerly afterwards, prefill, take the shipped one). ``--bf16`` adds the float model.
All engines stay loaded and the latency runs (bench/latency.py) alternate between them,
``--rounds`` times in alternating order; the record gives each batch's median and least time
per output token, and whether greedy outputs of 16 prompts agree between the two builds (they
need not where the paths round differently: a random model's logits are near ties).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.kernels import measure_copy_bandwidth
from bench.latency import LatencyWorkload, run_latency
from bench.records import machine_info, save, utc_now
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PATHS = ("producers", "int8-mma")
AGREEMENT_PROMPTS = 16


@contextmanager
def path_off(path: str) -> Iterator[None]:
    """While the block runs, engines are built without ``path`` (one of PATHS)."""
    import engine.models.layers as layers
    import kernels.linear.quant_matmul_config as quant_config

    if path == "producers":
        shipped = layers.takes_int8_rows
        layers.takes_int8_rows = lambda x, linear: False
        try:
            yield
        finally:
            layers.takes_int8_rows = shipped
    else:
        rows = dict(quant_config.INT8_MMA_ROWS)
        quant_config.INT8_MMA_ROWS.clear()
        try:
            yield
        finally:
            quant_config.INT8_MMA_ROWS.update(rows)


def measure_paths(
    model: str,
    formats: list[str],
    off: str,
    batches: tuple[int, ...],
    rounds: int,
    *,
    bf16: bool = False,
    output_len: int = 256,
    copy_bytes_per_s: float | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """The record (see module docstring)."""
    if off not in PATHS:
        raise ValueError(f"--off: one of {PATHS}, got {off!r}")
    engines: dict[str, LLM] = {}
    if bf16:
        engines["none"] = LLM(model, quantization="none", **settings)
    for fmt in formats:
        with path_off(off):
            engines[f"{fmt}-{off}-off"] = LLM(model, quantization=fmt, **settings)
        engines[fmt] = LLM(model, quantization=fmt, **settings)
    agreement = {
        fmt: _greedy_agreement(engines[f"{fmt}-{off}-off"], engines[fmt]) for fmt in formats
    }
    workload = LatencyWorkload(batch_sizes=batches, input_len=128, output_len=output_len)
    tpot_ms: dict[str, dict[int, list[float]]] = {
        name: {b: [] for b in batches} for name in engines
    }
    names = list(engines)
    record: dict[str, Any] = {}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            record = run_latency(engines[name].engine, workload,
                                 copy_bytes_per_s=copy_bytes_per_s, use_tqdm=False)  # fmt: skip
            for result in record["results"]:
                tpot_ms[name][result["batch"]].append(result["mean_tpot_s"] * 1e3)
    results = {name: _medians(by_batch) for name, by_batch in tpot_ms.items()}
    settings = {"model": model, "formats": formats, "off": off, "batches": list(batches),
                "rounds": rounds, "input_len": 128, "output_len": output_len, **settings}  # fmt: skip
    ratios = {
        fmt: {
            batch: results[fmt][batch]["median_tpot_ms"]
            / results[f"{fmt}-{off}-off"][batch]["median_tpot_ms"]
            for batch in batches
        }
        for fmt in formats
    }
    return {
        "kind": "int8_paths",
        "created_utc": utc_now(),
        "machine": record.get("machine") or machine_info(),
        "settings": settings,
        "copy_bytes_per_s": copy_bytes_per_s,
        "greedy_identical": agreement,
        "results": results,
        "ratios": ratios,  # shipped over off, per batch: below 1 is faster
    }


def _medians(by_batch: dict[int, list[float]]) -> dict[int, dict[str, Any]]:
    return {
        batch: {
            "median_tpot_ms": statistics.median(times),
            "min_tpot_ms": min(times),
            "tpot_ms": times,
        }
        for batch, times in by_batch.items()
    }


def _greedy_agreement(first: LLM, second: LLM) -> str:
    """How many of AGREEMENT_PROMPTS greedy outputs (32 tokens) the two engines share."""
    vocab = first.engine.loaded.arch.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 10) + 10 for j in range(40)]
               for i in range(AGREEMENT_PROMPTS)]  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = [
        [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for llm in (first, second)
    ]
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    return f"{same}/{len(prompts)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--formats", default="q4_0")
    parser.add_argument("--off", choices=PATHS, default="producers")
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--bf16", action="store_true", help="also the float model")
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--pa-memory-mb", type=int, default=4096,
                        help="each engine's KV pool (they share the GPU)")  # fmt: skip
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    copy = measure_copy_bandwidth("cuda") if torch.cuda.is_available() else None
    record = measure_paths(
        args.model, args.formats.split(","), args.off, batches, args.rounds, bf16=args.bf16,
        output_len=args.output_len, copy_bytes_per_s=copy, max_model_len=1024,
        max_seqs=args.max_seqs, pa_memory_mb=args.pa_memory_mb,
    )  # fmt: skip
    for fmt, ratios in record["ratios"].items():
        print(fmt, {b: round(r, 3) for b, r in ratios.items()}, "same greedy outputs:",
              record["greedy_identical"][fmt], flush=True)  # fmt: skip
    save(record, args.output_json)


if __name__ == "__main__":
    main()
