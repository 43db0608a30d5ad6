"""The prefill attention kernel's launch shapes at real prefill shapes, against flash SDPA.

    python -m bench.prefill_attention --out bench/results/prefill-attention-h200.json --install

Shapes: qwen3-0.6b (Hq=16, Hkv=8, D=128) and llama3-8b (Hq=32, Hkv=8), bf16, pages of 32 and
16 tokens; one chunk of 8192 new tokens over a context of 0, 4k, 16k and 32k, and 32
sequences of 256 new tokens over 2k each. Every config in ``CANDIDATES`` runs on the sweep
shapes (qwen3-0.6b, pages of 32); the ``--top`` best of them, the current choice and the old
shape run on the rest. Each config's output is checked against ``paged_attention_ref`` before
it is timed (a failure is recorded with its reason and skipped). Reports TFLOP/s (causal
FLOPs: 4 D Hq per visible (query, key) pair) and the fraction of torch's flash SDPA on the
same problem laid out contiguously (K/V expanded to Hq heads); and per shape the engine's
other prefill path, ``PAGESTREAM_PREFILL_ATTN=sdpa`` (``sdpa_path``: the context copied out of
its pages and attended by cuDNN, copy and merge in the time) with its speedup over the best
config, and its first call on the shape (``first_call_ms``: where cuDNN builds a graph for
each new shape, which a serving engine meets as chunk and context lengths change; the first
shape's also holds the merge kernel's compile). ``--install`` writes each table row's (head
dim, group, dtypes, page size) best config into ``kernels/attention/prefill_configs.json`` for
this GPU where it beats the current choice by more than ``INSTALL_MARGIN``. ``CANDIDATES``
include the Hopper options (``-tma`` page tiles, ``-ws`` warp specialization; elsewhere they
fail their check and are recorded so); ``--candidates KEY,...`` sweeps only those named. CUDA
for real timings; on the CPU (the interpreter) only tiny shapes are practical, which is how the
tests run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.prefill_problem import PrefillProblem, PrefillShape, sdpa_flash_ms, time_ms
from bench.records import machine_info, utc_now, write_record
from kernels.attention.prefill_tuning import FALLBACK, PrefillConfig

MODELS = ("qwen3-0.6b", "llama3-8b")
BLOCK_SIZES = (32, 16)
CHUNK_TOKENS, CHUNK_CONTEXTS = 8192, (0, 4096, 16384, 32768)
BATCH_SEQS, BATCH_TOKENS, BATCH_CONTEXT = 32, 256, 2048
CANDIDATES = [
    PrefillConfig(m, n, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
]
# The Hopper options: TMA tiles of one 32-token page (the default page), and the bulk loop
# warp-specialized; off Hopper they fail their check and are recorded as such.
CANDIDATES += [
    PrefillConfig(m, 32, w, s, tma=True)
    for m, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))
    if m == 128 or w == 4
]
CANDIDATES += [
    PrefillConfig(128, n, w, 3, tma=n == 32, warp_specialize=True)
    for n, w in itertools.product((32, 64, 128), (4, 8))
    if n != 64 or w == 4
]
INSTALL_MARGIN = 0.03  # a config must beat the current choice by this much (noise)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON record")
    parser.add_argument("--install", action="store_true", help="write the tuned table")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--top", type=int, default=3, help="sweep winners timed everywhere")
    parser.add_argument(
        "--candidates", help="comma-separated config keys to sweep (default: all CANDIDATES)"
    )
    args = parser.parse_args(argv)
    try:
        candidates = (
            [PrefillConfig.from_key(key) for key in args.candidates.split(",")]
            if args.candidates
            else CANDIDATES
        )
    except ValueError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        sys.exit("bench.prefill_attention times CUDA kernels; no CUDA device is visible")
    device = torch.device("cuda")
    shapes = real_shapes(args.models.split(","))
    sweep_shapes = [s for s in shapes if is_sweep_shape(s, shapes[0].model)]
    record = run(shapes, sweep_shapes, candidates, args.top, device)
    if args.install:
        record["installed"] = install_faster(record, torch.cuda.get_device_name(device))
    write_record(record, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


def real_shapes(models: list[str]) -> list[PrefillShape]:
    """The shapes of the module docstring, model by model, pages of 32 before 16."""
    from engine.loader.dummy import dummy_hf_config
    from engine.models.arch import ModelArch

    shapes = []
    for model, block_size in itertools.product(models, BLOCK_SIZES):
        arch = ModelArch.from_hf_config(dummy_hf_config(model))
        heads = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads)
        batches = [(1, CHUNK_TOKENS, c) for c in CHUNK_CONTEXTS]
        batches.append((BATCH_SEQS, BATCH_TOKENS, BATCH_CONTEXT))
        shapes += [
            PrefillShape(model, **heads, head_dim=arch.head_dim, block_size=block_size,
                         num_seqs=n, query_len=q, context_len=c)
            for n, q, c in batches
        ]  # fmt: skip
    return shapes


def is_sweep_shape(shape: PrefillShape, model: str) -> bool:
    """Where every candidate runs: ``model`` with pages of 32 (the engine's default), the
    8192-token chunk over no context and over 16k (the issue's step), and the batch."""
    return (
        shape.model == model
        and shape.block_size == 32
        and (shape.context_len in (0, 16384) or shape.num_seqs > 1)
    )


def run(
    shapes: list[PrefillShape],
    sweep_shapes: list[PrefillShape],
    candidates: list[PrefillConfig],
    top: int,
    device: torch.device,
) -> dict[str, Any]:
    """Every candidate on ``sweep_shapes``, then the best ``top`` of them on the other
    shapes: the bench record."""
    clock = Progress()
    results = [measure(shape, candidates, device, clock) for shape in sweep_shapes]
    finalists = rank(results)[:top]
    for shape in shapes:
        if shape not in sweep_shapes:
            results.append(measure(shape, finalists, device, clock))
    return {
        "kind": "prefill_attention",
        "created_utc": utc_now(),
        "machine": machine_info(device),
        "settings": {"candidates": [c.key for c in candidates], "top": top,
                     "sweep_shapes": [s.name for s in sweep_shapes]},
        "finalists": [c.key for c in finalists],
        "results": results,
        "chosen": choose(results),
        "elapsed_s": round(clock.elapsed_s(), 1),
    }  # fmt: skip


def measure(
    shape: PrefillShape, configs: list[PrefillConfig], device: torch.device, clock: Progress
) -> dict[str, Any]:
    """One shape: the flash SDPA reference, then each of ``configs``, the launcher's current
    choice and ``FALLBACK`` (the shape before the table), checked and timed."""
    current = current_config(shape, device)
    configs = list(dict.fromkeys([*configs, current, FALLBACK]))  # once each
    problem = PrefillProblem.build(shape, device)
    sdpa_ms, sdpa_error = sdpa_flash_ms(problem)
    clock.say(f"{shape.name}: flash SDPA {_ms_text(sdpa_ms, shape)}{sdpa_error or ''}")
    timings: dict[str, dict[str, Any]] = {}
    for config in configs:
        error = problem.check(config)
        if error is not None:
            timings[config.key] = {"error": error}
            clock.say(f"{shape.name} {config.key}: skipped, {error}")
            continue
        ms = time_ms(functools.partial(problem.run, config), device)
        timings[config.key] = {"ms": round(ms, 4), "tflops": shape.flops / ms / 1e9}
        if sdpa_ms is not None:
            timings[config.key]["of_sdpa"] = round(sdpa_ms / ms, 3)
        clock.say(f"{shape.name} {config.key}: {_ms_text(ms, shape)}")
    timed = {key: t["ms"] for key, t in timings.items() if "ms" in t}
    best = min(timed, key=timed.__getitem__) if timed else None
    path = sdpa_path(problem, device)
    clock.say(f"{shape.name} SDPA path: {_ms_text(path.get('ms'), shape)}{path.get('error', '')}")
    summary = {"shape": shape.name, "table_key": shape.table_key, "flops": shape.flops,
               "current": current.key, "best": best, "best_tflops": timings[best]["tflops"] if best else None,
               "best_of_sdpa": timings[best].get("of_sdpa") if best else None,
               "sdpa_ms": sdpa_ms, "sdpa_error": sdpa_error, "sdpa_path": path}  # fmt: skip
    if best and "ms" in path:  # the engine's two prefill paths on this shape
        path["speedup_over_best"] = round(timings[best]["ms"] / path["ms"], 3)
    return {"summary": summary, "shape": dataclasses.asdict(shape), "configs": timings}


def sdpa_path(problem: PrefillProblem, device: torch.device) -> dict[str, Any]:
    """The engine's ``PAGESTREAM_PREFILL_ATTN=sdpa`` path on the problem (the pages' copy, the
    cuDNN calls and the merge, all in the time, called eagerly as the engine's mixed steps
    call attention), checked, then timed; or why it could not."""
    error = problem.check_sdpa_path()  # the first call on this shape (cuDNN builds its graphs)
    if error is not None:
        return {"error": error}
    first_ms = problem.first_sdpa_call_ms
    assert first_ms is not None  # set by a check that passed
    ms = time_ms(problem.run_sdpa_path, device, eager=True)
    return {"ms": round(ms, 4), "tflops": problem.shape.flops / ms / 1e9,
            "first_call_ms": round(first_ms, 1),
            "engine_takes_it": engine_takes_sdpa(problem.shape)}  # fmt: skip


def engine_takes_sdpa(shape: PrefillShape) -> bool:
    """Whether the engine sends this shape's chunks to the SDPA path (``_sdpa_chunks``: long
    enough chunks over a long enough context, few enough of them a step); the path is timed on
    every shape, and the record says where that is the engine's choice."""
    from engine.attention import backend

    seq_len = shape.context_len + shape.query_len
    return (
        backend.sdpa_takes_chunk(shape.query_len, seq_len)
        and shape.num_seqs <= backend.SDPA_MAX_CHUNKS
    )


def rank(results: list[dict[str, Any]]) -> list[PrefillConfig]:
    """Configs that passed on every result, by their mean time over the fastest's (so each
    shape weighs the same, however long it takes)."""
    return [PrefillConfig.from_key(key) for key in _mean_ratios(results)]


def choose(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per table row: the config of least mean time over the fastest's across its shapes."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        rows.setdefault(result["summary"]["table_key"], []).append(result)
    chosen = {}
    for key, row_results in rows.items():
        ratios = _mean_ratios(row_results)
        if ratios:
            best = next(iter(ratios))
            chosen[key] = {"config": best, "mean_ratio_to_best": round(ratios[best], 4),
                           "ratios": {k: round(r, 4) for k, r in ratios.items()}}  # fmt: skip
    return chosen


def _mean_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """Config key -> mean over ``results`` of its time / the shape's best, ascending; only
    configs timed on every result."""
    common = set.intersection(*({k for k, t in r["configs"].items() if "ms" in t} for r in results))
    ratios = {}
    for key in common:
        per_shape = [
            r["configs"][key]["ms"] / r["configs"][r["summary"]["best"]]["ms"] for r in results
        ]
        ratios[key] = sum(per_shape) / len(per_shape)
    return dict(sorted(ratios.items(), key=lambda item: (item[1], item[0])))


def current_config(shape: PrefillShape, device: torch.device) -> PrefillConfig:
    """What the launcher would pick for ``shape`` today (table, else default)."""
    from kernels.attention.prefill_tuning import config_for

    q = torch.empty(1, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
    pool = torch.empty(1, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=q.dtype,
                       device=device)  # fmt: skip
    return config_for(q, pool)


def install_faster(
    record: dict[str, Any], device_name: str, path: Path | None = None
) -> dict[str, str]:
    """Install each table row's chosen config where its mean ratio beats the current
    choice's (at the time of the run) by INSTALL_MARGIN; returns the installed rows."""
    from kernels.attention.prefill_tuning import install

    installed = {}
    for key, choice in record["chosen"].items():
        current = next(
            r["summary"]["current"] for r in record["results"] if r["summary"]["table_key"] == key
        )
        current_ratio = choice["ratios"].get(current, float("inf"))  # inf: it failed
        if choice["mean_ratio_to_best"] < (1 - INSTALL_MARGIN) * current_ratio:
            installed[key] = choice["config"]
    if installed:
        install(device_name, {k: PrefillConfig.from_key(c) for k, c in installed.items()}, path)
    return installed


class Progress:
    """Progress lines on stderr, stamped with the seconds since the bench started."""

    def __init__(self) -> None:
        self.start_s = time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s

    def say(self, line: str) -> None:
        print(f"[{self.elapsed_s():6.1f} s] {line}", file=sys.stderr, flush=True)


def _ms_text(ms: float | None, shape: PrefillShape) -> str:
    if ms is None:
        return "n/a "
    return f"{ms:.3f} ms, {shape.flops / ms / 1e9:.0f} TFLOP/s"


if __name__ == "__main__":
    main()
