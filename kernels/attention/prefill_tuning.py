"""Launch shapes of the prefill attention kernel: built-in defaults and a measured table.

A ``PrefillConfig`` is the kernel's tile (``block_m`` dot rows = tokens x heads of the GQA
group, ``block_n`` keys), its warps and pipeline stages, and two Hopper options: ``tma``
(K and V tiles fetched by the tensor memory accelerator, one page per tile, so ``block_n``
must equal the page size) and ``warp_specialize`` (the compiler splits the loop over whole
key tiles into producer and consumer warps). The launcher asks ``config_for``, which
answers, in order:

1. the measured table ``prefill_configs.json`` (beside this file, written by
   ``python -m bench.prefill_attention --install``): device name
   (``torch.cuda.get_device_name``) -> ``table_key(...)`` -> config key (``m128n64w8s3``);
2. the built-in default for the GPU's compute capability, head dim and dtypes;
3. ``FALLBACK``, the shape the kernel had before the table (any GPU, and the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

TUNED_PATH = Path(__file__).with_name("prefill_configs.json")
VALID_NUM_WARPS = (1, 2, 4, 8, 16)
MIN_BLOCK = 16  # tl.dot needs 16 rows and 16 columns at least


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """The prefill kernel's tile and launch: powers of two, checked on creation."""

    block_m: int  # dot rows per program: tokens x query heads of the group
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V tiles by TMA descriptor loads: sm_90+, block_n == page size
    warp_specialize: bool = False  # the unmasked key loop warp-specialized (Triton's own)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {value}")
        if self.num_warps not in VALID_NUM_WARPS:
            raise ValueError(f"num_warps must be one of {VALID_NUM_WARPS}, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    @property
    def key(self) -> str:
        """``m128n64w8s3`` (``-tma``, ``-ws`` after it when set): how the table and the bench
        records name a config."""
        key = f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
        return key + "-tma" * self.tma + "-ws" * self.warp_specialize

    @classmethod
    def from_key(cls, key: str) -> PrefillConfig:
        """``key``'s inverse."""
        match = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)(-tma)?(-ws)?", key)
        if match is None:
            raise ValueError(f"not a prefill config key (like m128n64w8s3-tma): {key!r}")
        block_m, block_n, num_warps, num_stages = map(int, match.groups()[:4])
        tma, warp_specialize = (flag is not None for flag in match.groups()[4:])
        return cls(block_m, block_n, num_warps, num_stages, tma, warp_specialize)


# The shape before the table: 64 x 64 tiles, 4 warps, 2 stages. Safe on every GPU that runs
# Triton (about 48 KB of shared memory at D=128 bf16) and fast enough under the interpreter.
FALLBACK = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
# Hopper (sm_90), 16-bit q, D <= 128: two warpgroups over 128 dot rows, three stages of
# 128-key K and V tiles (32 KB of q + 3 x 64 KB in flight: 224 of the 227 KB of shared
# memory). The sweeps of bench/prefill_attention.py chose it (or its 4-stage twin, within
# 1%) on both Hopper cards measured, H100 and H200, for GQA groups of 2 and 4; the 64-key
# tile it replaced was 12-19% slower there. Other sm_90 parts (H800, H20, GH200) get it too.
HOPPER = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
HOPPER_MAX_HEAD_DIM = 128


def default_config(
    head_dim: int, q_dtype: torch.dtype, capability: tuple[int, int]
) -> PrefillConfig:
    """The built-in choice for a GPU of ``capability`` (``(0, 0)``: no GPU)."""
    is_16_bit = q_dtype in (torch.float16, torch.bfloat16)
    if capability[0] == 9 and is_16_bit and head_dim <= HOPPER_MAX_HEAD_DIM:
        return HOPPER
    return FALLBACK


def table_key(
    head_dim: int, group: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int
) -> str:
    """``d=128,group=2,q=bfloat16,kv=bfloat16,page=32``: one row of the measured table."""
    return (
        f"d={head_dim},group={group},q={_dtype_name(q_dtype)},kv={_dtype_name(kv_dtype)},"
        f"page={block_size}"
    )


def config_for(q: torch.Tensor, k_cache: torch.Tensor) -> PrefillConfig:
    """The launch shape for ``q [T, Hq, D]`` over a ``k_cache [NB, BS, Hkv, D]`` pool."""
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    if not q.is_cuda:
        return FALLBACK
    return _cached_config_for(q.device, head_dim, group, q.dtype, k_cache.dtype, k_cache.shape[1])


@functools.cache
def _cached_config_for(
    device: torch.device,
    head_dim: int,
    group: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
) -> PrefillConfig:
    """Once per (device, shape): the launcher runs on every layer of every prefill step."""
    default = default_config(head_dim, q_dtype, torch.cuda.get_device_capability(device))
    key = table_key(head_dim, group, q_dtype, kv_dtype, block_size)
    return tuned_for(torch.cuda.get_device_name(device), key, default)


def tuned_for(
    device_name: str, key: str, default: PrefillConfig, path: Path | None = None
) -> PrefillConfig:
    """The table's config for ``key`` on ``device_name`` (default table: ``TUNED_PATH``),
    else ``default``."""
    return _table(path or TUNED_PATH).get(device_name, {}).get(key, default)


@functools.cache
def _table(path: Path) -> dict[str, dict[str, PrefillConfig]]:
    if not path.exists():
        return {}
    raw: dict[str, dict[str, str]] = json.loads(path.read_text())
    return {
        device: {key: PrefillConfig.from_key(config) for key, config in shapes.items()}
        for device, shapes in raw.items()
    }


def install(device_name: str, configs: dict[str, PrefillConfig], path: Path | None = None) -> None:
    """Merge ``configs`` (table key -> config) into the table for ``device_name``."""
    path = path or TUNED_PATH
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    shapes = raw.setdefault(device_name, {})
    shapes.update({key: config.key for key, config in configs.items()})
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    _table.cache_clear()  # the next lookup reads the file again
    _cached_config_for.cache_clear()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
