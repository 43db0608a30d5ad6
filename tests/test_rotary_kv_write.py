"""The fused rotary + KV-write kernel against the two kernels it replaces and the reference.

CPU runs go through Triton's interpreter at small sizes (see test_triton_kernels.py for how
TRITON_INTERPRET is set); the ``gpu``-marked tests run llama3-8b's and Qwen3-8B's head shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.attention.paged_attention import FP8_DTYPE, dequantize_fp8
from kernels.elementwise.norm import HeadNorms
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq
from kernels.elementwise.rotary_kv_write import rotary_write_kv_ref
from tests.test_triton_kernels import CUDA, DEVICE, DTYPES, KERNELS, TOLERANCE, assert_close

rotary_write_kv = KERNELS["rotary_kv_write_triton"].rotary_write_kv
rotary = KERNELS["rotary_triton"].rotary
write_kv = KERNELS["kv_write_triton"].write_kv
rms_norm = KERNELS["norm_triton"].rms_norm
MAX_POSITIONS = 256
FP8_STEP = 2.0**-3  # e4m3's spacing relative to a normal value; 2^-9 of the scale below
# The interpreter truncates fp32 -> bf16 casts (Triton 3.9; see test_triton_kernels.py): with
# the norm's two roundings before rotary's four, a bf16 value may end up a few ulps below the
# reference's (on CUDA, which rounds to nearest, one tolerance holds).
INTERPRETED_BF16_NORM_SLACK = 4.0


@dataclass
class Step:
    """A step's new tokens as views of one fused qkv output, and a layer's slice of a
    [L=2, 2, NB, BS, Hkv, D] pool."""

    qkv: torch.Tensor  # [T, (Hq + 2 Hkv) * D]
    q: torch.Tensor  # [T, Hq, D], views of qkv
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] int64, some negative
    pool: torch.Tensor  # [2, 2, NB, BS, Hkv, D]
    scales: torch.Tensor  # [2, 2, NB, BS, Hkv] float32

    @classmethod
    def random(
        cls,
        dtype: torch.dtype,
        cache_dtype: torch.dtype,
        heads: tuple[int, int, int],  # Hq, Hkv, D
        seed: int,
        num_tokens: int = 9,
        block_size: int = 4,
    ) -> Step:
        num_heads, num_kv_heads, head_dim = heads
        torch.manual_seed(seed)
        num_blocks = num_tokens // block_size + 3
        width = (num_heads + 2 * num_kv_heads) * head_dim
        qkv = (torch.randn(num_tokens, width, device=DEVICE) * 2).to(dtype)
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
        slots[2::3] = -1  # padding rows
        pool_shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            qkv=qkv,
            q=qkv[:, :q_end].view(num_tokens, num_heads, head_dim),
            k=qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
            v=qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim),
            positions=torch.randint(0, MAX_POSITIONS, (num_tokens,), device=DEVICE),
            slots=slots,
            pool=torch.zeros(pool_shape, device=DEVICE, dtype=cache_dtype),
            scales=torch.zeros(pool_shape[:-1], device=DEVICE),
        )

    def clone(self) -> Step:
        """A deep copy; q, k, v that were views of qkv are views of the copy's."""
        qkv = self.qkv.clone()

        def copy(x: torch.Tensor) -> torch.Tensor:
            if x._base is not self.qkv:
                return x.clone()
            offset = x.storage_offset() - self.qkv.storage_offset()
            return qkv.as_strided(x.shape, x.stride(), qkv.storage_offset() + offset)

        return Step(
            qkv=qkv,
            q=copy(self.q),
            k=copy(self.k),
            v=copy(self.v),
            positions=self.positions,
            slots=self.slots,
            pool=self.pool.clone(),
            scales=self.scales.clone(),
        )

    def pool_args(self) -> dict[str, torch.Tensor]:
        """Layer 1's k_cache, v_cache (and scales with an fp8 pool)."""
        args = dict(k_cache=self.pool[1, 0], v_cache=self.pool[1, 1])
        if self.pool.dtype == FP8_DTYPE:
            args |= dict(k_scale=self.scales[1, 0], v_scale=self.scales[1, 1])
        return args

    def dequantized_pool(self) -> torch.Tensor:  # fp8 pool -> float32 values
        return dequantize_fp8(self.pool, self.scales, torch.float32)


def _rope(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, scaling), MAX_POSITIONS)
    return cos.to(DEVICE), sin.to(DEVICE)


