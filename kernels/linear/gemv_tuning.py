"""Tuned decode linears by GPU and shape, measured by ``python -m bench.gemv --install``.

``gemv_configs.json`` (beside this file) maps a device name (``torch.cuda.get_device_name``)
to shape keys ``rows=M,n=N,k=K,silu=0|1`` and what ran that shape fastest in the sweep: a
``GemvConfig`` of the Triton GEMV, or ``"cublas"`` (``F.linear``, after the activation kernel
for a fused down projection). A shape the table lacks keeps the caller's default: the table
only ever replaces a measured choice with a faster measured one.

Lookups return the choice as ``GemvConfig | None``, where ``None`` is cuBLAS.
``PAGESTREAM_GEMV_TABLE`` names another table file, or ``off`` for none (the callers'
defaults everywhere: how a sweep's effect on a whole decode step is measured).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from kernels.linear.gemv_triton import GemvConfig

TUNED_PATH = Path(__file__).with_name("gemv_configs.json")
TABLE_ENV = "PAGESTREAM_GEMV_TABLE"
CUBLAS = "cublas"  # the table's word for "F.linear beat every GEMV shape here"
_ABSENT = object()


def shape_key(num_rows: int, num_cols: int, size_k: int, silu_mul: bool) -> str:
    return f"rows={num_rows},n={num_cols},k={size_k},silu={int(silu_mul)}"


@functools.cache
def _table(path: Path = TUNED_PATH) -> dict[str, dict[str, GemvConfig | None]]:
    if not path.exists():
        return {}
    raw: dict[str, dict[str, Any]] = json.loads(path.read_text())
    return {
        device: {key: _choice(value) for key, value in shapes.items()}
        for device, shapes in raw.items()
    }


def _choice(value: Any) -> GemvConfig | None:
    if value == CUBLAS:
        return None
    return GemvConfig(**value)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def tuned_config(
    weight: torch.Tensor, num_rows: int, silu_mul: bool, default: GemvConfig | None
) -> GemvConfig | None:
    """What runs ``x [num_rows, K] @ weight.T`` on ``weight``'s GPU: the table's choice (a
    GEMV launch shape, or ``None`` for cuBLAS), else ``default`` (the same meaning)."""
    if not weight.is_cuda:
        return default
    table = os.environ.get(TABLE_ENV, "").strip()
    if table.lower() == "off":
        return default
    num_cols, size_k = weight.shape
    key = shape_key(num_rows, num_cols, size_k, silu_mul)
    return tuned_for(_device_name(weight.device), key, default, Path(table or TUNED_PATH))


def tuned_for(
    device_name: str, key: str, default: GemvConfig | None, path: Path = TUNED_PATH
) -> GemvConfig | None:
    """The table's choice for ``key`` on ``device_name`` (``None``: cuBLAS), else ``default``."""
    choice = _table(path).get(device_name, {}).get(key, _ABSENT)
    return default if choice is _ABSENT else choice  # type: ignore[return-value]


def install(
    device_name: str, choices: dict[str, GemvConfig | None], path: Path = TUNED_PATH
) -> None:
    """Merge ``choices`` (shape key -> config, or ``None`` for cuBLAS) into the table for
    ``device_name``."""
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    shapes = raw.setdefault(device_name, {})
    shapes.update(
        {
            key: CUBLAS if choice is None else dataclasses.asdict(choice)
            for key, choice in choices.items()
        }
    )
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    _table.cache_clear()  # every path's: the next lookup reads the file again
