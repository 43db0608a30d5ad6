"""Offline throughput benchmark: random token-id prompts through the engine, no Redis.

Prompts are random token ids (no tokenizer needed, so ``dummy:<shape>`` models work), EOS is
ignored and sampling is greedy, so every request produces exactly its drawn output length.
``run_throughput`` returns a JSON-ready record: machine, settings and results.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.errors import ConfigError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_profile import StepProfiler

RESULTS_DIR = Path("bench/results")
BYTES_PER_GB = 1e9
NUM_WARMUP_PROMPTS = 64  # the untimed run before the measured one
WARMUP_OUTPUT_LEN = 8


@dataclass(frozen=True)
class ThroughputWorkload:
    """How many prompts, and the inclusive ranges their input and output lengths come from."""

    num_prompts: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError("num_prompts must be >= 1")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name} must be a range MIN-MAX with 1 <= MIN <= MAX")


@dataclass(frozen=True)
class BenchPrompt:
    token_ids: list[int]
    output_len: int


def make_random_prompts(workload: ThroughputWorkload, vocab_size: int) -> list[BenchPrompt]:
    """Prompts of uniform random lengths and token ids in [0, vocab_size); same seed, same list."""
    rng = np.random.default_rng(workload.seed)
    input_lens = rng.integers(
        workload.input_len[0], workload.input_len[1] + 1, workload.num_prompts
    )
    output_lens = rng.integers(
        workload.output_len[0], workload.output_len[1] + 1, workload.num_prompts
    )
    return [
        BenchPrompt(rng.integers(0, vocab_size, int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def run_throughput(
    llm_or_engine: LLM | LLMEngine, workload: ThroughputWorkload, *, use_tqdm: bool = True
) -> dict[str, Any]:
    """Run every prompt of ``workload`` at once; the benchmark record (see module docstring)."""
    engine = llm_or_engine.engine if isinstance(llm_or_engine, LLM) else llm_or_engine
    _check_fits(engine, workload)
    prompts = make_random_prompts(workload, engine.loaded.arch.vocab_size)
    created_utc = datetime.now(timezone.utc)
    results = _measure(engine, prompts, use_tqdm)
    return {
        "kind": "throughput",
        "created_utc": created_utc.isoformat(timespec="seconds"),
        "machine": machine_info(engine.device),
        "settings": {
            **dataclasses.asdict(engine.config),
            **dataclasses.asdict(workload),
            "resolved": _resolved_settings(engine),
        },
        "results": results,
    }


def _check_fits(engine: LLMEngine, workload: ThroughputWorkload) -> None:
    longest = workload.input_len[1] + workload.output_len[1]
    if longest > engine.max_model_len:
        raise ConfigError(
            f"the longest request ({workload.input_len[1]} + {workload.output_len[1]} tokens) "
            f"exceeds the context of {engine.max_model_len} tokens: lower --input-len / "
            "--output-len or raise --max-model-len"
        )


PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean of ``values`` (all None when there are none)."""
    names = [f"p{p}" for p in PERCENTILES] + ["mean"]
    if not values:
        return dict.fromkeys(names)
    points = [*np.percentile(np.asarray(values), PERCENTILES), np.mean(values)]
    return {name: float(point) for name, point in zip(names, points, strict=True)}


@dataclass
class _Tally:
    """What the step loop counted over one run."""

    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_steps: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)
    last_s: dict[str, float] = field(default_factory=dict)  # request -> its last token's time
    num_tokens: dict[str, int] = field(default_factory=dict)

    def tpot_s(self) -> list[float]:
        """Each request's time per output token after its first (as a streaming client sees it)."""
        return [
            (self.last_s[rid] - first_s) / (self.num_tokens[rid] - 1)
            for rid, first_s in self.ttft_s.items()
            if self.num_tokens[rid] > 1
        ]


def _measure(engine: LLMEngine, prompts: list[BenchPrompt], use_tqdm: bool) -> dict[str, Any]:
    _warm_up(engine, prompts)
    preemptions_before = engine.stats().num_preemptions
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.step_profiler = profiler = StepProfiler()  # two device events per step
    start_s = time.perf_counter()
    for index, prompt in enumerate(prompts):
        _add(engine, f"bench-{index}", prompt.token_ids, prompt.output_len)
    tally = _step_until_done(engine, len(prompts), start_s, use_tqdm)
    elapsed_s = time.perf_counter() - start_s
    engine.step_profiler = StepProfiler(enabled=False)
    num_input_tokens = sum(len(p.token_ids) for p in prompts)
    weights_bytes = engine.loaded.weights_bytes
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(prompts),
        "input_tokens": num_input_tokens,
        "output_tokens": tally.num_output_tokens,
        "output_tok_s": tally.num_output_tokens / elapsed_s,
        "total_tok_s": (num_input_tokens + tally.num_output_tokens) / elapsed_s,
        "mean_ttft_s": sum(tally.ttft_s.values()) / max(len(tally.ttft_s), 1),
        "tpot_s": percentiles(tally.tpot_s()),
        "num_preemptions": engine.stats().num_preemptions - preemptions_before,
        # Of this run's prompt tokens (the engine's own rate counts its whole life).
        "prefix_hit_rate": tally.num_cached_prompt_tokens / num_input_tokens,
        "num_steps": tally.num_steps,
        # Each step reads every weight once: a floor on the memory bandwidth achieved.
        "weights_bytes": weights_bytes,
        "weights_gb_s": weights_bytes * tally.num_steps / elapsed_s / BYTES_PER_GB,
        "peak_memory_bytes": _peak_memory_bytes(engine.device),
        # per step kind: host and GPU milliseconds, and how busy the GPU was overall
        "step_profile": profiler.summary(elapsed_s),
    }


