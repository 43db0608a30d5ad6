# @triton.jit functions take Triton blocks, which have no Python types:
# mypy: disable-error-code="no-untyped-def"
"""Programmatic dependent launch (PDL): a decode step's kernels start before the one ahead
of them ends.

A batch-1 decode step is a chain of some three hundred small kernels, and between two of
them the GPU drains the first, then launches and ramps up the second: a few microseconds of
idle SMs a kernel, which for a 4-bit 8B model is a sizeable share of the step. On Hopper a
kernel launched as a programmatic dependent (``launch_pdl=True``) may be scheduled as soon as
every program of the kernel before it has signalled (``gdc_launch_dependents``); it then
blocks in ``gdc_wait`` until that kernel has finished and its writes are visible. CUDA graphs
keep the dependency as a programmatic edge, so replays overlap the same way.

The rule that keeps this correct: a kernel launched with PDL calls ``wait_for_producers``
before it touches any memory that an earlier kernel writes or reads (its inputs, its outputs,
the KV pool), which is what the helper does first thing. By induction every kernel before it
has then finished too. A kernel launched the ordinary way (cuBLAS, torch's own) waits for the
whole of the kernel before it, so chains may mix both.

``PAGESTREAM_PDL=0`` turns it off (for comparison); it is on by default where the GPU has it
(compute capability 9.0 and newer) and the Triton build can emit it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "PAGESTREAM_PDL"
PDL_MIN_CAPABILITY = (9, 0)

try:  # Triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton: the kernels never take the branch
    TRITON_HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """First thing in a kernel launched with PDL: block until the kernel before has finished
    (its writes visible), then let the next kernel be scheduled behind this one's programs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether kernels working on ``x``'s device launch as programmatic dependents."""
    if not x.is_cuda or not TRITON_HAS_PDL or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= PDL_MIN_CAPABILITY


def pdl_launch(x: torch.Tensor) -> dict[str, bool]:
    """The kernel arguments for a launch on ``x``'s device: ``PDL`` (the kernel's constexpr)
    and ``launch_pdl`` (the launch attribute) only where PDL is on."""
    if uses_pdl(x):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