def _assert_fp8_pools_close(actual: Step, expected: Step, tol: float) -> None:
    """Scales within rotary's tolerance (the two sides rotate k a few ulps apart), values
    within that tolerance plus one e4m3 step."""
    torch.testing.assert_close(actual.scales, expected.scales, rtol=tol, atol=0)
    a, b = actual.dequantized_pool(), expected.dequantized_pool()
    subnormal_step = expected.scales[..., None] * 2.0**-9
    bound = tol + (FP8_STEP + tol) * torch.maximum(a.abs(), b.abs()) + subnormal_step
    assert bool(((a - b).abs() <= bound).all()), (
        f"max excess {float(((a - b).abs() - bound).max())}"
    )


def _run_unfused(step: Step, cos: torch.Tensor, sin: torch.Tensor, norms: HeadNorms | None) -> None:
    """What the fused kernel replaces: the norm kernel on q and on k (into new tensors, as the
    model's q_norm and k_norm), rotary, then write_kv."""
    if norms is not None:
        step.q = rms_norm(step.q, norms.q_weight, norms.eps)
        step.k = rms_norm(step.k, norms.k_weight, norms.eps)
    rotary(step.q, step.k, step.positions, cos, sin)
    write_kv(step.k, step.v, slot_mapping=step.slots, **step.pool_args())


def _check_fused(step: Step, dtype: torch.dtype, norms: HeadNorms | None = None) -> None:
    """Fused == the kernels it replaces (bit for bit without norms); both equal the reference
    within tolerance."""
    cos, sin = _rope(step.q.shape[2])
    fused, unfused, reference = step.clone(), step.clone(), step.clone()
    out = rotary_write_kv(
        fused.q, fused.k, fused.v, step.positions, cos, sin, slot_mapping=step.slots,
        head_norms=norms, **fused.pool_args(),
    )  # fmt: skip
    assert out.data_ptr() == fused.q.data_ptr()  # q normed and rotated in place
    _run_unfused(unfused, cos, sin, norms)
    expected_q = rotary_write_kv_ref(
        reference.q, reference.k, reference.v, step.positions, cos, sin,
        slot_mapping=step.slots, head_norms=norms, **reference.pool_args(),
    )  # fmt: skip
    # 1. the engine's numbers do not move: the same q and pages as the kernels it replaces
    # (the norm kernel sums the squares in another order: a last-bit difference at most)
    if norms is None:
        assert torch.equal(fused.q, unfused.q)
        assert torch.equal(fused.pool.view(torch.uint8), unfused.pool.view(torch.uint8))
        assert torch.equal(fused.scales, unfused.scales)
    else:
        assert_close(fused.q, unfused.q, dtype)
        _assert_pools_close(fused, unfused, TOLERANCE[dtype])
    # 2. k and v stay as they came: the rotated k goes to the pages only
    assert torch.equal(fused.k, step.k) and torch.equal(fused.v, step.v)
    # 3. the reference: (rms_norm_ref,) rotary_ref then write_kv_ref
    tol = TOLERANCE[dtype]
    if norms is not None and dtype == torch.bfloat16 and not CUDA:
        tol *= INTERPRETED_BF16_NORM_SLACK
    torch.testing.assert_close(fused.q, expected_q, atol=tol, rtol=tol)
    _assert_pools_close(fused, reference, tol)
    written = (fused.pool.view(torch.uint8) != 0).flatten(4).any(-1)  # [L, 2, NB, BS]
    expected_written = (reference.pool.view(torch.uint8) != 0).flatten(4).any(-1)
    assert torch.equal(written, expected_written)
    num_stored = int((step.slots >= 0).sum())
    assert int(written[1].sum()) == 2 * num_stored and not written[0].any()  # layer 1 only


def _assert_pools_close(actual: Step, expected: Step, tol: float) -> None:
    if expected.pool.dtype == FP8_DTYPE:
        _assert_fp8_pools_close(actual, expected, tol)
    else:
        torch.testing.assert_close(actual.pool, expected.pool, atol=tol, rtol=tol)


def _head_norms(dtype: torch.dtype, head_dim: int, seed: int) -> HeadNorms:
    """Weights about 1 as trained Qwen3 norms have, eps as its config's."""
    generator = torch.Generator().manual_seed(seed)
    q_weight, k_weight = (1 + 0.5 * torch.randn(2, head_dim, generator=generator)).to(dtype)
    return HeadNorms(q_weight.to(DEVICE), k_weight.to(DEVICE), eps=1e-6)


HEADS = [(4, 2, 32), (3, 1, 20)]  # (Hq, Hkv, D): GQA, and a D whose half is no power of 2


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_rotary_write_kv_matches_two_kernels_and_reference(
    heads: tuple[int, int, int], dtype: torch.dtype, fp8: bool
) -> None:
    step = Step.random(dtype, FP8_DTYPE if fp8 else dtype, heads, seed=sum(heads))
    step.k[0, 0, 3] = 300.0  # an outlier: the rest of that fp8 vector lands in subnormals
    _check_fused(step, dtype)


