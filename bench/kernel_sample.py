"""Where a whole run's device time goes, by kind of kernel, for any engine whose loop calls a
step function: about one step in every ``every`` (drawn at random, seeded: a fixed stride
could fall in step with a periodic schedule) runs under ``torch.profiler`` (device activity
only on CUDA), its kernels are summed by name and sorted into categories, and the sums are
scaled up to the run's step count.

Kernels that overlap share no time: each instant of the step goes to the kernel that started
first. A kernel launched early with programmatic dependent launch (PDL) waits inside its
predecessor, and its own span would count that wait again (a split-KV decode's reduction
showed as long as the decode it waited for).

``bench matrix --profile-every N`` samples both sides this way (pagestream's step loop, and
vLLM's ``LLMEngine.step`` in its peer process), so a row's record shows which kind of kernel
holds the gap: attention, GEMMs, the small fused kernels, sampling or copies. The sampled
step is fenced by device synchronizations, so its kernels are its own; a profiled run is
slower than a measured one and its throughput is not the row's figure.

On the CPU (tests) there are no device kernels: the CPU ops' self times stand in.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
TOP_KERNELS = 15

# (category, lower-case name fragments), first match wins: flash attention's kernels are also
# cutlass kernels, vLLM's KV write (reshape_and_cache_flash) is no attention, inductor's fused
# kernels (triton_poi_fused__to_copy_...) are no copies, the fused norm + all-reduce is
# communication before it is a norm, and an expert kernel is MoE work whatever it fuses (the
# project's MoE kernels are named ``_moe_...``: SiLU or top-k in a name does not make them
# elementwise or sampling). vLLM's ``_bias_kernel`` applies logit bias, allowed tokens and
# min-tokens to the logits: sampling work.
# fmt: off
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_reduce", "allreduce", "one_shot", "two_shot", "multimem")),
    ("elementwise", ("reshape_and_cache", "write_kv", "triton_poi", "triton_red", "triton_per")),
    ("moe", ("moe", "expert")),
    ("attention", ("_prefill_kernel", "_decode_kernel", "_prefix_kernel", "reduce_splits",
                   "merge_states", "flash", "fmha", "attention", "attn")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "splitkreduce", "_gemv", "_mma", "add_planes",
              "quant", "matmul", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear")),
    ("sampling", ("argmax", "softmax", "topk", "top_k", "sort", "bitmask", "sampl", "multinomial",
                  "_bias_kernel")),
    ("copy", ("memcpy", "memset", "copy", "aten::cat", "index", "gather", "scatter", "fill")),
    ("elementwise", ("norm", "rotary", "rope", "silu", "act_and_mul", "gelu", "elementwise",
                     "aten::")),
)
# fmt: on
CATEGORIES = (*dict.fromkeys(name for name, _ in CATEGORY_RULES), "other")


def category(kernel_name: str) -> str:
    """The kind of work a kernel (or, on the CPU, an op) does, from its name."""
    lowered = kernel_name.lower()
    for name, fragments in CATEGORY_RULES:
        if any(fragment in lowered for fragment in fragments):
            return name
    return "other"


class KernelSampler:
    """Wraps a run's step calls: ``sampler.step(engine.step)`` in place of ``engine.step()``."""

    def __init__(self, every: int, device: torch.device | str, seed: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self._draw = random.Random(seed)
        self.on_cuda = torch.device(device).type == "cuda"
        self.num_steps = 0
        self.num_sampled = 0
        self._us: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)

    def step(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` (one engine step); profile it with probability 1 / ``every``."""
        self.num_steps += 1
        if self.every > 1 and self._draw.randrange(self.every):
            return fn()
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if self.on_cuda else ProfilerActivity.CPU
        self._synchronize()  # the steps before it ran outside the window
        with profile(activities=[activity]) as prof:
            out = fn()
            self._synchronize()  # all of its kernels inside
        self.num_sampled += 1
        for name, us, calls in kernel_times(prof, self.on_cuda):
            self._us[name] += us
            self._calls[name] += calls
        return out

    def wrapping(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` with every call going through ``step`` (for a loop this code does not own)."""
        return lambda: self.step(fn)

    def summary(self) -> dict[str, Any]:
        """Seconds per category and the top kernels, estimated over the whole run (the sampled
        steps' sums times steps / sampled steps)."""
        scale = self.num_steps / self.num_sampled if self.num_sampled else 0.0
        by_category = dict.fromkeys(CATEGORIES, 0.0)
        for name, us in self._us.items():
            by_category[category(name)] += us * 1e-6 * scale
        top = sorted(self._us.items(), key=lambda item: -item[1])[:TOP_KERNELS]
        return {
            "every": self.every,
            "steps": self.num_steps,
            "sampled_steps": self.num_sampled,
            "time": "device" if self.on_cuda else "cpu",
            "kernel_s": sum(by_category.values()),
            "categories_s": by_category,
            "top_kernels": [
                {
                    "name": name[:160],
                    "category": category(name),
                    "s": us * 1e-6 * scale,
                    "calls_per_step": self._calls[name] / self.num_sampled,
                }
                for name, us in top
            ],
        }

    def _synchronize(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()


def kernel_times(prof: Any, on_cuda: bool) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls) of each device kernel, copy and set, overlaps given to the
    one that started first (``exclusive_spans``); on the CPU, of each op's self time (its
    children's excluded, so nested ops are not counted twice)."""
    if on_cuda:
        spans = [
            (event.time_range.start, event.time_range.end, event.name)
            for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
        ]
        return [(name, us, 1) for name, us in exclusive_spans(spans)]
    return [
        (event.key, event.self_cpu_time_total, event.count)
        for event in prof.key_averages()
        if event.self_cpu_time_total > 0
    ]


def exclusive_spans(spans: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """``(start, end, name)`` intervals -> ``(name, time of it no earlier-started interval
    covers)``, in start order: the parts add up to the union of the intervals."""
    out, covered_until = [], float("-inf")
    for start, end, name in sorted(spans, key=lambda span: (span[0], span[1])):
        out.append((name, max(0.0, end - max(start, covered_until))))
        covered_until = max(covered_until, end)
    return out


def category_gap(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """Per category, our estimated seconds minus the peer's (positive: we spend more)."""
    return {
        name: ours["categories_s"].get(name, 0.0) - theirs["categories_s"].get(name, 0.0)
        for name in CATEGORIES
    }


# Kinds of kernel whose time is the kernel's own craft (a GEMM library's, an attention
# kernel's, the experts', the collectives'), beside the small kernels an engine can fuse away
BOUND_CATEGORIES = ("gemm", "attention", "moe", "communication")


def kernel_ceiling(theirs: dict[str, Any]) -> float | None:
    """The most a run can lead the peer's by with GEMM, attention, MoE and collective kernels
    no faster than the peer's: its kernel seconds over those kinds' seconds, as if everything
    else took no time. It holds while the peer keeps the GPU busy (a host-bound peer leaves
    more room); under a row's target, the target asks for faster kernels of those kinds."""
    bound = sum(theirs["categories_s"].get(name, 0.0) for name in BOUND_CATEGORIES)
    return theirs["kernel_s"] / bound if bound > 0 else None


def format_gap(label: str, ours: dict[str, Any], theirs: dict[str, Any], peer: str) -> str:
    """A few lines: each category's seconds on both sides, largest gap first, and the
    ceiling the peer's own GEMM and attention kernels leave (``kernel_ceiling``)."""
    gap = category_gap(ours, theirs)
    lines = [f"{label}: kernel seconds, pagestream {ours['kernel_s']:.2f} / {peer} "
             f"{theirs['kernel_s']:.2f} (1 step in {ours['every']} sampled)"]  # fmt: skip
    for name in sorted(gap, key=lambda n: -abs(gap[n])):
        a, b = ours["categories_s"].get(name, 0.0), theirs["categories_s"].get(name, 0.0)
        if a or b:
            lines.append(f"  {name:<14} {a:8.2f} s {b:8.2f} s  {gap[name]:+8.2f}")
    ceiling = kernel_ceiling(theirs)
    if ceiling is not None:
        lines.append(f"  ceiling with {'/'.join(BOUND_CATEGORIES)} kernels as fast as {peer}'s: "
                     f"{ceiling:.2f}x")  # fmt: skip
    return "\n".join(lines)