def warmup_prompts(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """A small run shaped like the measured one, so one-time costs stay out of the timing.

    Kernel variants compile at the first step that needs them: full prefill chunks, mixed
    steps with their varying decode counts, decode-only steps. The first prompts, reversed
    (the prefix cache cannot serve the timed run from them), a few output tokens each.
    """
    return [
        BenchPrompt(p.token_ids[::-1], min(p.output_len, WARMUP_OUTPUT_LEN))
        for p in prompts[:NUM_WARMUP_PROMPTS]
    ]


def _warm_up(engine: LLMEngine, prompts: list[BenchPrompt]) -> None:
    for index, prompt in enumerate(warmup_prompts(prompts)):
        _add(engine, f"warmup-{index}", prompt.token_ids, prompt.output_len)
    while engine.has_unfinished_requests():
        engine.step()


def _add(engine: LLMEngine, request_id: str, token_ids: list[int], output_len: int) -> None:
    sampling = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling)


def _step_until_done(
    engine: LLMEngine, num_requests: int, start_s: float, use_tqdm: bool
) -> _Tally:
    tally = _Tally()
    with tqdm(total=num_requests, disable=not use_tqdm, desc="throughput", unit="req") as bar:
        while engine.has_unfinished_requests():
            step_outputs = engine.step()
            now_s = time.perf_counter()
            tally.num_steps += 1
            for out in step_outputs:
                tally.num_output_tokens += len(out.new_token_ids)
                if out.new_token_ids:
                    tally.ttft_s.setdefault(out.request_id, now_s - start_s)
                    tally.last_s[out.request_id] = now_s - start_s
                    count = tally.num_tokens.get(out.request_id, 0)
                    tally.num_tokens[out.request_id] = count + len(out.new_token_ids)
                if out.usage is not None:
                    tally.num_cached_prompt_tokens += out.usage.cached_prompt_tokens
                bar.update(int(out.finished))
            rate = tally.num_output_tokens / (now_s - start_s)
            bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
    return tally


def _peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None  # the CPU has no allocator statistics worth reporting


def _resolved_settings(engine: LLMEngine) -> dict[str, Any]:
    """What ``auto`` and unset settings became on this machine."""
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "paged_attention": engine.config.use_paged_attention(),
        "cuda_graphs": engine.runner.uses_cuda_graphs,
        "num_kv_pages": engine.kv_cache.num_blocks,
        "kv_page_tokens": engine.kv_cache.spec.block_size,
        "kv_pool_source": engine.pool_source,
        "sampler_seed": engine.config.seed,  # "seed" above is the workload's
    }


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where a benchmark ran: host, Python, CPU, accelerator and library versions."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": _nvidia_driver() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": _version_of("transformers"),
        "triton": _version_of("triton"),
    }


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, when it is on the PATH."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_record_path(record: dict[str, Any], root: Path = RESULTS_DIR) -> Path:
    """``<root>/throughput-<model slug>-<device slug>-<UTC timestamp>.json``."""
    model = record["settings"]["model"]
    model_name = Path(model).name if os.sep in model else model
    stamp = datetime.fromisoformat(record["created_utc"]).strftime("%Y%m%dT%H%M%SZ")
    device = record["machine"]["device_name"]
    return root / f"{record['kind']}-{_slug(model_name)}-{_slug(device)}-{stamp}.json"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unnamed"


def write_record(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def format_results(results: dict[str, Any]) -> str:
    """The headline numbers as a two-column table."""
    rows = [
        ("requests", f"{results['num_requests']}"),
        ("input tokens", f"{results['input_tokens']}"),
        ("output tokens", f"{results['output_tokens']}"),
        ("elapsed s", f"{results['elapsed_s']:.2f}"),
        ("output tok/s", f"{results['output_tok_s']:.1f}"),
        ("total tok/s", f"{results['total_tok_s']:.1f}"),
        ("mean TTFT s", f"{results['mean_ttft_s']:.3f}"),
        ("preemptions", f"{results['num_preemptions']}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>12}" for name, value in rows)
