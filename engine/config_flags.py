"""The engine's CLI flags (DESIGN.md's names), and the ``EngineConfig`` they fill; every
command that runs an engine adds them, and ``worker/env_flags.py`` reads each from its
``PAGESTREAM_*`` variable too."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from engine.config import (
    DEFAULT_MODEL,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    QUANTIZATION_CHOICES,
    EngineConfig,
)


def _on_off(text: str) -> bool:
    """``on``/``off``; ``1/0``, ``true/false`` and ``yes/no`` too (for environment variables)."""
    word = text.strip().lower()
    if word in ("on", "1", "true", "yes"):
        return True
    if word in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _quota(text: str) -> tuple[str, int]:
    tenant, sep, pages = text.rpartition("=")
    if not sep or not tenant or not pages.isdigit():
        raise argparse.ArgumentTypeError(f"expected TENANT=PAGES, got {text!r}")
    return tenant, int(pages)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag (DESIGN.md's names) to ``parser``."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF dir or hub id, .gguf file, dummy:<shape>, or smollm2-135m (default)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute type (auto: bf16 on CUDA, fp32 on CPU)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_CHOICES),
        help="linear weights: auto (a quantized GGUF's blocks stay packed on CUDA), none (float), "
        "gguf (packed on every device), or q8_0/q4_0/q4_1/fp8 (quantize float weights at load)",
    )
    g.add_argument(
        "--paged-attn",
        default="auto",
        choices=["auto", "on", "off"],
        help="off = contiguous per-sequence KV cache (reference/baseline)",
    )
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--pa-memory-mb", type=int, help="KV pool budget in MiB")
    budget.add_argument(
        "--pa-memory-fraction",
        type=float,
        help="share of the GPU's total memory the engine may use: weights, the profiled "
        "activation peak and the KV pool together (default 0.9 on CUDA; on CPU, of available RAM)",
    )
    budget.add_argument(
        "--pa-context-len", type=int, help="size the KV pool to hold this many tokens"
    )
    g.add_argument(
        "--pa-block-size",
        type=int,
        default=32,
        help="tokens per KV page, a power of two (default 32)",
    )
    g.add_argument(
        "--pa-cache-type",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="KV cache element type (auto = model dtype)",
    )
    g.add_argument(
        "--max-seqs", type=int, default=256, help="running sequences at once (default 256)"
    )
    g.add_argument(
        "--max-batched-tokens",
        type=int,
        default=8192,
        help="token budget per engine step (default 8192)",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=4096,
        help="largest prefill chunk of one sequence per step (default 4096)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        help="longest sequence (prompt + output); default: the model's context length",
    )
    g.add_argument(
        "--clamp-max-tokens",
        type=_on_off,
        default=False,
        metavar="on/off",
        help="on = lower a request's max_tokens to what the context leaves after its prompt; "
        "off = refuse a request whose prompt + max_tokens exceeds --max-model-len (default off)",
    )
    g.add_argument(
        "--prefix-caching",
        type=_on_off,
        default=True,
        metavar="on/off",
        help="reuse KV pages of shared prefixes (default on)",
    )
    g.add_argument(
        "--cascade-attention",
        type=_on_off,
        default=True,
        metavar="on/off",
        help="decodes that share a prefix's pages attend it together, once per tile of their "
        "queries (Triton backend; default on)",
    )
    g.add_argument(
        "--preemption",
        default="recompute",
        choices=["recompute", "swap"],
        help="what happens when pages run out (default recompute)",
    )
    g.add_argument(
        "--swap-space-mb",
        type=int,
        default=4096,
        help="host memory for swapped-out pages, MiB (default 4096)",
    )
    g.add_argument(
        "--kv-offload-mb",
        type=int,
        default=0,
        metavar="N",
        help="pinned host memory (MiB) for prefix-cache pages evicted from the GPU pool; a "
        "later prompt with that prefix copies them back instead of recomputing (default 0 = off)",
    )
    g.add_argument(
        "--cuda-graphs",
        type=_on_off,
        default=None,
        metavar="on/off",
        help="CUDA graphs: decode steps whole, other steps piecewise (default on for CUDA)",
    )
    g.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="steps with prefill of up to N tokens replay piecewise graphs around eager "
        "attention (default: --max-batched-tokens; 0 = run them eagerly)",
    )
    g.add_argument(
        "--async-scheduling",
        type=_on_off,
        default=None,
        metavar="on/off",
        help="schedule and launch each step before the previous step's tokens reach the host "
        "(default on for CUDA)",
    )
    g.add_argument(
        "--tenant-quota",
        type=_quota,
        action="append",
        default=[],
        metavar="TENANT=PAGES",
        help="cap the KV pages one tenant's sequences may hold (repeatable)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the sampler's default generator (default 0)"
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N devices, one process each (default 1)",
    )
    _add_speculative_args(parser)


def _add_speculative_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram"],
        help="ngram = draft tokens by prompt lookup and verify them in one forward (default off)",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        metavar="M",
        help="draft tokens with this small model (same vocabulary as --model; its own KV pool "
        "takes a share of the budget)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help=f"draft tokens per sequence and step (default {DEFAULT_NUM_SPECULATIVE_TOKENS})",
    )
    g.add_argument(
        "--speculative-ngram-min",
        type=int,
        default=1,
        metavar="N",
        help="shortest suffix prompt lookup matches (default 1)",
    )
    g.add_argument(
        "--speculative-ngram-max",
        type=int,
        default=4,
        metavar="N",
        help="longest suffix prompt lookup matches, tried first (default 4)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """Build an ``EngineConfig`` from flags added by :func:`add_engine_args`."""
    values: dict[str, Any] = {}
    names = {f.name for f in fields(EngineConfig)}
    for name in names - {"tenant_page_quotas"}:
        if hasattr(args, name):
            values[name] = getattr(args, name)
    values["tenant_page_quotas"] = dict(getattr(args, "tenant_quota", []) or [])
    values.update(overrides)
    return EngineConfig(**values)
