"""The KV page pool on the device, its host mirror for swapping, and how big to make it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_CPU_POOL_MB, DEFAULT_MEMORY_FRACTION, EngineConfig
from engine.errors import ConfigError
from engine.models.arch import ModelArch

logger = logging.getLogger(__name__)
MIB = 1 << 20


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element_bytes = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def for_model(cls, arch: ModelArch, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, dtype)


class KVCache:
    """``[layers, 2 (k/v), num_blocks, block_size, kv_heads, head_dim]`` on the device.

    Zero-initialised: pages past a sequence's length are read (masked) by batched
    attention, and masked garbage could be NaN.
    """

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, num_host_blocks: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.pages = torch.zeros(shape, dtype=spec.dtype, device=device)
        host_shape = (*shape[:2], num_host_blocks, *shape[3:])
        pin = device.type == "cuda"
        self.host_pages = torch.zeros(host_shape, dtype=spec.dtype, pin_memory=pin)
        self.layers = [(self.pages[i, 0], self.pages[i, 1]) for i in range(spec.num_layers)]

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = torch.tensor(device_blocks, device=self.pages.device)
        dst = torch.tensor(host_blocks)
        self.host_pages[:, :, dst] = self.pages[:, :, src].to("cpu")

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.pages.device)
        data = self.host_pages[:, :, src].to(self.pages.device, non_blocking=True)
        self.pages[:, :, dst] = data


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    num_host_blocks: int
    budget_bytes: int
    source: str  # which setting decided the size


def plan_pool(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    max_model_len: int,
) -> PoolPlan:
    """Number of device pages (and host pages for swap) from the configured budget."""
    budget_bytes, source = _budget_bytes(config, spec, device)
    num_blocks = budget_bytes // spec.bytes_per_block
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
    num_host_blocks = 0
    if config.preemption == "swap":
        # Swapped pages came from the device pool: more host pages than that are never used.
        num_host_blocks = min(config.swap_space_mb * MIB // spec.bytes_per_block, num_blocks)
    return PoolPlan(num_blocks, num_host_blocks, num_blocks * spec.bytes_per_block, source)


def _budget_bytes(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> tuple[int, str]:
    if config.pa_memory_mb is not None:
        return config.pa_memory_mb * MIB, f"--pa-memory-mb {config.pa_memory_mb}"
    if config.pa_context_len is not None:
        tokens = -(-config.pa_context_len // spec.block_size) * spec.block_size
        return tokens * spec.bytes_per_token, f"--pa-context-len {config.pa_context_len}"
    if device.type == "cuda":
        fraction = config.pa_memory_fraction or DEFAULT_MEMORY_FRACTION
        free_bytes, _total = torch.cuda.mem_get_info(device)
        return int(free_bytes * fraction), f"--pa-memory-fraction {fraction}"
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
