"""Block sizes of the fused-MoE GEMMs per expert shape and token count, measured on this GPU.

    python -m bench.moe_sweep --models qwen3-30b-a3b,mixtral-8x7b \\
        --output-json $OUT/moe-sweep-h100.json [--install]

For each model's expert shape (bf16 activations; weights bf16, or with ``--fp8`` float8
e4m3 with row scales as ``--quantization fp8`` holds them; ``--tp N``: the width one of N
ranks holds) and each token count, on random routing: for every ``block_m`` of ``BLOCK_MS``
up to four times the rows per expert, every tile of ``TILE_GRID`` for gate/up and for down
is timed with ``triton.testing.do_bench`` (median; the L2 flushed between calls, as a
model's next layer finds it), and up to ``DIRECT_MAX_PAIRS`` pairs the direct path's GEMV
tiles (``DIRECT_GRID``, ``block_m`` 1) too, its down GEMM both ways: a program per token
walking the slots, and split over the slots (``split_slots``; the record's ``direct`` has
the best tile and time of each, and of its gate/up). Each ``block_m``'s best tiles make a
candidate (the direct path two, one per down kernel); the candidate whose whole MoE layer
(route to sum) runs fastest is the entry, checked against the torch reference and timed
beside the default config (``kernels/moe/config.default_config``). Up to
``GRAPHED_MAX_TOKENS`` tokens, kernels and layers are timed replayed from a CUDA graph, as
the engine runs decode steps: launched from Python, a kernel of a few microseconds is timed
at the launches' pace.

The record's ``entries`` are the table ``kernels/moe/config.py`` reads: ``--install`` merges
them into ``kernels/moe/tuned_configs.json`` (replacing entries of the same device, shape and
token count), ``--install-from RECORD`` does so later (no GPU needed), or point
``PAGESTREAM_MOE_CONFIGS`` at the record.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

from bench.first_calls import first_calls
from bench.records import machine_info, utc_now, write_record
from engine.loader.dummy import dummy_hf_config
from engine.models.arch import ModelArch
from kernels.moe.align_triton import MoeAlignment, align_pairs
from kernels.moe.config import (
    DIRECT_BLOCK_M,
    TUNED_CONFIGS_PATH,
    GemmTile,
    MoeConfig,
    MoeShape,
    default_config,
)
from kernels.moe.direct_triton import down_sum_direct, gate_up_silu_direct
from kernels.moe.fused_moe_triton import fused_moe, moe_shape
from kernels.moe.grouped_gemm_triton import down_weighted, gate_up_silu
from kernels.moe.moe import fused_moe_ref, quantize_experts_fp8
from kernels.moe.router_triton import route_topk
from kernels.moe.split_slot_buffers import SplitSlotBuffers

DTYPE = torch.bfloat16
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192)
BLOCK_MS = (16, 32, 64, 128)
TILE_GRID = [  # (block_n, block_k, num_warps, num_stages)
    GemmTile(*tile)
    for tile in (
        (32, 64, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
        (64, 256, 4, 3), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 3),
        (256, 64, 8, 3), (256, 128, 8, 3),
    )
]  # fmt: skip
DIRECT_GRID = [  # the direct path's GEMV tiles (block_n, block_k, num_warps, num_stages)
    GemmTile(*tile)
    for tile in (
        (4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3),
        (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 8, 3), (64, 128, 4, 3), (16, 1024, 8, 2),
        (4, 1024, 4, 2), (8, 1024, 8, 2), (8, 512, 8, 3), (16, 256, 8, 3), (8, 128, 4, 4),
        (16, 128, 4, 4), (32, 128, 8, 4), (8, 2048, 8, 1), (4, 2048, 4, 1),
        # a row or a few per program and one or two warps: at 1-8 tokens the most programs
        # keep the most bytes in flight (on an H200 these won gate/up and down, 1-8 tokens)
        (4, 256, 2, 4), (8, 256, 2, 4), (2, 1024, 2, 2), (4, 512, 2, 3), (4, 1024, 2, 2),
        (2, 1024, 4, 2), (2, 2048, 2, 1), (1, 2048, 2, 1), (2, 512, 1, 3), (2, 1024, 1, 2),
        (4, 512, 1, 3), (2, 256, 1, 4), (1, 2048, 1, 1), (1, 1024, 1, 2), (1, 512, 1, 3),
    )
]  # fmt: skip
DIRECT_MAX_PAIRS = 64  # token counts whose pairs are this few also try the direct path
GRAPHED_MAX_TOKENS = 256  # the engine's decode graphs: up to max_seqs (256 by default) rows
CHECK_TOLERANCE = 2e-2  # bf16: the kernels and the reference round at the same points


@dataclass
class Layer:
    """One MoE layer's weights and a step's inputs at one token count."""

    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    logits: torch.Tensor
    top_k: int
    renormalize: bool
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    # kept as the engine keeps them: a split-slot call allocates nothing
    direct_buffers: SplitSlotBuffers = field(default_factory=SplitSlotBuffers)

    @property
    def shape(self) -> MoeShape:
        return moe_shape(self.w13, self.top_k, DTYPE)

    @property
    def graphed(self) -> bool:
        """Whether the engine replays this many tokens from a CUDA graph (and so the sweep
        times them so)."""
        return self.x.is_cuda and self.x.shape[0] <= GRAPHED_MAX_TOKENS

    def run(self, config: MoeConfig) -> torch.Tensor:
        return fused_moe(
            self.x, self.w13, self.w2, self.logits, self.top_k, self.renormalize, config,
            self.w13_scale, self.w2_scale, self.direct_buffers,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        return fused_moe_ref(
            self.x, self.w13, self.w2, self.logits, self.top_k, self.renormalize,
            self.w13_scale, self.w2_scale,
        )  # fmt: skip


Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def make_weights(arch: ModelArch, tp: int, fp8: bool, seed: int, device: str = "cuda") -> Weights:
    """w13, w2 and (fp8) their row scales."""
    assert arch.moe is not None
    moe, gen = arch.moe, torch.Generator(device).manual_seed(seed)
    inter = moe.intermediate_size // tp
    w13 = torch.randn(moe.num_experts, 2 * inter, arch.hidden_size, device=device, generator=gen)
    w2 = torch.randn(moe.num_experts, arch.hidden_size, inter, device=device, generator=gen)
    w13, w2 = (w13 * 0.03).to(DTYPE), (w2 * 0.03).to(DTYPE)
    if not fp8:
        return w13, w2, None, None
    (w13, w13_scale), (w2, w2_scale) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    return w13, w2, w13_scale, w2_scale


def make_layer(arch: ModelArch, weights: Weights, tokens: int) -> Layer:
    assert arch.moe is not None
    device = weights[0].device
    gen = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, arch.hidden_size, device=device, generator=gen).to(DTYPE)
    logits = torch.randn(tokens, arch.moe.num_experts, device=device, generator=gen).to(DTYPE)
    w13, w2, w13_scale, w2_scale = weights
    moe = arch.moe
    return Layer(x, w13, w2, logits, moe.top_k, moe.renormalize, w13_scale, w2_scale)


def time_us(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")) * 1e3


def replayed(fn: Callable[[], object], graphed: bool) -> Callable[[], object]:
    """``fn`` to time: as it is, or (``graphed``) captured once in a CUDA graph and replayed.
    A kernel of a few microseconds launched from Python is timed at the launch's pace, not
    its own; the engine replays decode steps from graphs, so that is the time that counts."""
    if not graphed:
        return fn
    fn()  # compiled, and any kept buffers made, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def best_tile(fns: dict[GemmTile, Callable[[], object]], graphed: bool) -> tuple[GemmTile, float]:
    ok = [result is not None for result in first_calls(list(fns.values()))]
    times = {
        tile: time_us(replayed(fn, graphed))
        for (tile, fn), fits in zip(fns.items(), ok, strict=True)
        if fits
    }
    tile = min(times, key=times.__getitem__)
    return tile, times[tile]


def sweep_block_m(layer: Layer, block_m: int) -> tuple[MoeConfig, float]:
    """The fastest tiles at ``block_m`` and the time of align + both GEMMs."""
    weights, ids = route_topk(layer.logits, layer.top_k, layer.renormalize)
    num_experts = layer.w13.shape[0]
    align: MoeAlignment = align_pairs(ids, num_experts, block_m)
    act = gate_up_silu(layer.x, layer.w13, align, layer.top_k, TILE_GRID[0], layer.w13_scale)
    gate_up, gate_up_us = best_tile(
        {
            t: partial(gate_up_silu, layer.x, layer.w13, align, layer.top_k, t, layer.w13_scale)
            for t in TILE_GRID
        },
        layer.graphed,
    )
    down, down_us = best_tile(
        {
            t: partial(down_weighted, act, layer.w2, weights, align, t, layer.w2_scale)
            for t in TILE_GRID
        },
        layer.graphed,
    )
    align_us = time_us(replayed(partial(align_pairs, ids, num_experts, block_m), layer.graphed))
    return MoeConfig(block_m, gate_up, down), align_us + gate_up_us + down_us


def sweep_direct(layer: Layer) -> tuple[list[MoeConfig], dict[str, Any]]:
    """The fastest GEMV tiles of the direct path (no sort): a config with the best down tile
    of each down kernel (slots walked in order, split over the slots), and per kernel (the
    gate/up and both downs) its best tile and time."""
    weights, ids = route_topk(layer.logits, layer.top_k, layer.renormalize)
    act = gate_up_silu_direct(layer.x, layer.w13, ids, DIRECT_GRID[0], layer.w13_scale)
    gate_up, gate_up_us = best_tile(
        {
            t: partial(gate_up_silu_direct, layer.x, layer.w13, ids, t, layer.w13_scale)
            for t in DIRECT_GRID
        },
        layer.graphed,
    )
    out = torch.empty_like(layer.x)
    down = partial(down_sum_direct, act, layer.w2, weights, ids, out=out,
                   w2_scale=layer.w2_scale, buffers=layer.direct_buffers)  # fmt: skip
    # each grid's first tile runs alone before the threads: the split one allocates the buffers
    configs, kernels = [], {"gate_up": {"tile": gate_up.to_json(), "us": gate_up_us}}
    split_grid = [replace(tile, split_slots=True) for tile in DIRECT_GRID]
    for kind, grid in (("slot_order", DIRECT_GRID), ("split_slots", split_grid)):
        tile, down_us = best_tile({t: partial(down, tile=t) for t in grid}, layer.graphed)
        configs.append(MoeConfig(DIRECT_BLOCK_M, gate_up, tile))
        kernels[kind] = {"tile": tile.to_json(), "us": down_us}
    return configs, kernels


def sweep_point(layer: Layer, device_name: str) -> dict[str, Any]:
    """The entry for one shape and token count, checked against the reference."""
    tokens = layer.x.shape[0]
    rows_per_expert = tokens * layer.top_k / layer.w13.shape[0]
    block_ms = [bm for bm in BLOCK_MS if bm == BLOCK_MS[0] or bm <= 4 * rows_per_expert]
    candidates = [sweep_block_m(layer, bm)[0] for bm in block_ms]
    direct_kernels: dict[str, Any] = {}
    if tokens * layer.top_k <= DIRECT_MAX_PAIRS:
        direct, direct_kernels = sweep_direct(layer)
        candidates += direct
    # the default, then each block_m's best tiles, the whole layer (route to sum) timed: the
    # fastest wins, the default too where tiles timed one GEMM at a time lose to it as a layer
    default = default_config(layer.shape, tokens)
    whole_us = {
        config: time_us(replayed(partial(layer.run, config), layer.graphed))
        for config in [default, *candidates]
    }
    config = min(whole_us, key=whole_us.__getitem__)
    out = layer.run(config)
    error = float((out.float() - layer.reference().float()).abs().max())
    return {
        "device": device_name,
        "shape": layer.shape.key(),
        "num_tokens": tokens,
        "config": config.to_json(),
        "candidates_us": {candidate_name(c): whole_us[c] for c in candidates},
        "direct": direct_kernels,  # the direct path's kernels: each one's best tile and time
        "fused_us": whole_us[config],
        "default_config": default.to_json(),
        "default_fused_us": whole_us[default],
        "timed": "cuda graph" if layer.graphed else "eager",
        "max_abs_error": error,
        "checked": error <= CHECK_TOLERANCE * max(1.0, float(out.float().abs().max())),
    }


def candidate_name(config: MoeConfig) -> str:
    return f"block_m={config.block_m}" + (" split_slots" if config.down.split_slots else "")


def install(entries: list[dict[str, Any]], path: Path = TUNED_CONFIGS_PATH) -> None:
    """Merge ``entries`` into the table file, newer entries replacing same-key ones."""
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    key = lambda e: (e["device"], e["shape"], e["num_tokens"])  # noqa: E731
    merged = {key(e): e for e in old} | {key(e): e for e in entries}
    slim = [{k: e[k] for k in ("device", "shape", "num_tokens", "config")} for e in merged.values()]
    path.write_text(json.dumps({"entries": sorted(slim, key=key)}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.install_from:  # a record measured elsewhere (the lent GPU) into this checkout's table
        install(json.loads(Path(args.install_from).read_text())["entries"])
        print(f"merged {args.install_from} into {TUNED_CONFIGS_PATH}")
        return 0
    if not args.output_json:
        raise SystemExit("--output-json is required for a sweep")
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_sweep needs a CUDA GPU")
    device_name = torch.cuda.get_device_name()
    entries = []
    for model in args.models.split(","):
        arch = ModelArch.from_hf_config(dummy_hf_config(model))
        if arch.moe is None:
            raise SystemExit(f"{model} is not a mixture of experts")
        weights = make_weights(arch, args.tp, args.fp8, seed=0)
        for tokens in args.tokens:
            entry = sweep_point(make_layer(arch, weights, tokens), device_name)
            print(json.dumps({"model": model, **entry}), flush=True)
            entries.append({"model": model, "tp": args.tp, "fp8": args.fp8, **entry})
        del weights
        torch.cuda.empty_cache()
    record = {
        "kind": "moe-sweep",
        "created_utc": utc_now(),
        "machine": machine_info("cuda"),
        "entries": entries,
    }
    write_record(record, Path(args.output_json))
    if args.install:
        install(entries)
    failed = [e for e in entries if not e["checked"]]
    for entry in failed:
        print(f"MISMATCH {entry['shape']} tokens={entry['num_tokens']}: {entry['max_abs_error']}")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.moe_sweep", description=__doc__, allow_abbrev=False
    )
    parser.add_argument("--models", default="qwen3-30b-a3b", help="dummy MoE shapes, a,b")
    parser.add_argument("--tokens", type=lambda s: tuple(int(v) for v in s.split(",")),
                        default=TOKENS, help="token counts per step, a,b,c")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="the expert width of one of N ranks")
    parser.add_argument("--fp8", action="store_true", help="fp8 expert weights (row scales)")
    parser.add_argument("--output-json", help="where the sweep's record goes")
    parser.add_argument("--install", action="store_true",
                        help="merge the entries into kernels/moe/tuned_configs.json")  # fmt: skip
    parser.add_argument("--install-from", metavar="RECORD",
                        help="only merge a sweep record's entries into the table")  # fmt: skip
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
