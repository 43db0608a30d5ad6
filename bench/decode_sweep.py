"""Decode attention variants: one layer of llama3-8b's (or qwen3-0.6b's) heads.

    python -m bench.decode_sweep --output-json bench/results/decode-attention-sweep-h100.json
    python -m bench.decode_sweep --long --output-json bench/results/decode-long-sweep-h100.json

Times the Triton decode kernel, replayed from a CUDA graph, for every combination of split
count, warps, pipeline stages and K/V tile size (and with ``--modes even,balanced`` each way
of cutting contexts into splits), with each variant's output checked against the unsplit
default's, and prints the best per shape beside the default (1 split, 4 warps, 3 stages,
16 KB tiles) and beside the split count the engine would choose (``default_num_kv_splits``;
older records, made before the graphs, timed eager launches). The cases are
throughput-sized batches of 1k contexts and qwen3-0.6b's small batches of mixed lengths, or
with ``--long`` the long-context matrix row's decodes: 8-32 sequences of 16k-32k tokens, where
the step reads tens of GB of KV and the bandwidth reached (against a device copy's, in the
record) is what counts. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import triton

import kernels.attention.paged_attention_triton as decode

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 32
LLAMA_Q_HEADS, QWEN_Q_HEADS = 32, 16  # llama3-8b: groups of 4; qwen3-0.6b: groups of 2
SPLITS, WARPS, STAGES, TILE_BYTES = (1, 2, 4, 8), (4, 8), (2, 3, 4), (16384, 32768)
SMALL_BATCHES = (16, 32, 48)
LONG_SPLITS = (1, 2, 4, 8, 16)
DEFAULT = (1, 4, 3, 16384)


def _case(
    lens: list[int], device: torch.device, num_q_heads: int = LLAMA_Q_HEADS
) -> tuple[Callable[[int], torch.Tensor], int]:
    """A decode call over random pages for these context lengths, and the K/V bytes it reads."""
    pages = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(pages) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    order, width, tables = torch.randperm(num_blocks - 1).tolist(), max(pages), []
    for n in pages:
        tables.append(order[:n] + [num_blocks - 1] * (width - n))
        order = order[n:]
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), num_q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def run(num_splits: int) -> torch.Tensor:
        return decode.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, starts,
            scale=HEAD_DIM**-0.5, max_query_len=1, num_kv_splits=num_splits,
        )  # fmt: skip

    return run, sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()


def _cases(long: bool) -> dict[str, tuple[list[int], int]]:
    """Case name -> (context lengths, query heads)."""
    gen = torch.Generator().manual_seed(0)
    if long:
        return {
            "llama-b8-u32k": ([32768] * 8, LLAMA_Q_HEADS),
            "llama-b16-u32k": ([32768] * 16, LLAMA_Q_HEADS),
            "llama-b32-u16k": ([16384] * 32, LLAMA_Q_HEADS),
            "qwen-b16-u32k": ([32768] * 16, QWEN_Q_HEADS),
            "qwen-b32-u32k": ([32768] * 32, QWEN_Q_HEADS),
        }
    cases = {
        "b64-u1000": ([1000] * 64, LLAMA_Q_HEADS),
        "b144-u1000": ([1000] * 144, LLAMA_Q_HEADS),
        "b256-u1000": ([1000] * 256, LLAMA_Q_HEADS),
        "b144-mixed": (torch.randint(100, 2048, (144,), generator=gen).tolist(), LLAMA_Q_HEADS),
    }
    # qwen3-0.6b's standard-64 row: its decode steps hold 36 sequences on average (64 draining
    # to 1) of 100-2,048 tokens, and there the decode kernel read at about 0.6 of the H200's
    # bandwidth (2026-11-28): few programs per SM, so the split count matters most
    for batch in SMALL_BATCHES:
        lens = torch.randint(100, 2048, (batch,), generator=gen).tolist()
        cases[f"qwen-b{batch}-mixed"] = (lens, QWEN_Q_HEADS)
    return cases


def sweep(
    device: torch.device, long: bool = False, modes: tuple[str, ...] = ("even",)
) -> list[dict[str, Any]]:
    """Every variant on every case, each split mode (``PAGESTREAM_DECODE_SPLITS``) in turn."""
    cases = _cases(long)
    built = {name: _case(lens, device, heads) for name, (lens, heads) in cases.items()}
    expected = {name: run(1).float() for name, (run, _) in built.items()}
    rows = []
    splits_swept = LONG_SPLITS if long else SPLITS
    variants = itertools.product(modes, splits_swept, WARPS, STAGES, TILE_BYTES)
    for mode, splits, warps, stages, tile in variants:
        os.environ[decode.SPLITS_ENV] = mode
        decode.balanced_splits.cache_clear()  # read once per process otherwise
        decode.DECODE_NUM_WARPS, decode.DECODE_NUM_STAGES = warps, stages
        decode.DECODE_TILE_BYTES = tile
        for name, (run, num_bytes) in built.items():
            error = (run(splits).float() - expected[name]).abs().max().item()
            time_us = _graph_time_us(functools.partial(run, splits))
            rows.append(
                dict(case=name, mode=mode, splits=splits, warps=warps, stages=stages,
                     tile_bytes=tile, time_us=time_us, bytes_per_s=num_bytes / time_us * 1e6,
                     max_error=error)
            )  # fmt: skip
    return rows


def _graph_time_us(fn: Callable[[], torch.Tensor]) -> float:
    """``fn``'s time replayed from a CUDA graph, as a decode step runs it: timed eagerly, a
    small case measures the launch (tens of microseconds of Python) more than the kernel."""
    fn()  # compiled before the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=50)) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default="decode-attention-sweep.json")
    parser.add_argument(
        "--long", action="store_true",
        help="the long-context cases (8-32 sequences of 16k-32k tokens) and up to 16 splits",
    )  # fmt: skip
    parser.add_argument(
        "--modes", default="even",
        help="split modes to sweep, comma-separated: even (the default's), balanced",
    )  # fmt: skip
    args = parser.parse_args(argv)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    if not modes or not set(modes) <= set(decode.SPLIT_MODES):
        parser.error(f"--modes: give some of {', '.join(decode.SPLIT_MODES)}")
    from bench.kernels import measure_copy_bandwidth
    from bench.records import machine_info

    device = torch.device("cuda")
    rows = sweep(device, args.long, modes)
    copy_bytes_per_s = measure_copy_bandwidth(device)
    cases = _cases(args.long)
    chosen = {}
    for name in dict.fromkeys(row["case"] for row in rows):
        mine = [row for row in rows if row["case"] == name]
        best = min(mine, key=lambda row: row["time_us"])
        lens, _ = cases[name]
        engine_splits = decode.default_num_kv_splits(len(lens), NUM_KV_HEADS, device, max(lens))
        engine = next(
            row for row in mine
            if (row["mode"], row["splits"], row["warps"], row["stages"], row["tile_bytes"])
            == (modes[0], engine_splits, *DEFAULT[1:])
        )  # fmt: skip
        chosen[name] = {"engine": engine, "best": best}
        print(
            f"{name}: engine's ({engine_splits} splits) {engine['time_us']:.1f} us "
            f"{engine['bytes_per_s'] / copy_bytes_per_s:.2f} of copy; best "
            f"{best['time_us']:.1f} us {best['bytes_per_s'] / copy_bytes_per_s:.2f} {best}"
        )
    record = {
        "kind": "decode-sweep",
        "machine": machine_info(device),
        "copy_bytes_per_s": copy_bytes_per_s,
        "chosen": chosen,
        "results": rows,
    }
    with open(args.output_json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
