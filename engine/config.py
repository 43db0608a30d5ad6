"""Engine settings: one frozen, validated dataclass (its CLI flags: ``engine.config_flags``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import ConfigError

PagedAttnMode = Literal["auto", "on", "off"]
PreemptionMode = Literal["recompute", "swap"]
DTypeName = Literal["auto", "bfloat16", "float16", "float32"]
CacheTypeName = Literal["auto", "fp8_e4m3"]
QuantizationName = Literal["auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "fp8"]
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "fp8")
SpeculativeMode = Literal["off", "ngram"]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MEMORY_FRACTION = 0.9
# On the CPU the pool shares RAM with everything else: default to a fixed, modest budget.
DEFAULT_CPU_POOL_MB = 1024
CUDA_GRAPHS_ENV = "PAGESTREAM_CUDA_GRAPHS"
DEVICE_ENV = "PAGESTREAM_DEVICE"  # what device=auto means, e.g. cpu on a GPU host
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")  # cuda or cuda:N


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of the engine; invalid values and combinations fail at construction."""

    model: str = DEFAULT_MODEL
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: DTypeName = "auto"
    # linear weights: auto = a quantized GGUF's blocks stay packed on CUDA (engine/loader/quantized.py)
    quantization: QuantizationName = "auto"
    paged_attn: PagedAttnMode = "auto"
    pa_memory_mb: int | None = None
    pa_memory_fraction: float | None = None
    pa_context_len: int | None = None
    pa_block_size: int = 32
    pa_cache_type: CacheTypeName = "auto"
    max_seqs: int = 256
    max_batched_tokens: int = 8192
    prefill_chunk: int = 4096
    max_model_len: int | None = None  # default: the model's own context length
    # A request whose prompt + max_tokens passes max_model_len: False = refused, True = its
    # max_tokens is lowered to what fits (a prompt that fills the context is refused anyway).
    clamp_max_tokens: bool = False
    prefix_caching: bool = True
    # Decodes sharing a prefix's pages attend it together (engine/attention/backend.py's
    # CASCADE_MIN_*); the Triton backend only.
    cascade_attention: bool = True
    preemption: PreemptionMode = "recompute"
    swap_space_mb: int = 4096
    # Host memory for prefix-cache pages evicted from the device pool; 0 = no host tier.
    kv_offload_mb: int = 0
    cuda_graphs: bool | None = None  # None = on for CUDA unless PAGESTREAM_CUDA_GRAPHS=0
    # Steps of up to this many tokens that are not decode-only replay piecewise graphs around
    # eager attention; None = max_batched_tokens, 0 = such steps run eagerly.
    cuda_graph_max_tokens: int | None = None
    # Schedule and launch step N+1 before step N's picks reach the host; None = on for CUDA.
    async_scheduling: bool | None = None
    tenant_page_quotas: Mapping[str, int] = field(default_factory=dict)
    seed: int = 0
    # Speculative decoding: "ngram" drafts tokens by prompt lookup, verified in one forward.
    speculative: SpeculativeMode = "off"
    # or drafts from a small model of the same vocabulary, with its own page pool
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None  # drafts per step; None = 4 when speculating
    speculative_ngram_min: int = 1  # shortest suffix that prompt lookup matches
    speculative_ngram_max: int = 4  # longest suffix, tried first
    # Ranks (one process and device each) that split every layer; 1 = no tensor parallelism.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_budget()
        self._check_sizes()
        self._check_speculative()
        self._check_offload()

    def _check_choices(self) -> None:
        _choice("paged_attn", self.paged_attn, ("auto", "on", "off"))
        _choice("preemption", self.preemption, ("recompute", "swap"))
        _choice("dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        _choice("pa_cache_type", self.pa_cache_type, ("auto", "fp8_e4m3"))
        _choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        if self.tensor_parallel_size > 1 and self.quantization not in ("auto", "none"):
            raise ConfigError(
                f"--quantization {self.quantization} needs --tensor-parallel-size 1 (quantized "
                "weights are not sharded yet); use --quantization none or auto with tensor "
                "parallelism"
            )
        _choice("speculative", self.speculative, ("off", "ngram"))
        _check_device(self.device)

    def _check_budget(self) -> None:
        given = [
            name
            for name in ("pa_memory_mb", "pa_memory_fraction", "pa_context_len")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            flags = " and ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"{flags} are mutually exclusive: give at most one KV pool budget")
        if self.pa_memory_mb is not None and self.pa_memory_mb <= 0:
            raise ConfigError("pa_memory_mb must be > 0")
        if self.pa_memory_fraction is not None and not 0 < self.pa_memory_fraction <= 1:
            raise ConfigError("pa_memory_fraction must be in (0, 1]")
        if self.pa_context_len is not None and self.pa_context_len <= 0:
            raise ConfigError("pa_context_len must be > 0")

    def _check_sizes(self) -> None:
        bs = self.pa_block_size
        if bs < 1 or bs & (bs - 1):
            raise ConfigError(f"pa_block_size must be a power of two, got {bs}")
        names = ("max_seqs", "max_batched_tokens", "prefill_chunk", "swap_space_mb")
        for name in (*names, "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_batched_tokens < self.max_seqs:
            raise ConfigError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_seqs "
                f"({self.max_seqs}): every running sequence needs one token per decode step"
            )
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 0:
            raise ConfigError("cuda_graph_max_tokens must be >= 0 (0 = no piecewise graphs)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        for tenant, quota in self.tenant_page_quotas.items():
            if quota < 1:
                raise ConfigError(f"tenant_page_quotas[{tenant!r}] must be >= 1 page")

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if self.speculative != "off" and self.speculative_model is not None:
            raise ConfigError(
                "speculative and speculative_model are two ways to draft tokens: give "
                "--speculative ngram (prompt lookup) or --speculative-model M, not both"
            )
        if self.speculative_method() == "off":
            if k is not None:
                raise ConfigError(
                    "num_speculative_tokens needs speculative decoding: add --speculative ngram "
                    "or --speculative-model M"
                )
            return
        if self.speculative_model == "":
            raise ConfigError("speculative_model: give a model name or path")
        if self.speculative_model is not None and self.tensor_parallel_size > 1:
            raise ConfigError(
                "--speculative-model needs --tensor-parallel-size 1 (the draft model runs on "
                "one device); --speculative ngram works with tensor parallelism"
            )
        if k is not None and k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        if self.speculative_tokens() + 1 > self.max_batched_tokens:
            raise ConfigError(
                f"num_speculative_tokens ({self.speculative_tokens()}) + 1 must fit in "
                f"max_batched_tokens ({self.max_batched_tokens}): a step verifies them together"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ConfigError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) and speculative_ngram_max "
                f"({self.speculative_ngram_max}) need 1 <= min <= max"
            )
        if self.async_scheduling:
            raise ConfigError(
                "async_scheduling does not combine with speculative decoding: drafts are made "
                "from the previous step's tokens on the host; use --async-scheduling off"
            )

    def _check_offload(self) -> None:
        if self.kv_offload_mb < 0:
            raise ConfigError(
                f"kv_offload_mb must be >= 0 (0 = no host tier), got {self.kv_offload_mb}"
            )
        if self.kv_offload_mb == 0:
            return
        if not self.prefix_caching:
            raise ConfigError(
                "--kv-offload-mb needs --prefix-caching on: the host tier holds evicted "
                "prefix-cache pages"
            )
        if self.paged_attn == "off":
            raise ConfigError(
                "--kv-offload-mb needs paged attention: with --paged-attn off there is no "
                "prefix cache to offload"
            )

    # -- derived settings -------------------------------------------------------------------

    def speculative_method(self) -> Literal["off", "ngram", "model"]:
        """How draft tokens are made: not at all, by prompt lookup, or by a draft model."""
        if self.speculative_model is not None:
            return "model"
        return self.speculative

    def speculative_tokens(self) -> int:
        """Draft tokens verified per sequence and step (0 = speculative decoding off)."""
        if self.speculative_method() == "off":
            return 0
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        from_env = os.environ.get(DEVICE_ENV)
        if from_env:
            return from_env
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def use_paged_attention(self) -> bool:
        return self.paged_attn != "off"

    def decode_graph_rows(self) -> int:
        """The largest decode step captured in a graph: ``max_seqs`` rows, or when speculating
        one row per verified position (``max_seqs * (1 + K)``, within the token budget)."""
        verify_rows = self.max_seqs * (1 + self.speculative_tokens())
        return max(self.max_seqs, min(verify_rows, self.max_batched_tokens))

    def piecewise_graph_tokens(self) -> int:
        """The largest step captured in piecewise graphs (0 = none), at most the token budget."""
        if self.cuda_graph_max_tokens is None:
            return self.max_batched_tokens
        return min(self.cuda_graph_max_tokens, self.max_batched_tokens)

    def async_scheduling_wanted(self, device_type: str) -> bool:
        """On for CUDA unless ``--async-scheduling off``; on the CPU only when asked for (its
        forward runs on the host thread, so there is nothing to overlap). Off when speculating:
        drafts are built from the tokens of the step before."""
        if self.speculative_method() != "off":
            return False
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda"

    def cuda_graphs_wanted(self) -> bool:
        """On unless ``--cuda-graphs off`` or ``PAGESTREAM_CUDA_GRAPHS=0`` (CUDA only)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return os.environ.get(CUDA_GRAPHS_ENV, "1").strip().lower() not in ("0", "off", "false")


def _check_device(device: str) -> None:
    """auto, cpu, or a CUDA device this host has: torch's own errors for a bad one are
    tracebacks (an assertion when torch has no CUDA at all)."""
    match = CUDA_DEVICE.fullmatch(device)
    if device not in ("auto", "cpu") and match is None:
        raise ConfigError(f"device: {device!r} is not one of auto, cpu, cuda[:N]")
    if match is None:
        return
    import torch  # only here: a config naming no CUDA device must not need torch

    # device_count() is 0 where torch has no CUDA build or sees no GPU
    num_gpus = torch.cuda.device_count()
    index = int(match.group(1) or 0)
    if num_gpus == 0:
        raise ConfigError(f"device: {device!r} but no CUDA device is visible; use --device cpu")
    if index >= num_gpus:
        raise ConfigError(
            f"device: {device!r} but {num_gpus} CUDA devices are visible (cuda:0 to "
            f"cuda:{num_gpus - 1})"
        )


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