# (Hq, Hkv, D), dtype, fp8 pool: Qwen3's head dims (GQA), and a D whose half is no power of
# 2; every dtype and both pools, not all combinations (the interpreter is slow)
HEAD_NORM_CASES = [
    ((4, 2, 64), torch.bfloat16, False),
    ((4, 2, 64), torch.float16, True),
    ((2, 1, 128), torch.float32, False),
    ((2, 1, 128), torch.bfloat16, True),
    ((3, 1, 20), torch.bfloat16, False),
]


@pytest.mark.parametrize(("heads", "dtype", "fp8"), HEAD_NORM_CASES)
def test_rotary_write_kv_with_head_norms_matches_norm_kernels_and_reference(
    heads: tuple[int, int, int], dtype: torch.dtype, fp8: bool
) -> None:
    step = Step.random(dtype, FP8_DTYPE if fp8 else dtype, heads, seed=sum(heads))
    step.k[0, 0, 3] = 300.0  # a norm divides the outlier down; still the largest of its head
    _check_fused(step, dtype, _head_norms(dtype, heads[2], seed=heads[2]))


def test_rotary_write_kv_with_compact_k_and_no_tokens() -> None:
    # Qwen3 norms q and k per head: compact tensors beside v, a view of the fused output
    step = Step.random(torch.bfloat16, torch.bfloat16, (4, 2, 32), seed=7)
    step.q, step.k = step.q.contiguous(), step.k.contiguous()
    assert step.clone().k._base is None and step.clone().v._base is not None
    _check_fused(step, torch.bfloat16)
    empty = step.clone()
    cos, sin = _rope(32)
    rotary_write_kv(
        empty.q[:0], empty.k[:0], empty.v[:0], step.positions[:0], cos, sin,
        slot_mapping=step.slots[:0], **empty.pool_args(),
    )  # fmt: skip
    assert not empty.pool.any()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_write_kv_at_llama3_8b_sizes(num_tokens: int, fp8: bool) -> None:
    cache_dtype = FP8_DTYPE if fp8 else torch.bfloat16
    heads = (32, 8, 128)
    step = Step.random(torch.bfloat16, cache_dtype, heads, 11, num_tokens, block_size=16)
    _check_fused(step, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_write_kv_with_head_norms_at_qwen3_8b_sizes(num_tokens: int, fp8: bool) -> None:
    cache_dtype = FP8_DTYPE if fp8 else torch.bfloat16
    heads = (32, 8, 128)
    step = Step.random(torch.bfloat16, cache_dtype, heads, 13, num_tokens, block_size=16)
    _check_fused(step, torch.bfloat16, _head_norms(torch.bfloat16, 128, seed=3))


def test_rotary_write_kv_rejects_bad_arguments() -> None:
    step = Step.random(torch.float32, FP8_DTYPE, (4, 2, 32), seed=1)
    cos, sin = _rope(32)
    args = (step.q, step.k, step.v, step.positions, cos, sin)
    pool = step.pool_args()
    with pytest.raises(ValueError, match="k_scale"):
        rotary_write_kv(*args, pool["k_cache"], pool["v_cache"], step.slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(*args, slot_mapping=step.slots.int(), **pool)
    with pytest.raises(ValueError, match="positions"):
        rotary_write_kv(
            *args[:3], step.positions.float(), cos, sin, slot_mapping=step.slots, **pool
        )
    with pytest.raises(ValueError, match="cos_cache"):
        rotary_write_kv(*args[:4], cos[:, :16], sin, slot_mapping=step.slots, **pool)
    with pytest.raises(ValueError, match="last stride 1"):
        k_t = step.k.transpose(1, 2).contiguous().transpose(1, 2)
        rotary_write_kv(step.q, k_t, *args[2:], slot_mapping=step.slots, **pool)
    norms = _head_norms(torch.float32, 32, seed=0)
    with pytest.raises(ValueError, match=r"head_norms\.k_weight must be a contiguous"):
        bad = HeadNorms(norms.q_weight, norms.k_weight[:16], norms.eps)
        rotary_write_kv(*args, slot_mapping=step.slots, head_norms=bad, **pool)
    with pytest.raises(ValueError, match=r"head_norms\.q_weight must be torch\.float32"):
        bad = HeadNorms(norms.q_weight.bfloat16(), norms.k_weight, norms.eps)
        rotary_write_kv(*args, slot_mapping=step.slots, head_norms=bad, **pool)
