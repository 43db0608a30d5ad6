"""Kernel modules for tests that run Triton kernels: on the CPU through Triton's interpreter.

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its module is
first imported. Another test module (through the engine) may have imported a kernel module
before the variable was set: such modules are reloaded, in the order given (dependencies
before dependents, so that a reload sees the reloaded helpers).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def import_kernels(module_names: tuple[str, ...]) -> dict[str, ModuleType]:
    """``module_names`` by their last component, decorated for the interpreter without a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    modules: dict[str, ModuleType] = {}
    stale = False
    for name in module_names:
        module = importlib.import_module(name)
        jitted = [v for v in vars(module).values() if hasattr(v, "fn") and hasattr(v, "run")]
        stale = stale or (not CUDA and not all(isinstance(v, InterpretedFunction) for v in jitted))
        modules[name.rsplit(".", 1)[1]] = importlib.reload(module) if stale else module
    return modules
