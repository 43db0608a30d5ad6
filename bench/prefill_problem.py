"""One prefill attention problem for bench.prefill_attention: its shape, random paged inputs,
the reference output, a check, the engine's SDPA path over it, and the flash SDPA time of the
same problem laid out contiguously."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch

from kernels.attention.prefill_sdpa import fused_attend, prefill_sdpa
from kernels.attention.prefill_tuning import PrefillConfig, table_key

DTYPE = torch.bfloat16
REF_QUERY_CHUNK = 512  # queries per reference call: its [Hq, 512, L] fp32 scores fit easily
# What a config's output may differ from the reference by (bf16 outputs; the GPU test's)
MAX_RELATIVE_ERROR = 1e-2
ATOL = RTOL = 3e-2
TIMED_MS = 25  # per timing, replayed 10 times: about 0.3 s of GPU per (shape, config)


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    """``num_seqs`` sequences, each ``query_len`` new tokens over ``context_len`` cached."""

    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int
    query_len: int
    context_len: int

    @property
    def name(self) -> str:
        return (
            f"{self.model}/page{self.block_size}/"
            f"{self.num_seqs}x{self.query_len}@{self.context_len}"
        )

    @property
    def table_key(self) -> str:
        group = self.num_heads // self.num_kv_heads
        return table_key(self.head_dim, group, DTYPE, DTYPE, self.block_size)

    @property
    def flops(self) -> int:
        """Causal FLOPs: 2 D for q.k and 2 D for p.v per query head and visible key; query
        ``i`` sees ``context_len + i + 1`` keys."""
        q, c = self.query_len, self.context_len
        visible_pairs = q * c + q * (q + 1) // 2
        return 4 * self.head_dim * self.num_heads * self.num_seqs * visible_pairs


@dataclasses.dataclass
class PrefillProblem:
    """Random q and a random pool over shuffled pages, in ``paged_attention``'s layout."""

    shape: PrefillShape
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, pages per sequence] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    out: torch.Tensor  # [T, Hq, D]
    first_sdpa_call_ms: float | None = None  # set by check_sdpa_path

    @classmethod
    def build(cls, shape: PrefillShape, device: torch.device, seed: int = 0) -> PrefillProblem:
        torch.manual_seed(seed)
        seq_len = shape.context_len + shape.query_len
        pages_per_seq = -(-seq_len // shape.block_size)
        num_blocks = shape.num_seqs * pages_per_seq
        pool_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        k_cache = torch.randn(pool_shape, dtype=DTYPE, device=device)
        v_cache = torch.randn(pool_shape, dtype=DTYPE, device=device)
        pages = torch.randperm(num_blocks, device=device).to(torch.int32)
        num_tokens = shape.num_seqs * shape.query_len
        q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, dtype=DTYPE, device=device)
        return cls(
            shape, q, k_cache, v_cache,
            block_tables=pages.view(shape.num_seqs, pages_per_seq),
            seq_lens=torch.full((shape.num_seqs,), seq_len, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(
                0, num_tokens + 1, shape.query_len, dtype=torch.int32, device=device
            ),
            out=torch.empty_like(q),
        )  # fmt: skip

    @property
    def scale(self) -> float:
        return float(self.shape.head_dim**-0.5)

    def run(self, config: PrefillConfig) -> torch.Tensor:
        from kernels.attention.paged_attention_triton import paged_attention

        return paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, scale=self.scale, max_query_len=self.shape.query_len,
            out=self.out, prefill_config=config,
        )  # fmt: skip

    def run_sdpa_path(self) -> torch.Tensor:
        """The engine's ``PAGESTREAM_PREFILL_ATTN=sdpa`` path: each sequence's context copied
        out of its pages, attended by cuDNN (two parts merged where there is context)."""
        from kernels.attention.merge_states_triton import merge_states

        shape = self.shape
        seq_len = shape.context_len + shape.query_len
        prefill_sdpa(
            self.q, self.k_cache, self.v_cache, self.block_tables, [seq_len] * shape.num_seqs,
            list(range(0, shape.num_seqs * shape.query_len + 1, shape.query_len)),
            seqs=range(shape.num_seqs), scale=self.scale, out=self.out, attend=fused_attend,
            merge=merge_states,
        )  # fmt: skip
        return self.out

    def check_sdpa_path(self) -> str | None:
        """None if the SDPA path runs and matches the reference, else why not. Its first call
        is timed (``first_sdpa_call_ms``): on a new shape cuDNN builds its graphs there."""
        expected = self.expected  # computed before the clock starts
        try:
            start_s = time.perf_counter()
            out = self.run_sdpa_path()
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            self.first_sdpa_call_ms = (time.perf_counter() - start_s) * 1e3
        except Exception as error:  # no cuDNN attention on this card, say: record it
            return f"{type(error).__name__}: {str(error)[:300]}"
        return mismatch(out, expected)

    def check(self, config: PrefillConfig) -> str | None:
        """None if ``config`` runs and matches the reference, else why not."""
        try:
            out = self.run(config)
        except Exception as error:  # e.g. OutOfResources: record it, go on
            return f"{type(error).__name__}: {str(error)[:300]}"
        return mismatch(out, self.expected)

    @functools.cached_property
    def expected(self) -> torch.Tensor:
        """``paged_attention_ref`` in runs of REF_QUERY_CHUNK queries: queries ``a:e`` of a
        sequence are those of a sequence of ``context_len + e`` tokens with ``e - a`` new."""
        from kernels.attention.paged_attention import paged_attention_ref

        shape, expected = self.shape, torch.empty_like(self.q)
        for b in range(shape.num_seqs):
            start = b * shape.query_len
            for a in range(0, shape.query_len, REF_QUERY_CHUNK):
                e = min(shape.query_len, a + REF_QUERY_CHUNK)
                expected[start + a : start + e] = paged_attention_ref(
                    self.q[start + a : start + e], self.k_cache, self.v_cache,
                    self.block_tables[b : b + 1], [shape.context_len + e], [0, e - a],
                    self.scale,
                )  # fmt: skip
        return expected


