"""Builds what runs the model once the weights are loaded: the page pool sized by the memory
plan, the block manager over it, and the model runner with its decode CUDA graphs (and, with
a draft model, the draft's own pool, block manager and runner)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, get_attention_backend
from engine.block_manager import BlockManager, HostBlockPool
from engine.config import EngineConfig
from engine.cuda_graphs import decode_graph_scratch_bytes
from engine.distributed.group import TensorParallelGroup
from engine.errors import ConfigError
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_offload import HostPrefixCache
from engine.loader import LoadedModel, ModelSource, load_model
from engine.memory import (
    GIB,
    MemoryProfile,
    PoolPlan,
    log_plan,
    measure_peak_bytes,
    plan_pool,
    read_device_memory,
)
from engine.model_runner import ModelRunner
from engine.piecewise_graphs import activation_buffer_bytes
from engine.quant import allocate_dequant_scratch
from engine.sampler import Sampler
from engine.spec_decode.draft_model import DraftModelProposer, load_draft_model
from engine.spec_decode.proposer import PromptLookupProposer, Proposer

logger = logging.getLogger("pagestream.engine")

CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Runtime:
    kv_cache: KVCache
    block_manager: BlockManager
    host_pool: HostBlockPool
    runner: ModelRunner
    plan: PoolPlan
    profile: MemoryProfile | None
    proposer: Proposer | None = None  # speculative decoding's drafts


@dataclass(frozen=True)
class RankSetup:
    """What one rank builds before it serves steps: the same on every tensor-parallel rank."""

    loaded: LoadedModel
    runtime: Runtime
    backend: AttentionBackend
    dtype: torch.dtype
    max_model_len: int


def cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    return CACHE_DTYPES.get(config.pa_cache_type, model_dtype)


def setup_rank(
    config: EngineConfig,
    device: torch.device,
    group: TensorParallelGroup | None = None,
    source: ModelSource | None = None,
) -> RankSetup:
    """Load this rank's model and build its runtime. Every rank of a tensor-parallel group
    runs this at once: loading, profiling and graph capture take part in collectives."""
    dtype = resolve_dtype(config, device)
    backend = get_attention_backend(device)
    loaded = load_model(
        config.model,
        dtype,
        device,
        backend,
        config.max_model_len,
        config.seed,
        group,
        source,
        quantization=config.quantization,
    )
    max_model_len = resolve_max_model_len(config, loaded)
    # a draft model (never with tensor parallelism) before the pool is planned
    draft = load_draft_model(config, loaded, dtype, device, backend, max_model_len)
    runtime = build_runtime(
        config, loaded, backend, dtype, max_model_len, device, group, draft=draft
    )
    return RankSetup(loaded, runtime, backend, dtype, max_model_len)


def build_prefill_shapes(setup: RankSetup, config: EngineConfig, device: torch.device) -> int:
    """``AttentionBackend.build_prefill_shapes`` for this rank's model and chunk size, on the
    calling thread (the one that will run its steps), logged when it built any."""
    arch = setup.loaded.model.arch  # this rank's heads
    start_s = time.perf_counter()
    built = setup.backend.build_prefill_shapes(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, setup.dtype, device,
        setup.max_model_len, min(config.prefill_chunk, config.max_batched_tokens),
    )  # fmt: skip
    if built:
        logger.info(
            "prefill attention: %d shapes built in %.1fs (%s)",
            built, time.perf_counter() - start_s, setup.backend.prefill_attention,
        )  # fmt: skip
    return built


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    model_len = loaded.arch.max_position_embeddings
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ConfigError(
            f"max_model_len {config.max_model_len} exceeds the model's context ({model_len})"
        )
    return config.max_model_len


def build_runtime(
    config: EngineConfig,
    loaded: LoadedModel,
    backend: AttentionBackend,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
    group: TensorParallelGroup | None = None,
    draft: LoadedModel | None = None,
) -> Runtime:
    """``draft``: a draft model, loaded already (so that its weights count as used memory)."""
    group = group or TensorParallelGroup()
    paged = config.use_paged_attention()
    # Paging off = one contiguous slot of max_model_len tokens per sequence: the same pool
    # with a page as long as the context, reserved in full when a sequence starts.
    block_size = config.pa_block_size if paged else max_model_len
    # this rank's KV heads (the model's own arch is this rank's shard)
    spec = KVCacheSpec.for_model(loaded.model.arch, block_size, cache_dtype(config, dtype))
    sampler = Sampler(loaded.arch.vocab_size)
    use_graphs = _graphs_enabled(config, backend, device)
    profile = None
    if device.type == "cuda":
        # before the profile: the shared dequantized-weight room counts once, as used memory
        _allocate_dequant_scratch(config, [loaded, draft], dtype, device)
        peak_bytes, graph_bytes = _measure_peaks(
            config, loaded, spec, sampler, max_model_len, device, use_graphs
        )
        if use_graphs:  # the graphs' attention partials, which the profile's decode lacks
            graph_bytes += decode_graph_scratch_bytes(
                loaded.model, config.decode_graph_rows(), max_model_len, device,
                _cascade(config, backend),
            )  # fmt: skip
        arch = loaded.model.arch  # this rank's heads
        peak_bytes += backend.prefill_workspace_bytes(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, dtype, max_model_len,
            min(config.prefill_chunk, config.max_batched_tokens),
        )  # fmt: skip
        # read after the scratch pool is gone: what is used from here on stays used
        profile = read_device_memory(device, loaded.weights_bytes, peak_bytes, graph_bytes)
    plan = plan_pool(config, spec, device, max_model_len, profile)
    draft_spec = None
    if draft is not None:
        draft_spec = KVCacheSpec.for_model(draft.arch, block_size, cache_dtype(config, dtype))
        if config.pa_context_len is None:  # a budget in tokens holds them in each pool
            plan = _share_with_draft(plan, spec, draft_spec, max_model_len)
    if group.size > 1:
        plan = _agree_on_pool(plan, group)
    log_plan(plan, spec, profile, max_model_len, group.rank, group.size)
    kv_cache = KVCache(spec, plan.num_blocks, plan.num_host_blocks, device, plan.num_offload_blocks)
    host_cache = HostPrefixCache(plan.num_offload_blocks) if plan.num_offload_blocks else None
    block_manager = BlockManager(
        plan.num_blocks,
        block_size,
        enable_prefix_caching=paged and config.prefix_caching,
        tenant_page_quotas=config.tenant_page_quotas,
        host_cache=host_cache,
    )
    runner = ModelRunner(
        loaded.model, kv_cache, sampler, device, group, cascade=_cascade(config, backend)
    )
    if use_graphs:
        runner.capture_cuda_graphs(
            config.decode_graph_rows(), max_model_len, config.piecewise_graph_tokens()
        )
    host_pool = HostBlockPool(plan.num_host_blocks)
    proposer: Proposer | None = None
    if config.speculative_method() == "ngram":
        proposer = PromptLookupProposer(config)
    if draft is not None and draft_spec is not None:
        proposer = _draft_proposer(config, draft, draft_spec, plan.num_blocks, device)
        if use_graphs:  # its one-token drafting passes replay decode graphs (no piecewise ones)
            proposer.runner.capture_cuda_graphs(config.max_seqs, max_model_len, 0)
    return Runtime(kv_cache, block_manager, host_pool, runner, plan, profile, proposer)


def _draft_proposer(
    config: EngineConfig,
    draft: LoadedModel,
    draft_spec: KVCacheSpec,
    num_blocks: int,
    device: torch.device,
) -> DraftModelProposer:
    """The draft model's runner over its own pool of ``num_blocks`` pages."""
    # The draft's largest step (a catch-up of --max-batched-tokens) runs alone, on a smaller
    # model than the target's profiled one, so the activation reserve covers it; its decode
    # graphs' pool is not planned for (small beside the target's).
    kv_cache = KVCache(draft_spec, num_blocks, 0, device)
    runner = ModelRunner(draft.model, kv_cache, Sampler(draft.arch.vocab_size), device)
    block_manager = BlockManager(num_blocks, draft_spec.block_size, enable_prefix_caching=False)
    return DraftModelProposer(
        runner, block_manager, config.speculative_tokens(), config.max_batched_tokens
    )


