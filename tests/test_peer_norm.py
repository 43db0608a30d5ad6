"""A decoder layer hands the sums that a norm reads next to the fused all-reduce + add + RMSNorm
kernel (``engine.distributed.peer_norm``), in one process: a group of one whose peer path is
the kernel without a barrier (interpreted on the CPU). The two-GPU runs:
tests/test_gpu_allreduce_norm.py and tests/test_gpu_tensor_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention.backend import TorchAttentionBackend
from engine.distributed.group import PartialSum, TensorParallelGroup
from engine.distributed.peer_allreduce import SizeTable, _fused_max_bytes
from engine.distributed.peer_norm import FUSED_NORM_ENV, FUSED_SLOT_BYTES, fused_norm_requested
from engine.errors import ConfigError
from engine.loader.dummy import dummy_hf_config
from engine.models import layers
from engine.models.arch import ModelArch
from engine.models.layers import DecoderLayer, RMSNorm
from tests.triton_interpret import DEVICE, import_kernels

KERNELS = import_kernels(
    (
        "kernels.elementwise.norm_triton",
        "kernels.collective.peer_barrier_triton",
        "kernels.collective.allreduce_norm_triton",
    )
)
allreduce_norm_triton = KERNELS["allreduce_norm_triton"]
norm_triton = KERNELS["norm_triton"]
SLOT_BYTES = 4096


class OneRankNorm:
    """The fused kernel in a group of one (no barrier, no other rank), counting its calls."""

    def __init__(self) -> None:
        buffer = torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8, device=DEVICE)
        self.peers = allreduce_norm_triton.PeerBuffers(
            buffer_ptrs=torch.tensor([buffer.data_ptr()], device=DEVICE),
            signal_pad_ptrs=torch.zeros(1, dtype=torch.int64, device=DEVICE),
            epoch=torch.zeros(2, dtype=torch.int32, device=DEVICE),
            abort=torch.zeros(1, dtype=torch.int32, device=DEVICE),
            rank=0,
            slot_bytes=SLOT_BYTES,
            barrier=False,
        )
        self.buffer, self.num_calls = buffer, 0

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_calls += 1
        return allreduce_norm_triton.allreduce_add_rms_norm(x, residual, weight, eps, self.peers)


class OneRankPeer:
    """``PeerAllReduce``'s side that the model sees: every sum before a norm is fused."""

    def __init__(self) -> None:
        self.norm = OneRankNorm()

    def fuses_norm(self, x: torch.Tensor) -> bool:
        return True


def _layers(group: TensorParallelGroup) -> list[DecoderLayer]:
    """The tiny llama's two layers (hidden 64), the same weights whatever the group."""
    arch = ModelArch.from_hf_config(dummy_hf_config("tiny"))
    torch.manual_seed(0)
    layers = [DecoderLayer(arch, i, TorchAttentionBackend(), group) for i in range(2)]
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = torch.rand(norm.weight.shape) + 0.5
    return [layer.to(DEVICE) for layer in layers]


def _forward(group: TensorParallelGroup) -> list[torch.Tensor]:
    """Two layers around stand-in attention outputs, then the final norm: every output."""
    layers = _layers(group)
    final_norm = RMSNorm(64, 1e-5, layers[0].input_layernorm.ops).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    x: torch.Tensor | PartialSum = torch.randn(3, 64, generator=gen).to(DEVICE)
    residual = None
    outputs = []
    for layer in layers:
        q, k, v, residual = layer.pre_attention(x, residual)
        attn = torch.randn(3, 64, generator=gen).to(DEVICE)
        x, residual = layer.post_attention(attn, residual)
        outputs += [q, k, v, residual.clone()]
    hidden, _ = final_norm.add_and_norm(x, residual)
    return [*outputs, hidden]


def test_a_layer_gives_the_same_outputs_with_the_sums_fused_into_its_norms() -> None:
    """o_proj's sum into the post-attention norm, down's into the next layer's input norm and
    into the final norm; the first layer's input (the embeddings) is summed on its own."""
    peer = OneRankPeer()
    fused = _forward(TensorParallelGroup(peer=peer))
    assert peer.norm.num_calls == 4  # 2 layers x (o_proj, down)
    unfused = _forward(TensorParallelGroup())
    for got, expected in zip(fused, unfused, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_a_norm_that_rounds_to_int8_sums_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel has no int8 variant: such a norm takes the sum, then its own kernel."""
    peer = OneRankPeer()
    group = TensorParallelGroup(peer=peer)
    norm = RMSNorm(64, 1e-5, TorchAttentionBackend().ops).to(DEVICE)
    int8_calls: list[torch.Tensor] = []

    def rounding(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        int8_calls.append(x)
        return x, residual

    norm.ops = dataclasses.replace(norm.ops, fused_add_rms_norm_int8=rounding)
    monkeypatch.setattr(layers, "takes_int8_rows", lambda x, linear: True)
    x = torch.randn(2, 64, device=DEVICE)
    partial = group.all_reduce_for_norm(x)
    assert isinstance(partial, PartialSum)
    norm.add_and_norm_for(partial, torch.zeros_like(x), torch.nn.Linear(64, 64))
    assert len(int8_calls) == 1 and int8_calls[0] is x  # summed (a group of one: x itself)
    assert peer.norm.num_calls == 0


def test_without_a_peer_path_a_sum_before_a_norm_is_an_all_reduce() -> None:
    x = torch.randn(2, 64, device=DEVICE)
    assert TensorParallelGroup().all_reduce_for_norm(x) is x  # a group of one, or gloo's sum


def test_each_allreduce_path_bounds_the_fused_sums() -> None:
    table = SizeTable(bands=((2**20, "nccl"),), fused_max_bytes=65536)
    assert _fused_max_bytes("auto", table) == 65536
    assert _fused_max_bytes("auto", SizeTable(bands=())) == 0  # not measured: not fused
    assert _fused_max_bytes("one-shot", table) == FUSED_SLOT_BYTES  # the kernel is one-shot
    assert _fused_max_bytes("two-shot", table) == 0


def test_the_fused_norm_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused_norm_requested()
    monkeypatch.setenv(FUSED_NORM_ENV, "0")
    assert not fused_norm_requested()
    monkeypatch.setenv(FUSED_NORM_ENV, "off")
    with pytest.raises(ConfigError, match="PAGESTREAM_TP_FUSED_NORM='off': expected 1"):
        fused_norm_requested()


def test_the_bench_compares_the_fused_kernel_with_the_faster_unfused_path() -> None:
    from bench.allreduce_norm import fused_speedups, shapes

    assert (128, 4096) in shapes() and (64, 8192) in shapes() and (128, 8192) not in shapes()
    results = [
        {"rows": 1, "hidden": 4096, "path": path, "us": us}
        for path, us in (("nccl+norm", 9.0), ("one-shot+norm", 10.0), ("fused", 4.5))
    ]
    assert fused_speedups(results) == [
        {"rows": 1, "hidden": 4096, "fused_us": 4.5, "unfused_us": 9.0, "speedup": 2.0}
    ]
