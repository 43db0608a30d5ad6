"""A launch-shape sweep's first calls, side by side in threads.

A sweep times each of a grid's launch shapes, and each shape is a kernel of its own for
Triton to compile (a second or more each): called in turn, the compiles take most of the
run. ptxas is a process of its own and Triton's passes release the GIL in part, so on CUDA
the first calls run in threads (four GEMV compiles on two busy cores: 5.0 s in threads, 7.6
s in turn). Without CUDA the calls run in turn: the interpreter patches ``triton.language``
while a kernel runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import triton

COMPILE_THREADS = min(16, os.cpu_count() or 1)

T = TypeVar("T")


def first_calls(fns: Sequence[Callable[[], T]]) -> list[T | None]:
    """Each function's first result, None where its launch shape needs more shared memory
    than the GPU has."""
    if not fns:
        return []
    first = [_fitting(fns[0])]  # the JIT's per-device caches exist before threads share them
    if not torch.cuda.is_available():
        return first + [_fitting(fn) for fn in fns[1:]]
    with ThreadPoolExecutor(COMPILE_THREADS) as pool:
        rest = list(pool.map(_fitting, fns[1:]))
    torch.cuda.synchronize()
    return first + rest


def _fitting(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except triton.runtime.errors.OutOfResources:
        return None
