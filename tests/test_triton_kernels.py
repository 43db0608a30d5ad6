"""Triton norm, rotary, activation and KV-write kernels against their torch references.

Without CUDA the kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``)
at small sizes; with CUDA the same tests run on the GPU, plus the ``gpu``-marked ones.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import CUDA, DEVICE, import_kernels

# Dependencies before dependents: a reload must see the reloaded helpers.
KERNEL_MODULES = (
    "kernels.attention.kv_write_triton",
    "kernels.attention.paged_attention_common",
    "kernels.attention.cascade_triton",
    "kernels.attention.paged_attention_prefill_triton",
    "kernels.attention.paged_attention_triton",
    "kernels.elementwise.norm_triton",
    "kernels.elementwise.rotary_triton",
    "kernels.elementwise.rotary_kv_write_triton",
    "kernels.elementwise.activation_triton",
)


KERNELS = import_kernels(KERNEL_MODULES)
norm_triton = KERNELS["norm_triton"]
rotary_triton = KERNELS["rotary_triton"]
activation_triton = KERNELS["activation_triton"]
kv_write_triton = KERNELS["kv_write_triton"]

from kernels.attention.paged_attention import write_kv_ref  # noqa: E402
from kernels.elementwise.activation import silu_and_mul_ref  # noqa: E402
from kernels.elementwise.norm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq, rotary_ref  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One rounding step of each dtype: kernels that follow the reference's rounding points agree
# to about that (fp32 reductions may add or order differently).
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# -- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 100), (4, 3, 32)])
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(*shape, device=DEVICE, dtype=dtype) * 3
    weight = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    assert_close(norm_triton.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)


def test_rms_norm_on_a_strided_view_with_fp32_weight() -> None:
    # Qwen3's per-head q norm: q is a [T, Hq, D] view into the fused qkv output.
    qkv = torch.randn(6, 3 * 4 * 32, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    weight = torch.randn(32, device=DEVICE)  # fp32 weight: the output promotes to fp32
    out = norm_triton.rms_norm(q, weight, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_ref(q, weight, 1e-5), torch.bfloat16)  # normed in bf16


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_residual_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 96, device=DEVICE, dtype=dtype)
    residual = torch.randn(7, 96, device=DEVICE, dtype=dtype)
    weight = torch.randn(96, device=DEVICE, dtype=dtype)
    expected_normed, expected_sum = fused_add_rms_norm_ref(x, residual.clone(), weight, 1e-6)
    normed, new_residual = norm_triton.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr()
    # Same rounding, so bit-equal; except that the interpreter truncates fp32 -> bf16 casts
    # (Triton 3.9), which leaves a one-ulp difference.
    exact = CUDA or dtype != torch.bfloat16
    tol = 0.0 if exact else 2.0**-7
    torch.testing.assert_close(new_residual, expected_sum, atol=tol, rtol=tol)
    assert_close(normed, expected_normed, dtype)


# -- rotary -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 32), (3, 1, 20)])
def test_rotary_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(num_heads + head_dim)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, scaling), 256)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    num_tokens = 9
    # q and k as views into one fused projection output, like the model's
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    expected_q, expected_k = rotary_ref(q, positions, cos, sin), rotary_ref(k, positions, cos, sin)
    out_q, out_k = rotary_triton.rotary(q, k, positions, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    assert_close(out_q, expected_q, dtype)
    assert_close(out_k, expected_k, dtype)


# -- SiLU-and-mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2 * 48), (3, 2 * 1500), (2, 3, 2 * 16)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(shape[-1])
    gate_up = torch.randn(*shape, device=DEVICE, dtype=dtype) * 4
    assert_close(activation_triton.silu_and_mul(gate_up), silu_and_mul_ref(gate_up), dtype)


# -- KV write ---------------------------------------------------------------------------------


PoolViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _pool(
    cache_dtype: torch.dtype, num_blocks: int, block_size: int, heads: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, PoolViews]:
    """A layer's (k, v, k_scale, v_scale) views of a [L=2, 2, NB, BS, Hkv, D] pool."""
    pool = torch.zeros(2, 2, num_blocks, block_size, heads, dim, device=DEVICE, dtype=cache_dtype)
    scales = torch.zeros(2, 2, num_blocks, block_size, heads, device=DEVICE)
    return pool, scales, (pool[1, 0], pool[1, 1], scales[1, 0], scales[1, 1])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_and_skips_negative_slots(fp8: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    num_tokens, heads, dim, block_size = 9, 2, 24, 4
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    qkv = torch.randn(num_tokens, 3 * heads * dim, device=DEVICE, dtype=dtype)
    # k compact (as after Qwen3's per-head norm), v a strided view of the fused projection
    k = qkv[:, heads * dim : 2 * heads * dim].reshape(num_tokens, heads, dim).contiguous()
    v = qkv[:, 2 * heads * dim :].view(num_tokens, heads, dim)
    assert k.stride() != v.stride()
    k[0, 0, 5] = 300.0  # a large outlier: the rest of that vector lands in e4m3 subnormals
    slots = torch.tensor([3, 17, -1, 0, 9, -5, 12, 19, 8], device=DEVICE)
    pool, scales, (kc, vc, ks, vs) = _pool(cache_dtype, 5, block_size, heads, dim)
    ref_pool, ref_scales, (rkc, rvc, rks, rvs) = _pool(cache_dtype, 5, block_size, heads, dim)
    scale_args = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    kv_write_triton.write_kv(k, v, kc, vc, slots, **scale_args)
    write_kv_ref(k, v, rkc, rvc, slots, **(dict(k_scale=rks, v_scale=rvs) if fp8 else {}))
    # Bit-exact, fp8 included: the kernel rounds to e4m3 exactly as torch's cast does.
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))
    torch.testing.assert_close(scales, ref_scales, atol=0, rtol=0)
    written = (pool.view(torch.uint8) != 0).flatten(4).any(-1)  # [L, 2, NB, BS]
    assert int(written.sum()) == 2 * 7  # 7 valid slots of K and V, layer 1 only


# -- launcher checks --------------------------------------------------------------------------


def test_launchers_reject_bad_arguments() -> None:
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        norm_triton.rms_norm(x, torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        norm_triton.rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm_triton.fused_add_rms_norm(x, x.half(), torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        activation_triton.silu_and_mul(torch.randn(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="int"):
        activation_triton.silu_and_mul(torch.ones(4, 8, dtype=torch.int32, device=DEVICE))
    q = torch.randn(3, 2, 8, device=DEVICE)
    cos = torch.ones(10, 8, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        rotary_triton.rotary(q, q, torch.zeros(3, device=DEVICE), cos, cos)
    with pytest.raises(ValueError, match="cos_cache"):
        rotary_triton.rotary(q, q, torch.zeros(3, dtype=torch.long, device=DEVICE), cos[:, :4], cos)
    _, _, (kc, vc, _, _) = _pool(torch.float8_e4m3fn, 2, 4, 2, 8)
    kv = torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        kv_write_triton.write_kv(kv, kv, kc, vc, slots)  # fp8 pool without scales
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_write_triton.write_kv(kv, kv, kc.float(), vc.float(), slots.int())
