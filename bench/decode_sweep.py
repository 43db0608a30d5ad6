"""Decode attention variants at throughput-sized batches: one layer of llama3-8b's heads.

    python -m bench.decode_sweep --output-json bench/results/decode-attention-sweep-h100.json

Times the Triton decode kernel for every combination of split count, warps, pipeline stages
and K/V tile size on uniform and mixed context lengths, with each variant's output checked
against the default's, and prints the best per shape beside the default (1 split, 4 warps,
3 stages, 16 KB tiles). CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
import triton

import kernels.attention.paged_attention_triton as decode

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 32
SPLITS, WARPS, STAGES, TILE_BYTES = (1, 2, 4), (4, 8), (2, 3, 4), (16384, 32768)
DEFAULT = (1, 4, 3, 16384)


def _case(lens: list[int], device: torch.device) -> tuple[Callable[[int], torch.Tensor], int]:
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
    q = torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def run(num_splits: int) -> torch.Tensor:
        return decode.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, starts,
            scale=HEAD_DIM**-0.5, max_query_len=1, num_kv_splits=num_splits,
        )  # fmt: skip

    return run, sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()


def sweep(device: torch.device) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    cases = {
        "b64-u1000": [1000] * 64,
        "b144-u1000": [1000] * 144,
        "b256-u1000": [1000] * 256,
        "b144-mixed": torch.randint(100, 2048, (144,), generator=gen).tolist(),
    }
    built = {name: _case(lens, device) for name, lens in cases.items()}
    expected = {name: run(1).float() for name, (run, _) in built.items()}
    rows = []
    for splits, warps, stages, tile in itertools.product(SPLITS, WARPS, STAGES, TILE_BYTES):
        decode.DECODE_NUM_WARPS, decode.DECODE_NUM_STAGES = warps, stages
        decode.DECODE_TILE_BYTES = tile
        for name, (run, num_bytes) in built.items():
            error = (run(splits).float() - expected[name]).abs().max().item()
            time_us = triton.testing.do_bench(lambda r=run, s=splits: r(s), warmup=20, rep=100)
            time_us *= 1e3
            rows.append(
                dict(case=name, splits=splits, warps=warps, stages=stages, tile_bytes=tile,
                     time_us=time_us, bytes_per_s=num_bytes / time_us * 1e6, max_error=error)
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default="decode-attention-sweep.json")
    args = parser.parse_args(argv)
    from bench.records import machine_info

    rows = sweep(torch.device("cuda"))
    for name in dict.fromkeys(row["case"] for row in rows):
        mine = [row for row in rows if row["case"] == name]
        best = min(mine, key=lambda row: row["time_us"])
        default = next(
            row for row in mine
            if (row["splits"], row["warps"], row["stages"], row["tile_bytes"]) == DEFAULT
        )  # fmt: skip
        print(f"{name}: default {default['time_us']:.1f} us, best {best['time_us']:.1f} us {best}")
    record = {
        "kind": "decode-sweep",
        "machine": machine_info(torch.device("cuda")),
        "results": rows,
    }
    with open(args.output_json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
