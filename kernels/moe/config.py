"""Block sizes of the grouped GEMMs, per shape and token count, from a measured table.

``bench/moe_sweep.py`` times candidate configs on a GPU and writes a JSON record whose
``entries`` are the format ``tuned_configs.json`` holds (merge them there with its
``--install``/``--install-from``, or name records in ``PAGESTREAM_MOE_CONFIGS``). A lookup
takes the entry of the same device, kernel shape and dtype whose token count is the
nearest at or above the step's (else the largest); without one, ``default_config`` decides
by the expected rows per expert.

One ``block_m`` serves both GEMMs (they share the sorted layout); ``block_n``, ``block_k``,
warps and stages are each GEMM's own. ``block_m == DIRECT_BLOCK_M`` (1) is the path without
the sort, a program per (token, slot) pair (``direct_triton.py``), for a handful of pairs;
there the down tile's ``split_slots`` picks between its two down kernels.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

MOE_CONFIGS_ENV = "PAGESTREAM_MOE_CONFIGS"
TUNED_CONFIGS_PATH = Path(__file__).with_name("tuned_configs.json")
DIRECT_BLOCK_M = 1  # no sort: each pair's own program (direct_triton.py)
DIRECT_MAX_PAIRS = 16  # the default takes the direct path up to this many pairs


@dataclass(frozen=True)
class GemmTile:
    """One GEMM's launch: its tile's N and K, and the compiler's warps and stages.

    ``split_slots`` (the direct path's down GEMM only): a program per (token, column tile,
    slot) instead of one walking the token's ``top_k`` slots, the last to finish weighing and
    summing the products in slot order (``direct_triton.py``). Written to JSON only when
    set, so tables from before it read and write unchanged.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_slots: bool = False

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.split_slots:
            del data["split_slots"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GemmTile:
        return cls(**data)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def __post_init__(self) -> None:
        if self.gate_up.split_slots or (self.down.split_slots and self.block_m != DIRECT_BLOCK_M):
            raise ValueError(f"split_slots is for the direct path's down GEMM only (block_m "
                             f"{DIRECT_BLOCK_M}), got {self}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"block_m": self.block_m, "gate_up": self.gate_up.to_json(),
                "down": self.down.to_json()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MoeConfig:
        gate_up, down = GemmTile.from_json(data["gate_up"]), GemmTile.from_json(data["down"])
        return cls(data["block_m"], gate_up, down)


@dataclass(frozen=True)
class MoeShape:
    """What picks a config: the experts' count and sizes, and the element type."""

    num_experts: int
    hidden_size: int  # H: gate/up's K, down's N
    intermediate_size: int  # I (this rank's): gate/up's N (each half), down's K
    top_k: int
    dtype: str  # "bfloat16", "float16", "float32"

    def key(self) -> str:
        return (f"E{self.num_experts}_H{self.hidden_size}_I{self.intermediate_size}"
                f"_k{self.top_k}_{self.dtype}")  # fmt: skip


def default_config(shape: MoeShape, num_tokens: int) -> MoeConfig:
    """A sound choice without measurements: a handful of pairs that rarely share an expert
    take the direct path (no sort, GEMV tiles); beyond, by the rows each expert expects:
    ``block_m`` about that many (padding rows are waste, and an expert split over two blocks
    reads its weights twice), the tiles of a memory-bound GEMM while rows are few.

    The direct path reads an expert's weights once per pair, so it is taken only while the
    pairs are at most half the experts (Mixtral's 8 experts: up to 2 tokens; the sorted path
    reads each expert once). Its tiles are the ones the H200 sweeps of qwen3-30b-a3b and
    mixtral-8x7b (TP2) chose at most of these sizes, a row per program, K in steps of 1024,
    one warp (at one token their gate/up took K 2048 and two warps); the layer with the
    tiles used before (16 rows, K 256, 4 warps) took 2.0-2.2x the swept one's time at one
    token (bench/results/moe-sweep-*-h200.json, ``default_fused_us``)."""
    rows_per_expert = num_tokens * shape.top_k / shape.num_experts
    pairs = num_tokens * shape.top_k
    if pairs <= DIRECT_MAX_PAIRS and 2 * pairs <= shape.num_experts:
        gemv = GemmTile(1, 1024, 1, 2)
        config = MoeConfig(DIRECT_BLOCK_M, gemv, gemv)
    elif rows_per_expert <= 4:
        config = MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))
    elif rows_per_expert <= 24:
        config = MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3))
    elif rows_per_expert <= 96:
        config = MoeConfig(64, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3))
    else:
        config = MoeConfig(64, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 8, 4))
    if shape.dtype.startswith("float32"):  # 4-byte tiles: half the K step fits shared memory
        half_k = [replace(t, block_k=t.block_k // 2) for t in (config.gate_up, config.down)]
        config = MoeConfig(config.block_m, *half_k)
    return config


def pick_config(shape: MoeShape, num_tokens: int, device_name: str) -> MoeConfig:
    """The measured config for ``shape`` at ``num_tokens`` on ``device_name``, else the
    default."""
    entries = _table().get(device_name, {}).get(shape.key())
    if not entries:
        return default_config(shape, num_tokens)
    at_or_above = [n for n in entries if n >= num_tokens]
    return entries[min(at_or_above) if at_or_above else max(entries)]


@functools.cache
def _table() -> dict[str, dict[str, dict[int, MoeConfig]]]:
    """device name -> shape key -> token count -> config: the shipped table, then each file
    of ``PAGESTREAM_MOE_CONFIGS`` (paths joined by ``os.pathsep``), later entries winning."""
    extra = [Path(p) for p in os.environ.get(MOE_CONFIGS_ENV, "").split(os.pathsep) if p]
    for path in extra:
        if not path.is_file():
            raise FileNotFoundError(f"{MOE_CONFIGS_ENV}: no such file {path}")
    table: dict[str, dict[str, dict[int, MoeConfig]]] = {}
    for path in [TUNED_CONFIGS_PATH, *extra]:
        if not path.is_file():
            continue
        for entry in json.loads(path.read_text())["entries"]:
            by_tokens = table.setdefault(entry["device"], {}).setdefault(entry["shape"], {})
            by_tokens[int(entry["num_tokens"])] = MoeConfig.from_json(entry["config"])
    return table
