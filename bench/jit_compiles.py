"""Triton kernels built during a timed run: which, how many, and the seconds they took.

A benchmark warms the engine up before it starts the clock, but a kernel that first meets a
new specialization inside the timed run (a shape bucket, a pointer's alignment, a config of a
tuned table) is built there, on the step's critical path: seconds when Triton's disk cache
misses (a fresh machine's first process), milliseconds when it hits. A fresh H200's first
process ran the long-context row 7% slower than later ones (docs/performance.md), and
nothing said which kernels it built; ``JitCompiles`` does.

It chains onto Triton's runtime hooks (``triton.knobs.runtime.jit_cache_hook``, called when a
specialization is not in the process's kernel cache, before it is built or read from the disk
cache, and ``jit_post_compile_hook``, once it is), in this process only: a tensor-parallel
rank's builds are its own process's. Under ``TRITON_INTERPRET=1`` nothing is built, so a CPU
run counts none. cuDNN's graph builds are not Triton's and are not counted
(``prefill_sdpa.build_shapes`` builds those ahead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

TOP_KERNELS = 10  # the kernels a summary names, by the seconds their builds took


@dataclass
class JitCompiles:
    """``with JitCompiles() as builds: ...``, then ``builds.summary()``. Hooks set by others
    are called first and keep their say (a cache hook that returns true skips the build)."""

    started_s: dict[str, float] = field(default_factory=dict)  # building now, by specialization
    seconds_by_kernel: dict[str, list[float]] = field(default_factory=dict)
    available: bool = False  # this Triton has the hooks
    _knobs: Any = None
    _previous: tuple[Callable[..., Any] | None, Callable[..., Any] | None] = (None, None)

    def __enter__(self) -> JitCompiles:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or an older one without its knobs
            return self
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._knobs, self.available = runtime, True
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self.before_build, self.built
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._knobs is None:
            return
        # hooks another library set meanwhile stay (theirs then chain to nothing of ours)
        if self._knobs.jit_cache_hook == self.before_build:
            self._knobs.jit_cache_hook = self._previous[0]
        if self._knobs.jit_post_compile_hook == self.built:
            self._knobs.jit_post_compile_hook = self._previous[1]
        self._knobs = None

    def before_build(self, **kwargs: Any) -> Any:
        """Triton's cache hook: a specialization not yet in this process is about to be built
        (or loaded from the disk cache)."""
        previous = self._previous[0]
        verdict = previous(**kwargs) if previous is not None else None
        if not verdict:
            self.started_s[_specialization(kwargs)] = time.perf_counter()
        return verdict

    def built(self, **kwargs: Any) -> Any:
        """Triton's post-compile hook: the specialization is ready."""
        previous = self._previous[1]
        verdict = previous(**kwargs) if previous is not None else None
        started_s = self.started_s.pop(_specialization(kwargs), None)
        if started_s is not None:
            name = _kernel_name(kwargs)
            self.seconds_by_kernel.setdefault(name, []).append(time.perf_counter() - started_s)
        return verdict

    def summary(self) -> dict[str, Any] | None:
        """``{"count", "seconds", "kernels": [{"name", "count", "seconds"}, ...]}`` (the
        ``TOP_KERNELS`` slowest to build), or None where Triton has no hooks to count with."""
        if not self.available:
            return None
        by_time = sorted(self.seconds_by_kernel.items(), key=lambda item: -sum(item[1]))
        return {
            "count": sum(len(times) for times in self.seconds_by_kernel.values()),
            "seconds": sum(sum(times) for times in self.seconds_by_kernel.values()),
            "kernels": [
                {"name": name, "count": len(times), "seconds": sum(times)}
                for name, times in by_time[:TOP_KERNELS]
            ],
        }


def _specialization(hook_kwargs: dict[str, Any]) -> str:
    """What one build is of: the kernel and its specialization key (the same in both hooks)."""
    return f"{_kernel_name(hook_kwargs)}:{hook_kwargs.get('key')!r}"


def _kernel_name(hook_kwargs: dict[str, Any]) -> str:
    fn = hook_kwargs.get("fn")
    return f"{fn.module}.{fn.name}" if fn is not None else str(hook_kwargs.get("repr", "?"))
