"""Tuned GEMV launch shapes by GPU and shape, measured by ``python -m bench.gemv --install``.

``gemv_configs.json`` (beside this file) maps a device name (``torch.cuda.get_device_name``)
to shape keys ``rows=M,n=N,k=K,silu=0|1`` and their fastest ``GemvConfig`` in the sweep. A
shape the table lacks keeps the caller's default: the table only ever replaces a measured
choice with a faster measured one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import torch

from kernels.linear.gemv_triton import GemvConfig

TUNED_PATH = Path(__file__).with_name("gemv_configs.json")


def shape_key(num_rows: int, num_cols: int, size_k: int, silu_mul: bool) -> str:
    return f"rows={num_rows},n={num_cols},k={size_k},silu={int(silu_mul)}"


@functools.cache
def _table(path: Path = TUNED_PATH) -> dict[str, dict[str, GemvConfig]]:
    if not path.exists():
        return {}
    raw: dict[str, dict[str, dict[str, int]]] = json.loads(path.read_text())
    return {
        device: {key: GemvConfig(**fields) for key, fields in shapes.items()}
        for device, shapes in raw.items()
    }


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def tuned_config(
    weight: torch.Tensor, num_rows: int, silu_mul: bool, default: GemvConfig | None
) -> GemvConfig | None:
    """The tuned launch shape of ``x [num_rows, K] @ weight.T`` on ``weight``'s GPU, else
    ``default``."""
    if not weight.is_cuda:
        return default
    num_cols, size_k = weight.shape
    key = shape_key(num_rows, num_cols, size_k, silu_mul)
    return tuned_for(_device_name(weight.device), key, default)


def tuned_for(
    device_name: str, key: str, default: GemvConfig | None, path: Path = TUNED_PATH
) -> GemvConfig | None:
    """The table's config for ``key`` on ``device_name``, else ``default``."""
    return _table(path).get(device_name, {}).get(key, default)


def install(device_name: str, configs: dict[str, GemvConfig], path: Path = TUNED_PATH) -> None:
    """Merge ``configs`` (shape key -> config) into the table for ``device_name``."""
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    shapes = raw.setdefault(device_name, {})
    shapes.update({key: dataclasses.asdict(config) for key, config in configs.items()})
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    _table.cache_clear()  # every path's: the next lookup reads the file again
