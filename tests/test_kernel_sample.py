"""bench/kernel_sample.py: kernels sorted by kind from their names (ours, vLLM's, cuBLAS's),
and one step in N profiled and scaled up to the run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench.kernel_sample import (
    CATEGORIES,
    KernelSampler,
    category,
    category_gap,
    exclusive_spans,
    format_gap,
    kernel_ceiling,
)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("_prefill_kernel", "attention"),
        ("_decode_kernel", "attention"),
        ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", "attention"),
        ("kernel_unified_attention_2d", "attention"),
        ("nvjet_sm90_tst_256x64_64x5_4x1_v_bz_TNT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("_gemv_kernel", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("_rms_norm_kernel", "elementwise"),
        ("_rotary_write_kv_kernel", "elementwise"),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", "elementwise"),
        ("triton_poi_fused_add_mul_rsqrt_0", "elementwise"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
         "at::native::ArgMaxOps<float>>>", "sampling"),
        ("_apply_token_bitmask_kernel", "sampling"),
        ("_bias_kernel", "sampling"),  # vLLM's logit bias, allowed tokens and min-tokens
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        ("void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>", "communication"),
        ("_fused_allreduce_rms_norm_kernel", "communication"),
        ("_fused_moe_kernel", "moe"),
        ("_moe_gate_up_silu_kernel", "moe"),
        ("_moe_sum_topk_kernel", "moe"),
        ("void vllm::moe::topkGatingSoftmax<8, 128, 4, 16, 32, int>", "moe"),
        ("_fp8_mma_kernel", "gemm"),
        ("_add_planes_kernel", "gemm"),
        ("_reduce_splits_kernel", "attention"),
        ("_merge_states_kernel", "attention"),
        ("_write_kv_kernel", "elementwise"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("aten::mm", "gemm"),
        ("aten::add", "elementwise"),
        ("some_kernel_nobody_named", "other"),
    ],
)  # fmt: skip
def test_kernels_sort_by_kind(name: str, kind: str) -> None:
    assert category(name) == kind
    assert kind in CATEGORIES


def project_kernels() -> list[tuple[str, str]]:
    """(file under kernels/, name) of every Triton kernel the project launches."""
    root = Path(__file__).resolve().parents[1] / "kernels"
    found = []
    for path in sorted(root.rglob("*.py")):
        for name in re.findall(r"^@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text(), re.M):
            found.append((str(path.relative_to(root)), name))
    return found


def test_every_kernel_of_the_project_has_a_kind() -> None:
    """A profile puts each of the project's kernels under the work it does: none is "other",
    and every one under kernels/moe/ is MoE work (the grouped GEMMs fuse SiLU and the top-k
    sum, which their names would otherwise file under elementwise and sampling)."""
    kernels = project_kernels()
    assert len(kernels) > 30  # the scan found the kernels
    kinds = {(where, name): category(name) for where, name in kernels}
    assert [k for k, kind in kinds.items() if kind == "other"] == []
    moe = {k: kind for k, kind in kinds.items() if k[0].startswith("moe/")}
    assert len(moe) >= 8
    assert set(moe.values()) == {"moe"}, moe


def test_about_one_step_in_n_is_profiled_and_scaled_up_to_the_run() -> None:
    sampler = KernelSampler(3, "cpu", seed=1)
    a = torch.randn(128, 128)
    results = [sampler.step(lambda: a @ a) for _ in range(30)]
    assert all(torch.equal(r, a @ a) for r in results)  # each call's own result, profiled or not
    summary = sampler.summary()
    assert (summary["steps"], summary["every"]) == (30, 3)
    assert 3 <= summary["sampled_steps"] <= 20  # drawn, about 10
    again = KernelSampler(3, "cpu", seed=1)
    for _ in range(30):
        again.step(lambda: None)
    assert again.summary()["sampled_steps"] == summary["sampled_steps"]  # seeded
    # one matmul a sampled step, scaled up to all 30
    mm = next(row for row in summary["top_kernels"] if row["name"] == "aten::mm")
    assert mm["calls_per_step"] == 1 and mm["category"] == "gemm"
    assert summary["categories_s"]["gemm"] >= mm["s"] > 0  # with aten::matmul's own time
    assert summary["kernel_s"] == pytest.approx(sum(summary["categories_s"].values()))
    every_step = KernelSampler(1, "cpu")
    step = every_step.wrapping(lambda: a @ a)
    step(), step()
    assert every_step.summary()["sampled_steps"] == 2


def test_overlapping_kernels_share_no_time() -> None:
    # a decode (0-10), its reduction launched early with PDL (2-12: waits inside the
    # decode, works 10-12), then a norm after a gap (15-16)
    spans = [(2.0, 12.0, "reduce"), (0.0, 10.0, "decode"), (15.0, 16.0, "norm")]
    assert exclusive_spans(spans) == [("decode", 10.0), ("reduce", 2.0), ("norm", 1.0)]
    # a kernel wholly inside another gets nothing
    assert exclusive_spans([(0.0, 10.0, "a"), (1.0, 2.0, "b")]) == [("a", 10.0), ("b", 0.0)]


def test_nothing_sampled_is_zero_not_a_division_by_zero() -> None:
    sampler = KernelSampler(10, "cpu")
    sampler.step(lambda: None)
    assert sampler.summary()["kernel_s"] == 0 and sampler.summary()["sampled_steps"] == 0
    with pytest.raises(ValueError, match="at least 1"):
        KernelSampler(0, "cpu")


def test_the_gap_is_ours_minus_the_peers_largest_first() -> None:
    def profile(**seconds: float) -> dict[str, object]:
        cats = dict.fromkeys(CATEGORIES, 0.0) | seconds
        return {"every": 4, "kernel_s": sum(cats.values()), "categories_s": cats}

    ours, theirs = profile(attention=9.0, gemm=3.0), profile(attention=6.0, gemm=3.5)
    gap = category_gap(ours, theirs)
    assert gap["attention"] == 3.0 and gap["gemm"] == -0.5 and gap["copy"] == 0
    text = format_gap("qwen3 long", ours, theirs, "vllm").splitlines()
    assert "pagestream 12.00 / vllm 9.50" in text[0]
    assert text[1].split()[0] == "attention" and text[2].split()[0] == "gemm"
    assert len(text) == 4  # categories both sides left at zero are not listed
    assert text[3].endswith("kernels as fast as vllm's: 1.00x")  # nothing but GEMM, attention


def test_the_ceiling_is_the_peer_s_time_over_its_gemm_attention_moe_and_collectives() -> None:
    cats = dict.fromkeys(CATEGORIES, 0.0) | dict(
        gemm=5.0, attention=3.0, moe=1.0, communication=1.0, elementwise=0.6, copy=0.4
    )
    assert kernel_ceiling({"kernel_s": 11.0, "categories_s": cats}) == pytest.approx(1.1)
    empty = dict.fromkeys(CATEGORIES, 0.0) | {"elementwise": 1.0}
    assert kernel_ceiling({"kernel_s": 1.0, "categories_s": empty}) is None  # nothing bounds it