def _share_with_draft(
    plan: PoolPlan, spec: KVCacheSpec, draft_spec: KVCacheSpec, max_model_len: int
) -> PoolPlan:
    """Split a pool budget in bytes so that the model's and the draft's pools hold as many
    pages each (a shadow holds the same tokens as its sequence)."""
    pair_bytes = spec.bytes_per_block + draft_spec.bytes_per_block
    num_blocks = min(plan.num_blocks, plan.budget_bytes // pair_bytes)
    blocks_per_seq = -(-max_model_len // spec.block_size)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"the KV budget ({plan.source}) shared with the draft model's pool holds "
            f"{num_blocks} pages, less than one sequence of {max_model_len} tokens "
            f"({blocks_per_seq} pages): raise the budget or lower --max-model-len"
        )
    return dataclasses.replace(
        plan,
        num_blocks=num_blocks,
        num_host_blocks=min(plan.num_host_blocks, num_blocks),
        budget_bytes=num_blocks * spec.bytes_per_block,
    )


def _agree_on_pool(plan: PoolPlan, group: TensorParallelGroup) -> PoolPlan:
    """Every rank's pool holds as many pages as the smallest one: the scheduler on rank 0
    hands out page numbers that must exist on every rank."""
    plans = group.gather_objects(plan)
    num_blocks = min(p.num_blocks for p in plans)
    num_host_blocks = min(p.num_host_blocks for p in plans)
    num_offload_blocks = min(p.num_offload_blocks for p in plans)
    if group.is_driver:
        shares = ", ".join(
            f"rank {rank} {p.num_blocks} pages ({p.budget_bytes / GIB:.2f} GiB)"
            for rank, p in enumerate(plans)
        )
        logger.info("KV pool per rank of %d: %s; each uses %d", group.size, shares, num_blocks)
    bytes_per_block = plan.budget_bytes // max(plan.num_blocks, 1)
    return dataclasses.replace(
        plan,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        num_offload_blocks=num_offload_blocks,
        budget_bytes=num_blocks * bytes_per_block,
    )


def _allocate_dequant_scratch(
    config: EngineConfig,
    models: list[LoadedModel | None],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The quantized linears' weight scratch, if a step of the token budget takes the
    dequantize-then-cuBLAS path (no step has more rows than --max-batched-tokens)."""
    for loaded in models:
        if loaded is None:
            continue
        num_bytes = allocate_dequant_scratch(loaded.model, config.max_batched_tokens, dtype, device)
        if num_bytes:
            logger.info("dequantized-weight scratch: %.2f GiB", num_bytes / GIB)


def _measure_peaks(
    config: EngineConfig,
    loaded: LoadedModel,
    spec: KVCacheSpec,
    sampler: Sampler,
    max_model_len: int,
    device: torch.device,
    use_graphs: bool,
) -> tuple[int, int]:
    """Bytes above steady state of the largest step, and of the largest graphed decode."""
    num_tokens = config.max_batched_tokens
    seq_len = min(config.prefill_chunk, max_model_len, num_tokens)
    # a decode row verifying K drafts samples at each of its K + 1 positions
    num_sampled = min(config.max_seqs * (1 + config.speculative_tokens()), num_tokens)
    # A scratch pool just big enough for the dummy prompts, freed before the real one. Its
    # pages are --pa-block-size long even with paging off: no temporary depends on page size.
    scratch_spec = dataclasses.replace(spec, block_size=min(config.pa_block_size, seq_len))
    num_pages = -(-num_tokens // seq_len) * -(-seq_len // scratch_spec.block_size)
    graph_rows = config.decode_graph_rows()
    num_pages = max(num_pages, graph_rows)  # the decode profile gives each row a page
    try:
        runner = ModelRunner(
            loaded.model, KVCache(scratch_spec, num_pages, 0, device), sampler, device
        )
        peak_bytes = measure_peak_bytes(
            device, lambda: runner.profile_step(num_tokens, seq_len, num_sampled)
        )
        graph_bytes = 0
        if use_graphs:  # the largest captured decode step, held in the graphs' own pool
            graph_bytes = measure_peak_bytes(device, lambda: runner.profile_decode(graph_rows))
            graph_tokens = config.piecewise_graph_tokens()
            if graph_tokens:  # their pool holds one piece's temporaries, below a whole step's
                graph_bytes += peak_bytes + activation_buffer_bytes(loaded.model, graph_tokens)
    except torch.OutOfMemoryError as exc:
        raise ConfigError(
            f"the largest step ({num_tokens} tokens, {num_sampled} sampled rows) does not fit "
            "on the GPU beside the weights: lower --max-batched-tokens or --max-seqs"
        ) from exc
    return peak_bytes, graph_bytes


def _cascade(config: EngineConfig, backend: AttentionBackend) -> bool:
    """Whether steps attend shared prefixes as a cascade (and graphs are captured with it)."""
    return config.cascade_attention and backend.takes_shared_prefix


def _graphs_enabled(config: EngineConfig, backend: AttentionBackend, device: torch.device) -> bool:
    if device.type != "cuda" or not config.cuda_graphs_wanted():
        return False
    if not backend.graph_safe:
        logger.info("CUDA graphs off: the %s attention backend is not graph-safe", backend.name)
        return False
    return True
