"""bench/jit_compiles.py: Triton's build hooks chained, counted and put back."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from bench.jit_compiles import TOP_KERNELS, JitCompiles

knobs = pytest.importorskip("triton").knobs


@dataclass
class Info:  # what Triton passes as ``fn``
    module: str
    name: str


def build(name: str, key: str) -> tuple[Any, Any]:
    """One build as Triton reports it: the cache hook's then the post-compile hook's verdict."""
    kwargs = {"key": key, "repr": f"{name}[...]", "fn": Info("kernels.x", name)}
    hooks = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    before, after = (hook(**kwargs) if hook is not None else None for hook in hooks)
    return before, after


def test_builds_are_counted_by_kernel_and_the_hooks_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    skip_keys = {"cached-elsewhere"}

    def their_cache_hook(**kwargs: Any) -> bool:  # a hook already set keeps its say
        seen.append(kwargs["key"])
        return kwargs["key"] in skip_keys

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", their_cache_hook)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    with JitCompiles() as builds:
        assert build("gemv", "a") == (False, None)
        build("gemv", "b")
        build("merge", "a")  # another kernel, same key: its own build
        assert build("gemv", "cached-elsewhere")[0] is True  # skipped: not counted
    assert knobs.runtime.jit_cache_hook is their_cache_hook
    assert knobs.runtime.jit_post_compile_hook is None
    assert seen == ["a", "b", "a", "cached-elsewhere"]
    summary = builds.summary()
    assert summary is not None and summary["count"] == 3
    by_name = {kernel["name"]: kernel for kernel in summary["kernels"]}
    assert by_name["kernels.x.gemv"]["count"] == 2 and by_name["kernels.x.merge"]["count"] == 1
    assert summary["seconds"] == pytest.approx(sum(k["seconds"] for k in summary["kernels"]))
    assert [k["seconds"] for k in summary["kernels"]] == sorted(
        (k["seconds"] for k in summary["kernels"]), reverse=True
    )
    build("gemv", "c")  # after the block: not ours to count
    assert builds.summary() == summary


def test_the_summary_names_the_slowest_and_a_hook_set_meanwhile_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)

    def theirs(**kwargs: Any) -> None:
        return None

    with JitCompiles() as builds:
        for index in range(TOP_KERNELS + 3):
            build(f"k{index}", "key")
        knobs.runtime.jit_post_compile_hook = theirs  # another library's, set inside
    assert knobs.runtime.jit_post_compile_hook is theirs and knobs.runtime.jit_cache_hook is None
    summary = builds.summary()
    assert summary is not None
    assert summary["count"] == TOP_KERNELS + 3 and len(summary["kernels"]) == TOP_KERNELS


def test_no_hooks_no_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton whose runtime knobs lack the hooks: None."""
    old = types.ModuleType("triton")
    old.knobs = types.SimpleNamespace(runtime=types.SimpleNamespace())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton", old)
    with JitCompiles() as builds:
        pass
    assert builds.summary() is None and not builds.available


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_specialization_built_on_the_gpu_is_counted() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    x = torch.zeros(64, device="cuda")
    add_one[(1,)](x, 64, BLOCK=64)
    with JitCompiles() as builds:
        add_one[(1,)](x, 64, BLOCK=64)  # built before: nothing
        add_one[(1,)](x, 64, BLOCK=128)  # a new specialization
    summary = builds.summary()
    assert summary is not None and summary["count"] == 1
    assert summary["kernels"][0]["name"].endswith("add_one") and summary["seconds"] > 0
    assert torch.equal(x, torch.full_like(x, 3))
