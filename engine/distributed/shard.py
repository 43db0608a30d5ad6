"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

Column-parallel (output rows split): q/k/v and gate/up projections, the embedding and the LM
head (by vocabulary). Row-parallel (input columns split): o_proj and down_proj, whose partial
outputs are summed by an all-reduce; their biases live on rank 0 only, so the sum adds them
once. Norms are replicated.

Experts (MoE models) split as the dense MLP does, each along its own intermediate size: gate
and up rows (``gate_proj``/``up_proj``, Mixtral's ``w1``/``w3``) column-parallel, down
(``down_proj``, ``w2``) row-parallel; Qwen2-MoE's shared expert likewise along its width.
The router and the shared expert's gate are replicated: every rank routes every token alike.

KV heads: with ``N`` ranks and ``H_kv`` KV heads, ``H_kv % N == 0`` gives each rank
``H_kv / N`` heads; ``N % H_kv == 0`` gives each rank one head, each head held by
``N / H_kv`` ranks (replicated), so that every rank's query heads find their KV head locally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.models.arch import ModelArch

# A tensor split along ``dim`` into the range ``[start, end)``; ``pad_to`` rows when the
# rank's share runs past the tensor's end (the vocabulary's last shard).
Split = tuple[int, int, int]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
EXPERT_COLUMN_PARALLEL = ("gate_proj", "up_proj", "w1", "w3")
EXPERT_ROW_PARALLEL = ("down_proj", "w2")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``'s share of a model of shape ``arch``."""

    arch: ModelArch  # the whole model's shape
    rank: int = 0
    size: int = 1

    @classmethod
    def for_arch(cls, arch: ModelArch, rank: int, size: int) -> ShardPlan:
        """The plan, or a ``ConfigError`` when ``size`` cannot split the model."""
        _check_divides(arch, size)
        return cls(arch, rank, size)

    # -- this rank's shape -------------------------------------------------------------------

    @property
    def num_heads(self) -> int:
        return self.arch.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(self.arch.num_kv_heads // self.size, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(self.size // self.arch.num_kv_heads, 1)

    @property
    def first_kv_head(self) -> int:
        return (self.rank // self.kv_replicas) * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on each rank (the last one padded with zeros)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_arch(self) -> ModelArch:
        """The shape this rank's layers are built with (the vocabulary stays whole)."""
        moe = self.arch.moe
        if moe is not None:
            moe = dataclasses.replace(
                moe,
                intermediate_size=moe.intermediate_size // self.size,
                shared_intermediate_size=moe.shared_intermediate_size // self.size,
            )
        return dataclasses.replace(
            self.arch,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            moe=moe,
        )

    # -- weights -----------------------------------------------------------------------------

    def split_of(self, hf_name: str) -> Split | None:
        """``(dim, start, end)`` of the checkpoint tensor ``hf_name`` this rank reads; None
        for a replicated tensor. Ranges are clipped to the vocabulary (see ``read``)."""
        if self.size == 1:
            return None
        if hf_name.endswith(VOCAB_PARALLEL):
            start = min(self.vocab_start, self.arch.vocab_size)
            return 0, start, min(start + self.vocab_per_rank, self.arch.vocab_size)
        head_dim, module = self.arch.head_dim, _module_of(hf_name)
        expert_width = self._expert_width(hf_name)
        if expert_width is not None:
            return _expert_split(module, self.rank, expert_width)
        if module == "q_proj":
            return (
                0,
                self.rank * self.num_heads * head_dim,
                (self.rank + 1) * self.num_heads * head_dim,
            )
        if module in ("k_proj", "v_proj"):
            first = self.first_kv_head * head_dim
            return 0, first, first + self.num_kv_heads * head_dim
        if module in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        if module in ROW_PARALLEL and hf_name.endswith(".weight"):
            width = self.num_heads * head_dim if module == "o_proj" else self.intermediate_size
            return 1, self.rank * width, (self.rank + 1) * width
        return None

    def _expert_width(self, hf_name: str) -> int | None:
        """This rank's width of the expert (or shared expert) ``hf_name`` belongs to; None
        for a weight of no expert."""
        moe = self.arch.moe
        if moe is None:
            return None
        if ".experts." in hf_name:
            return moe.intermediate_size // self.size
        if ".shared_expert." in hf_name:
            return moe.shared_intermediate_size // self.size
        return None

    def takes_zeros(self, hf_name: str) -> bool:
        """A row-parallel bias on a rank other than 0: the all-reduce adds rank 0's once."""
        return self.rank > 0 and _module_of(hf_name) in ROW_PARALLEL and hf_name.endswith(".bias")

    def read(
        self,
        hf_name: str,
        shape: tuple[int, ...],
        read_slice: Callable[[tuple[slice, ...]], torch.Tensor],
    ) -> torch.Tensor:
        """This rank's part of ``hf_name`` (full ``shape``), reading only that part:
        ``read_slice(index)`` returns ``tensor[index]`` (a safetensors slice, or a tensor)."""
        if self.takes_zeros(hf_name):
            return torch.zeros(shape)
        split = self.split_of(hf_name)
        if split is None:
            return read_slice(tuple(slice(None) for _ in shape))
        dim, start, end = split
        index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(shape)))
        part = read_slice(index)
        if hf_name.endswith(VOCAB_PARALLEL) and end - start < self.vocab_per_rank:
            missing = self.vocab_per_rank - (end - start)  # the last shard's padding rows
            part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
        return part


def _module_of(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``."""
    parts = hf_name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _expert_split(module: str, rank: int, width: int) -> Split | None:
    """An expert weight's split: gate/up rows or down columns of this rank's ``width``."""
    if module in EXPERT_COLUMN_PARALLEL:
        return 0, rank * width, (rank + 1) * width
    if module in EXPERT_ROW_PARALLEL:
        return 1, rank * width, (rank + 1) * width
    return None


def _check_divides(arch: ModelArch, size: int) -> None:
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    flag = f"--tensor-parallel-size {size}"
    if arch.num_heads % size:
        raise ConfigError(
            f"{flag} does not divide the model's {arch.num_heads} attention heads: "
            "choose a size that does"
        )
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(
            f"{flag} and the model's {kv} KV heads: one must divide the other (each rank "
            "holds a whole number of KV heads, or each KV head is replicated on whole ranks)"
        )
    if arch.intermediate_size % size:
        raise ConfigError(f"{flag} does not divide the model's MLP width {arch.intermediate_size}")
    moe = arch.moe
    for width in (moe.intermediate_size, moe.shared_intermediate_size) if moe else ():
        if width % size:
            raise ConfigError(f"{flag} does not divide the model's expert width {width}")