def mismatch(out: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None if ``out`` is within bf16 tolerance of ``expected``, else by how much it is not."""
    diff = (out.float() - expected.float()).abs()
    relative = (diff.norm() / expected.float().norm()).item()
    excess = (diff - (ATOL + RTOL * expected.float().abs())).max().item()
    if relative <= MAX_RELATIVE_ERROR and excess <= 0:
        return None
    return f"off the reference: relative error {relative:.2e}, max abs error {diff.max():.2e}"


def sdpa_flash_ms(problem: PrefillProblem) -> tuple[float | None, str | None]:
    """(median ms, None) of torch's flash SDPA on the problem laid out contiguously (K/V
    expanded to Hq heads, causal aligned to the last query), or (None, why not)."""
    if problem.q.device.type != "cuda":
        return None, "flash SDPA needs CUDA"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    shape = problem.shape
    batch, q_len, seq_len = shape.num_seqs, shape.query_len, shape.context_len + shape.query_len
    group = shape.num_heads // shape.num_kv_heads
    q = problem.q.view(batch, q_len, shape.num_heads, shape.head_dim).transpose(1, 2)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hq, L, D]
        rows = cache[problem.block_tables.long()].flatten(1, 2)[:, :seq_len]
        return rows.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()

    q, k, v = q.contiguous(), contiguous(problem.k_cache), contiguous(problem.v_cache)
    mask = causal_lower_right(q_len, seq_len) if seq_len != q_len else None

    def attend() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=problem.scale
        )

    # the reference first, outside the flash-only context: its own SDPA calls are 3-D, which
    # no fused kernel takes (computed inside it, every problem came back "No available kernel")
    expected = problem.expected
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = attend().transpose(1, 2).reshape(problem.q.shape)
            error = mismatch(out, expected)
            return (None, f"flash SDPA {error}") if error else (time_ms(attend, q.device), None)
    except RuntimeError as error:  # no flash kernel for this problem or card
        return None, f"flash SDPA: {str(error)[:300]}"


def time_ms(fn: Callable[[], object], device: torch.device, *, eager: bool = False) -> float:
    """Median milliseconds of ``fn``, replayed from a CUDA graph (no launch or host cost in
    the time: the smallest shapes take a few hundred microseconds), or with ``eager`` called
    as the engine calls it (launches and host work in the time); on the CPU, one run."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if eager:
        return float(triton.testing.do_bench(fn, rep=TIMED_MS, return_mode="median"))
    return float(triton.testing.do_bench_cudagraph(fn, rep=TIMED_MS, return_mode="median"))
