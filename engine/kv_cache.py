"""The KV page pool on the device, its host mirror for swapping, the host tier of the prefix
cache, and how big to make them."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from engine.attention import LayerCache
from engine.errors import ConfigError
from engine.kv_offload import PageCopy, PageMove
from engine.models.arch import ModelArch

logger = logging.getLogger(__name__)

FP8_SCALE_BYTES = 4  # float32 scale per (token, kv head) of an fp8 page


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_token(self) -> int:
        element_bytes = torch.empty(0, dtype=self.dtype).element_size()
        # fp8 pages carry one float32 scale per token and KV head beside the values
        scale_bytes = FP8_SCALE_BYTES if self.is_fp8 else 0
        return (
            2 * self.num_layers * self.num_kv_heads * (self.head_dim * element_bytes + scale_bytes)
        )

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def for_model(cls, arch: ModelArch, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, dtype)


class KVCache:
    """``[layers, 2 (k/v), num_blocks, block_size, kv_heads, head_dim]`` on the device.

    fp8 pages have ``scales: [layers, 2, num_blocks, block_size, kv_heads]`` float32 beside
    them. Zero-initialised: pages past a sequence's length are read (masked) by batched
    attention, and masked garbage could be NaN. ``num_host_blocks`` pages of host memory hold
    swapped-out sequences; ``num_offload_blocks`` pages hold evicted prefix-cache blocks.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host_blocks: int,
        device: torch.device,
        num_offload_blocks: int = 0,
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.pages = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.scales = torch.zeros(shape[:-1], device=device) if spec.is_fp8 else None
        pin = device.type == "cuda"
        self.host_pages = torch.zeros(
            _with_blocks(shape, num_host_blocks), dtype=spec.dtype, pin_memory=pin
        )
        self.host_scales = (
            torch.zeros(_with_blocks(shape[:-1], num_host_blocks), pin_memory=pin)
            if spec.is_fp8
            else None
        )
        # Host tier, a slot per page with every layer in it: [slots, layers, 2, block, heads,
        # dim], so each copy is one contiguous host range.
        slot_shape = (num_offload_blocks, spec.num_layers, 2, *shape[3:])
        self.offload_pages = _host_tensor(slot_shape, spec.dtype, pin)
        self.offload_scales = (
            _host_tensor(slot_shape[:-1], torch.float32, pin) if spec.is_fp8 else None
        )
        self.layers = [self._layer(i) for i in range(spec.num_layers)]

    def _layer(self, index: int) -> LayerCache:
        if self.scales is None:
            return LayerCache(self.pages[index, 0], self.pages[index, 1])
        scales = self.scales[index]
        return LayerCache(self.pages[index, 0], self.pages[index, 1], scales[0], scales[1])

    # Swaps run when memory is short: one layer at a time, so the device copy of the pages
    # in flight is a layer's share, not every layer's at once.

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = torch.tensor(device_blocks, device=self.pages.device)
        dst = torch.tensor(host_blocks)
        for layer in range(self.spec.num_layers):
            self.host_pages[layer, :, dst] = self.pages[layer, :, src].to("cpu")
            if self.scales is not None and self.host_scales is not None:
                self.host_scales[layer, :, dst] = self.scales[layer, :, src].to("cpu")

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.pages.device)
        device = self.pages.device
        for layer in range(self.spec.num_layers):
            self.pages[layer, :, dst] = self.host_pages[layer, :, src].to(device)
            if self.scales is not None and self.host_scales is not None:
                self.scales[layer, :, dst] = self.host_scales[layer, :, src].to(device)

    def transfer(self, transfers: list[PageMove]) -> None:
        """Run host-tier copies (and copy-on-write page copies) in their order, queued on the current stream: the host side
        is pinned, so nothing waits, and stream order puts each copy after the steps that
        wrote its source and before the forward that reuses a saved page.

        Not on a side stream: a page may be cached while the forward that wrote it still runs
        (a step of partial prefill chunks is never waited for), so a save must follow every
        forward before it anyway, and a restore must precede the next one."""
        for transfer in transfers:
            if isinstance(transfer, PageCopy):
                self._copy_page(transfer.src_block, transfer.dst_block)
                continue
            pairs = [(self.pages, self.offload_pages)]
            if self.scales is not None and self.offload_scales is not None:
                pairs.append((self.scales, self.offload_scales))
            for device_tensor, host_tensor in pairs:
                device_page = device_tensor[:, :, transfer.device_block]  # [layers, 2, block, ...]
                host_page = host_tensor[transfer.host_slot]
                if transfer.to_host:
                    host_page.copy_(device_page, non_blocking=True)
                else:
                    device_page.copy_(host_page, non_blocking=True)

    def _copy_page(self, src_block: int, dst_block: int) -> None:
        """One device page (every layer, K and V, fp8 scales) onto another."""
        self.pages[:, :, dst_block].copy_(self.pages[:, :, src_block])
        if self.scales is not None:
            self.scales[:, :, dst_block].copy_(self.scales[:, :, src_block])


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Uninitialised host memory, page-locked in place when ``pin`` so that copies to and from
    the device run asynchronously. Registered rather than taken from torch's pinned-memory
    allocator, which rounds each allocation up to a power of two (20 GiB would pin 32)."""
    tensor = torch.empty(shape, dtype=dtype)
    num_bytes = tensor.numel() * tensor.element_size()
    if pin and num_bytes:
        cudart = torch.cuda.cudart()
        ptr = tensor.data_ptr()
        status = int(cudart.cudaHostRegister(ptr, num_bytes, 1))  # 1: portable
        if status != 0:
            raise ConfigError(f"cannot page-lock {num_bytes / (1 << 20):.0f} MiB of host memory "
                              f"(CUDA error {status}): lower --kv-offload-mb")  # fmt: skip
        unregister = weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
        unregister.atexit = False  # the process's memory goes at exit, and CUDA may go first
    return tensor


def _with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    return (*shape[:2], num_blocks, *shape[3:])
