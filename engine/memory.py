"""How big the KV page pool is: from a budget flag, or from what the GPU has left.

On CUDA the engine first runs the largest step it can schedule (the full token budget of
fresh prompts, then ``max_seqs`` rows through the sampler) on dummy data and records the
activation peak. ``--pa-memory-fraction F`` then gives the pool what remains of ``F`` times
the GPU's total memory after everything already allocated (weights, the CUDA context, other
processes) and that peak. A budget that cannot hold one sequence of the model's context is
an error at start, never an out-of-memory error later.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_CPU_POOL_MB, DEFAULT_MEMORY_FRACTION, EngineConfig
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)
MIB = 1 << 20
GIB = 1 << 30


ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
GC_FREEZE_ENV = "PAGESTREAM_GC_FREEZE"  # 0: serving loops leave the garbage collector alone
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def release_device_memory() -> None:
    """Hand the cached memory of models the caller just dropped back to the device.

    Benchmarks load one model after another (the engine, then a peer; the offline engine,
    then a worker process); without this, the next one's memory plan sees the previous
    one's blocks as used.
    """
    gc.collect()  # engines hold reference cycles (graphs, runner, scheduler)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep the objects alive at the start of a serving loop out of the garbage collector's
    reach until the loop ends (``gc.freeze``, as vLLM's engine process does).

    An engine leaves some 300k objects that the collector tracks: the model's modules, the
    tokenizer, Triton's kernels. Every full collection walks them all: 150 ms each on the
    CPU, three of them in 1,500 steps of 256 rows of ``dummy:tiny``. Frozen, a full collection
    walks only what the loop made, and the longest pause fell to 17 ms
    (docs/performance.md#cpu). The objects go back at the end, so that an engine dropped
    afterwards is collected as before. Inside a block that froze them already (in any
    thread), nothing changes. Objects someone else froze before the block (importing torch
    2.11 on the GPU host freezes 375) are thawed with the loop's at its end: ``gc.unfreeze``
    cannot tell them apart, and leaving the loop's frozen would keep a dropped engine's
    reference cycles, and the device memory they hold, forever. Nothing is frozen when
    ``PAGESTREAM_GC_FREEZE`` is 0.
    """
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        yield
        return
    with _gc_lock:
        _gc_depth[0] += 1
        if _gc_depth[0] == 1:
            gc.freeze()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth[0] -= 1
            if _gc_depth[0] == 0:
                gc.unfreeze()


_gc_lock = threading.Lock()
_gc_depth = [0]  # gc_frozen blocks open in this process, in any thread


def prefer_expandable_segments() -> None:
    """Ask torch's CUDA allocator for expandable segments unless the user configured it.

    The pool leaves the allocator a thin margin (the profiled peak); with fixed segments,
    each step's differently sized temporaries made it free and re-map memory (cudaFree syncs
    the device): 7.9 ms vs 6.1 ms per qwen3-0.6b decode step at 256 sequences on an H200.
    Must run before the first CUDA allocation; afterwards it changes nothing.
    """
    if ALLOC_CONF_ENV in os.environ:
        return
    if torch.cuda.is_initialized():
        logger.info("CUDA already initialised: leaving %s unset", ALLOC_CONF_ENV)
        return
    os.environ[ALLOC_CONF_ENV] = EXPANDABLE_SEGMENTS


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    num_host_blocks: int
    budget_bytes: int
    source: str  # which setting decided the size
    num_offload_blocks: int = 0  # host tier of the prefix cache (--kv-offload-mb)


@dataclass(frozen=True)
class MemoryProfile:
    """What the device holds before the pool exists (CUDA only)."""

    total_bytes: int
    used_bytes: int  # by everything on the device: weights, context, other processes
    weights_bytes: int
    activation_peak_bytes: int  # above the steady state, during the largest step
    # CUDA graphs keep a private pool (a decode step at --max-seqs) that eager steps cannot use
    graph_reserve_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        return self.activation_peak_bytes + self.graph_reserve_bytes


