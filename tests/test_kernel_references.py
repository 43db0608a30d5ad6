"""The plain-torch op references against independent dense formulations and transformers."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention.paged_attention import paged_attention_ref, write_kv_ref
from kernels.elementwise.activation import silu_and_mul_ref
from kernels.elementwise.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.elementwise.rotary import rope_cos_sin_cache, rope_inv_freq, rotary_ref


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Textbook attention of ``q`` [Q, Hq, D] as the last Q positions over keys [L, Hkv, D]."""
    query_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1).double()  # [L, Hq, D]
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(head_dim)
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(
    block_size: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    torch.manual_seed(block_size * 100 + num_heads)
    head_dim = 16
    # Decodes first (1 query each), then prefill chunks over a cached context.
    query_lens = [1, 1, 1, 7, 13, 3]
    context_lens = [9, 1, 30, 0, 20, 40]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()  # pages scattered through the pool
    tables, keys, values = [], [], []
    for seq_len in seq_lens:
        pages = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(pages)
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim))
    # Write the cached context and the new tokens through the slot mapping.
    for pages, k, v in zip(tables, keys, values, strict=True):
        slots = torch.tensor(
            [pages[t // block_size] * block_size + t % block_size for t in range(len(k))]
        )
        write_kv_ref(k, v, k_cache, v_cache, slots)
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    out = paged_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, starts, head_dim**-0.5, window
    )
    for b in range(len(seq_lens)):
        expected = dense_attention(q[starts[b] : starts[b + 1]], keys[b], values[b], window)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected, atol=1e-5, rtol=1e-4)


def test_write_kv_lands_in_the_right_rows() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(6.0).view(2, 1, 3)
    write_kv_ref(k, -k, k_cache, v_cache, torch.tensor([5, 0]))  # page 2 row 1, page 0 row 0
    assert torch.equal(k_cache[2, 1, 0], k[0, 0]) and torch.equal(k_cache[0, 0, 0], k[1, 0])
    assert torch.equal(v_cache[2, 1, 0], -k[0, 0])
    assert k_cache.abs().sum() == k.abs().sum()  # nothing else written


def test_norms_match_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(32, eps=1e-6)
    hf.weight.data = torch.randn(32)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    torch.testing.assert_close(rms_norm_ref(x, hf.weight, 1e-6), hf(x), atol=0, rtol=0)
    normed, summed = fused_add_rms_norm_ref(x, residual, hf.weight, 1e-6)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, hf(x + residual), atol=0, rtol=0)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 8)
    expected = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    torch.testing.assert_close(silu_and_mul_ref(x), expected)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_inverse_frequencies_match_transformers(scaling: dict[str, object] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 64, 500000.0
    ours = rope_inv_freq(head_dim, theta, scaling)
    if scaling is None:
        expected = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    else:
        config = LlamaConfig(
            hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta, rope_scaling=scaling
        )
        expected, _ = ROPE_INIT_FUNCTIONS[str(scaling["rope_type"])](config, "cpu")
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)


def test_rotary_is_a_rotation_by_position() -> None:
    head_dim = 8
    cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, None), 64)
    x = torch.randn(3, 2, head_dim)
    positions = torch.tensor([0, 5, 63])
    out = rotary_ref(x, positions, cos, sin)
    torch.testing.assert_close(out[0], x[0])  # position 0: identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # rotations keep length
    # Relative property: <R(m) q, R(n) k> depends on m - n only.
    q, k = torch.randn(1, 1, head_dim), torch.randn(1, 1, head_dim)

    def dot(m: int, n: int) -> torch.Tensor:
        rq = rotary_ref(q, torch.tensor([m]), cos, sin)
        rk = rotary_ref(k, torch.tensor([n]), cos, sin)
        return (rq * rk).sum()

    torch.testing.assert_close(dot(10, 4), dot(30, 24), atol=1e-4, rtol=1e-4)
