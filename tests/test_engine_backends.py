"""The engine on its Triton kernels equals the engine on the torch references.

Without CUDA the Triton kernels run under Triton's interpreter on the CPU (conftest sets
``TRITON_INTERPRET=1``), so these run in CI on a tiny model: mixed steps of prefill chunks and
decodes, prefix-cache hits, a sliding window and q/k norms all go through the kernels.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backend import ATTN_BACKEND_ENV, get_attention_backend
from tests.conftest import random_prompts

# With CUDA present the interpreter is off and the kernels want GPU tensors: test_gpu.py
# checks the same parity on the GPU there.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")

GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
LONGER = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
# Small pages and budgets: prompts are split into chunks and steps mix chunks with decodes.
SETTINGS = dict(
    pa_block_size=16, max_seqs=4, max_batched_tokens=48, prefill_chunk=32, max_model_len=128
)


def generate(
    model: str, backend: str, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> list[list[int]]:
    monkeypatch.setenv(ATTN_BACKEND_ENV, backend)
    llm = LLM(model, device="cpu", **{**SETTINGS, **settings})
    assert get_attention_backend(torch.device("cpu")).name == backend
    # Two prompts share a 40-token prefix: the second reads pages the first wrote.
    prompts = random_prompts([40, 7, 53, 23], 320, seed=11)
    prompts.append([*prompts[0][:40], 5, 6, 7])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [out.token_ids for out in outs]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_triton_engine_equals_torch_engine(
    kind: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(tiny_model_dirs[kind])
    assert generate(model, "triton", monkeypatch) == generate(model, "torch", monkeypatch)


def test_fp8_cache_triton_equals_torch_and_stays_close_to_full_precision(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(tiny_model_dirs["llama"])
    fp8_triton = generate(model, "triton", monkeypatch, pa_cache_type="fp8_e4m3")
    fp8_torch = generate(model, "torch", monkeypatch, pa_cache_type="fp8_e4m3")
    assert fp8_triton == fp8_torch
    full = generate(model, "torch", monkeypatch)
    agree = sum(
        a == b for x, y in zip(fp8_torch, full, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert agree / sum(len(x) for x in full) >= 0.8


def test_fp8_pool_holds_about_twice_the_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    full = LLM(model, device="cpu", pa_memory_mb=4, dtype="bfloat16").engine.kv_cache
    fp8 = LLM(model, device="cpu", pa_memory_mb=4, dtype="bfloat16", pa_cache_type="fp8_e4m3")
    cache = fp8.engine.kv_cache
    assert cache.pages.dtype == torch.float8_e4m3fn and cache.scales is not None
    head_dim = cache.spec.head_dim
    # 1 byte per value plus a 4-byte scale per head, against 2 bytes per value
    expected = 2 * head_dim / (head_dim + 4)
    assert cache.num_blocks / full.num_blocks == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("choice", ["sdpa", "sdpa-exact"])
def test_long_chunks_through_sdpa_equal_the_torch_engine(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    """``PAGESTREAM_PREFILL_ATTN=sdpa``: a step's long chunks are attended over their
    gathered context (plain torch here, cuDNN on CUDA), its decodes and short chunks by the
    Triton kernels; tokens equal the torch engine's, and the path ran beside both."""
    from engine.attention import backend
    from kernels.attention import paged_attention_triton, prefill_sdpa

    beside: list[tuple[bool, bool]] = []  # (decodes, short chunks) beside the long ones
    real = prefill_sdpa.prefill_sdpa
    real_triton = paged_attention_triton.paged_attention
    ranges: list[tuple[int, int | None]] = []

    def whole_tensors(*args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # the step's own tensors, never slices: an int32 slice at an odd sequence is another
        # alignment, another compiled kernel (paged_attention's docstring)
        assert all(arg.storage_offset() == 0 for arg in args[3:6])
        ranges.append((kwargs.get("first_seq", 0), kwargs.get("end_seq")))
        return real_triton(*args, **kwargs)

    def counted(*args: Any, **kwargs: Any) -> None:
        starts, seqs = args[5], list(kwargs["seqs"])
        lens = [end - start for start, end in itertools.pairwise(starts)]
        others = [n for seq, n in enumerate(lens) if seq not in seqs]
        beside.append((1 in others, any(n > 1 for n in others)))
        real(*args, **kwargs)

    monkeypatch.setattr(prefill_sdpa, "prefill_sdpa", counted)
    monkeypatch.setattr(paged_attention_triton, "paged_attention", whole_tensors)
    monkeypatch.setattr(backend, "SDPA_MIN_QUERY_LEN", 8)  # the chunks here are 7-32 tokens
    monkeypatch.setattr(backend, "SDPA_MIN_SEQ_LEN", 8)
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, choice)
    model = str(tiny_model_dirs["qwen3"])
    assert generate(model, "triton", monkeypatch) == generate(model, "torch", monkeypatch)
    # steps with decodes, and with short chunks (to the Triton kernel), beside the long ones
    assert any(decodes for decodes, _ in beside) and any(short for _, short in beside)
    assert any(first > 0 for first, _ in ranges)  # a run after a long chunk, by its range


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cascade_decode_equals_the_torch_engine(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``--cascade-attention on``: decodes over a shared prompt prefix attend it together
    (thresholds lowered to this model's sizes), those of a second shared prompt over theirs in
    the same calls; tokens equal the torch engine's, and steps did cascade. Mistral's sliding
    window attends its prefix plainly, with the same tokens."""
    from engine.attention import backend
    from kernels.attention import paged_attention_triton

    real = paged_attention_triton.paged_attention
    shares_seen: list[tuple[int, int, int]] = []  # (least, most) of a call's shares, groups

    def noted(*args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        shares = kwargs.get("prefix_lens")
        if shares is not None:
            groups = kwargs["prefix_pages"].shape[0]
            shares_seen.append((int(shares.min()), int(shares.max()), groups))
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention_triton, "paged_attention", noted)
    monkeypatch.setattr(backend, "CASCADE_MIN_DECODES", 3)
    monkeypatch.setattr(backend, "CASCADE_MIN_PREFIX_TOKENS", 32)
    shared, other = random_prompts([48, 32], 320, seed=5)  # three pages of 16, and two
    tails = random_prompts([3, 9, 20], 320, seed=6)
    # and a prompt of its own, which runs beside them and shares nothing
    prompts = [shared + tail for tail in tails] + random_prompts([40], 320, seed=7)
    prompts += [other + tail for tail in tails]
    model = str(tiny_model_dirs[kind])
    outs = {}
    for name in ("triton", "torch"):
        monkeypatch.setenv(ATTN_BACKEND_ENV, name)
        # room for all seven at once, decoding long enough for both groups to meet
        llm = LLM(model, device="cpu", cascade_attention=True, **{**SETTINGS, "max_seqs": 8})
        outs[name] = [o.token_ids for o in llm.generate(prompts, LONGER, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
    if kind == "llama":  # the whole shared prompts, beside the unshared prompt's decode
        assert (0, 48, 2) in shares_seen
    else:
        assert not shares_seen  # every layer of the tiny mistral has a window


def test_a_step_s_shared_prefix_is_the_pages_most_decodes_begin_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.attention import backend
    from engine.host_inputs import padded_tables

    monkeypatch.setattr(backend, "CASCADE_MIN_DECODES", 3)
    monkeypatch.setattr(backend, "CASCADE_MIN_PREFIX_TOKENS", 32)

    def shared(
        tables: list[list[int]], seq_lens: list[int], num_decodes: int
    ) -> tuple[list[int], list[backend.PrefixGroup]] | None:
        lens = [len(t) for t in tables]
        padded = padded_tables(tables, lens)
        return backend.find_shared_prefixes(padded, lens, seq_lens, num_decodes, 16)

    first3 = [(0, [0, 1, 2])]  # (the row whose pages are the prefix, the group's decodes)
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 9, 3, 4], [5, 6]]
    assert shared(tables, [60, 60, 70, 20], 3) == ([48, 48, 48], first3)  # prefill aside
    assert shared(tables, [60, 60, 70, 20], 4) == ([48, 48, 48, 0], first3)  # another prompt
    assert shared(tables, [60, 60, 70, 20], 2) is None  # too few decodes
    assert shared(tables, [60, 48, 70, 20], 3) == ([48, 32, 48], first3)  # page 9 holds its token
    parted = [[7, 8, 1], [7, 8, 2], [7, 9, 3], [7, 8, 4]]  # the third parts after one page
    assert shared(parted, [40] * 4, 4) == ([32, 32, 0, 32], [(0, [0, 1, 3])])  # 16 tokens: none
    assert shared(parted, [40] * 4, 3) is None  # two decodes share enough
    same = [[7, 8, 9], [7, 8, 9], [7, 8, 9]]  # samples of one prompt, nothing of their own yet
    assert shared(same, [40, 40, 40], 3) == ([32, 32, 32], first3)  # the last page: their tokens
    most = [[5, 6, 1], [7, 8, 2], [7, 8, 3], [7, 8, 4]]  # the most common first page leads
    assert shared(most, [40] * 4, 4) == ([0, 32, 32, 32], [(1, [1, 2, 3])])
    # two prompts of three decodes each, and one of its own: two groups, the larger first
    two = [[5, 6, 1], [7, 8, 2], [5, 6, 3], [7, 8, 3], [7, 8, 4], [5, 6, 9], [7, 8, 9], [3, 1]]
    both = ([32, 32, 32, 32, 32, 32, 32, 0], [(1, [1, 3, 4, 6]), (0, [0, 2, 5])])
    assert shared(two, [40] * 8, 8) == both
    monkeypatch.setattr(backend, "CASCADE_MAX_GROUPS", 1)
    assert shared(two, [40] * 8, 8) == ([0, 32, 0, 32, 32, 0, 32, 0], both[1][:1])
    assert padded_tables(tables, [4, 4, 5, 2]).shape == (4, 8)  # rows 16-byte aligned


def test_a_cascade_goes_to_the_device_in_one_array_of_aligned_parts() -> None:
    """``packed_int32``: each part back whole from its slice, each starting 16 bytes aligned
    (a kernel handed a misaligned view compiles another variant)."""
    import numpy as np

    from engine.host_inputs import packed_int32

    parts = [np.arange(5), np.arange(3) + 10, np.array([7]), np.arange(8).reshape(2, 4) + 20]
    packed, slices = packed_int32(parts)
    assert packed.dtype == np.int32 and [where.start for where in slices] == [0, 8, 12, 16]
    for part, where in zip(parts, slices, strict=True):
        assert packed[where].tolist() == part.ravel().tolist()


def test_an_unknown_prefill_attention_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.attention import backend

    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "flash")
    with pytest.raises(ValueError, match="PAGESTREAM_PREFILL_ATTN='flash'"):
        backend.prefill_attention_choice()


def test_a_refused_fused_kernel_falls_back_to_triton_for_good(
    tiny_model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """cuDNN refusing a chunk (a shape or card it does not take) is a warning, not a failed
    step: that layer and every later chunk go to the Triton kernel, tokens unchanged."""
    from engine.attention import backend
    from kernels.attention import prefill_sdpa

    refusals: list[int] = []

    def refuse(q: torch.Tensor, *args: object) -> None:
        refusals.append(q.shape[2])
        raise RuntimeError("cuDNN Frontend error: no valid engine configs for this graph")

    monkeypatch.setattr(prefill_sdpa, "fused_attend", refuse)
    monkeypatch.setattr(backend, "SDPA_MIN_QUERY_LEN", 8)
    monkeypatch.setattr(backend, "SDPA_MIN_SEQ_LEN", 8)
    monkeypatch.setenv(backend.PREFILL_ATTN_ENV, "sdpa")
    model = str(tiny_model_dirs["llama"])
    with caplog.at_level("WARNING", logger="engine.attention.backend"):
        assert generate(model, "triton", monkeypatch) == generate(model, "torch", monkeypatch)
    assert len(refusals) == 1  # once: the path is off after it
    assert "the Triton kernel attends every prefill chunk from now on" in caplog.text
    assert "PAGESTREAM_PREFILL_ATTN=sdpa: the fused kernel refused" in caplog.text