def measure_peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """Bytes ``run`` allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before_bytes = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before_bytes


def read_device_memory(
    device: torch.device, weights_bytes: int, activation_peak_bytes: int, graph_reserve_bytes: int
) -> MemoryProfile:
    torch.cuda.empty_cache()  # cached blocks of freed tensors would count as used
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_bytes = total_bytes - free_bytes
    return MemoryProfile(
        total_bytes, used_bytes, weights_bytes, activation_peak_bytes, graph_reserve_bytes
    )


def plan_pool(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    max_model_len: int,
    profile: MemoryProfile | None = None,
) -> PoolPlan:
    """Number of device pages (and host pages for swap) from the configured budget."""
    budget_bytes, source = _budget_bytes(config, spec, device, profile)
    num_blocks = max(budget_bytes, 0) // spec.bytes_per_block
    # Never more than every sequence at full length could use.
    blocks_per_seq = -(-max_model_len // spec.block_size)
    num_blocks = min(num_blocks, config.max_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        need_mb = blocks_per_seq * spec.bytes_per_block / MIB
        raise ConfigError(
            f"KV pool of {num_blocks} pages ({source}) cannot hold one sequence of "
            f"{max_model_len} tokens ({blocks_per_seq} pages, {need_mb:.0f} MiB): raise the "
            "budget (--pa-memory-mb / --pa-memory-fraction / --pa-context-len) or lower "
            "--max-model-len"
        )
    if profile is not None:
        _check_fits_device(num_blocks * spec.bytes_per_block, profile, source)
    num_host_blocks = 0
    if config.preemption == "swap":
        # Swapped pages came from the device pool: more host pages than that are never used.
        num_host_blocks = min(config.swap_space_mb * MIB // spec.bytes_per_block, num_blocks)
    return PoolPlan(
        num_blocks,
        num_host_blocks,
        num_blocks * spec.bytes_per_block,
        source,
        num_offload_blocks=_offload_blocks(config, spec),
    )


def _offload_blocks(config: EngineConfig, spec: KVCacheSpec) -> int:
    num_slots = config.kv_offload_mb * MIB // spec.bytes_per_block
    if config.kv_offload_mb > 0 and num_slots == 0:
        raise ConfigError(
            f"--kv-offload-mb {config.kv_offload_mb} holds no page: one page of this model "
            f"takes {spec.bytes_per_block / MIB:.2f} MiB; raise it or give 0 (no host tier)"
        )
    return num_slots


def _check_fits_device(pool_bytes: int, profile: MemoryProfile, source: str) -> None:
    free_bytes = profile.total_bytes - profile.used_bytes - profile.reserved_bytes
    if pool_bytes > free_bytes:
        raise ConfigError(
            f"a KV pool of {pool_bytes / GIB:.2f} GiB ({source}) does not fit: the GPU has "
            f"{free_bytes / GIB:.2f} GiB left after the weights, the activation peak "
            f"({profile.activation_peak_bytes / GIB:.2f} GiB) and the CUDA graphs "
            f"({profile.graph_reserve_bytes / GIB:.2f} GiB); lower the budget or "
            "--max-batched-tokens"
        )


def _budget_bytes(
    config: EngineConfig, spec: KVCacheSpec, device: torch.device, profile: MemoryProfile | None
) -> tuple[int, str]:
    if config.pa_memory_mb is not None:
        return config.pa_memory_mb * MIB, f"--pa-memory-mb {config.pa_memory_mb}"
    if config.pa_context_len is not None:
        tokens = -(-config.pa_context_len // spec.block_size) * spec.block_size
        return tokens * spec.bytes_per_token, f"--pa-context-len {config.pa_context_len}"
    if profile is not None:
        fraction = config.pa_memory_fraction or DEFAULT_MEMORY_FRACTION
        allowed_bytes = int(profile.total_bytes * fraction)
        budget = allowed_bytes - profile.used_bytes - profile.reserved_bytes
        return budget, f"--pa-memory-fraction {fraction}"
    if config.pa_memory_fraction is not None:
        available = _host_available_bytes()
        return int(available * config.pa_memory_fraction), (
            f"--pa-memory-fraction {config.pa_memory_fraction} of available RAM"
        )
    return DEFAULT_CPU_POOL_MB * MIB, f"CPU default {DEFAULT_CPU_POOL_MB} MiB"


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; give --pa-memory-mb")


def log_plan(
    plan: PoolPlan,
    spec: KVCacheSpec,
    profile: MemoryProfile | None,
    max_model_len: int,
    rank: int = 0,
    num_ranks: int = 1,
) -> None:
    """One line a person can size a deployment from (per rank under tensor parallelism:
    its weights' share, its KV heads' pages)."""
    num_tokens = plan.num_blocks * spec.block_size
    device_part = "" if num_ranks == 1 else f"rank {rank} of {num_ranks}: "
    if profile is not None:
        device_part += (
            f"weights {profile.weights_bytes / GIB:.2f} GiB, activation peak "
            f"{profile.activation_peak_bytes / GIB:.2f} GiB, CUDA graphs "
            f"{profile.graph_reserve_bytes / GIB:.2f} GiB, device {profile.total_bytes / GIB:.1f} GiB; "
        )
    host_part = ""
    if plan.num_offload_blocks:
        host_part = (
            f"; host prefix tier {plan.num_offload_blocks} pages = "
            f"{plan.num_offload_blocks * spec.block_size} tokens "
            f"({plan.num_offload_blocks * spec.bytes_per_block / GIB:.2f} GiB of host memory)"
        )
    logger.info(
        "KV pool: %s%d pages x %d tokens = %d tokens (%.2f GiB, %s, %s): %d sequences of "
        "%d tokens fit at once%s",
        device_part, plan.num_blocks, spec.block_size, num_tokens, plan.budget_bytes / GIB,
        spec.dtype, plan.source, num_tokens // max_model_len, max_model_len, host_part,
    )  # fmt: skip
