"""The engine on a CUDA device (skipped without one): same greedy tokens as on the CPU."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backend import ATTN_BACKEND_ENV
from engine.config import CUDA_GRAPHS_ENV
from engine.errors import ConfigError
from engine.memory import MIB
from tests.conftest import random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_cuda_fp32_matches_cpu(
    kind: str, preemption: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model_dir = str(tiny_model_dirs[kind])
    prompts = random_prompts([5, 37, 70, 16, 101], 320, seed=3)
    settings = dict(pa_block_size=16, pa_context_len=160, max_model_len=160, preemption=preemption)
    cpu = LLM(model_dir, device="cpu", **settings).generate(prompts, GREEDY, use_tqdm=False)
    gpu_llm = LLM(model_dir, device="cuda", dtype="float32", **settings)
    gpu = gpu_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.scheduler.num_preemptions > 0


def test_cuda_bf16_dummy_model_runs_and_frees_every_page() -> None:
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=2048, pa_memory_mb=512)
    prompts = random_prompts([100, 300, 700], 151936, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [32, 32, 32]
    assert llm.engine.block_manager.num_used_blocks == 0


def _dummy_tokens(
    monkeypatch: pytest.MonkeyPatch, backend: str, **settings: object
) -> list[list[int]]:
    monkeypatch.setenv(ATTN_BACKEND_ENV, backend)
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=2048, pa_memory_mb=2048, **settings)
    prompts = random_prompts([100, 300, 700, 5, 64, 1500], 151936, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_triton_backend_equals_torch_backend_on_a_dummy_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fp32 compute: bf16 rounding differences between two correct kernels could flip a
    # near-tie argmax of a random model; in fp32 they cannot.
    triton = _dummy_tokens(monkeypatch, "triton", dtype="float32", cuda_graphs=False)
    torch_ref = _dummy_tokens(monkeypatch, "torch", dtype="float32")
    assert triton == torch_ref


def test_cuda_graphs_on_and_off_give_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32: a padded graph batch may pick another split-KV count than the eager one, and in
    # bf16 that reduction order alone can flip a near-tie argmax of a random model.
    graphs = _dummy_tokens(monkeypatch, "triton", cuda_graphs=True, max_seqs=16, dtype="float32")
    eager = _dummy_tokens(monkeypatch, "triton", cuda_graphs=False, max_seqs=16, dtype="float32")
    assert graphs == eager


def test_graphs_are_captured_and_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=1024, pa_memory_mb=512, max_seqs=24)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8, 16, 24]
    replays = 0
    original = graphs.replay

    def counting_replay(*args: object) -> object:
        nonlocal replays
        replays += 1
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(graphs, "replay", counting_replay)
    llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert replays == 7  # every step after the prefill


def test_cascade_decode_gives_the_plain_decode_s_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 requests, 16 over each of two 1,024-token shared prompts, with
    ``--cascade-attention on``: the decode steps replay the cascade graphs (each prefix
    attended together by its group, the shares and tiles read on the device) and give the
    tokens of the plain decode (fp32: no near-tie flips from a different summation order)."""
    from engine.cuda_graphs import DecodeGraphs

    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    real = DecodeGraphs.replay
    replayed: list[tuple[int, int]] = []  # (the longest share, the groups) of each replay

    def noted(self: DecodeGraphs, *args: Any) -> torch.Tensor:
        shared = args[-1].shared_prefix
        if shared is not None:
            replayed.append((int(shared.lens.max()), shared.pages.shape[0]))
        return real(self, *args)

    monkeypatch.setattr(DecodeGraphs, "replay", noted)
    shared = random_prompts([1024, 1024], 151936, seed=8)
    tails = random_prompts([3 + 5 * i for i in range(32)], 151936, seed=9)
    prompts = [shared[i % 2] + tail for i, tail in enumerate(tails)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = []
    for cascade in (True, False):
        llm = LLM(
            "dummy:qwen3-0.6b", device="cuda", dtype="float32", max_model_len=2048,
            pa_memory_mb=2048, cascade_attention=cascade,  # all 32 at once: 229 KB a token
        )  # fmt: skip
        graphs = llm.engine.runner.graphs
        assert graphs is not None and bool(graphs.cascade_graphs) == cascade
        tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if cascade:
            assert (1024, 2) in replayed  # decode steps of the 32 replayed a cascade graph
        del llm
    assert tokens[0] == tokens[1]


def test_decode_graphs_switch_to_the_split_variant_past_a_short_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small batches capture an unsplit graph for contexts up to UNSPLIT_MAX_CONTEXT and a
    split one beyond; a request growing across the bound gives the eager tokens."""
    from kernels.attention.paged_attention_triton import UNSPLIT_MAX_CONTEXT

    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    settings = dict(device="cuda", dtype="float32", max_model_len=2048, pa_memory_mb=512)
    prompt = random_prompts([UNSPLIT_MAX_CONTEXT - 20], 151936, seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = []
    for graphs_on in (True, False):
        llm = LLM("dummy:qwen3-0.6b", cuda_graphs=graphs_on, **settings)
        tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].token_ids)
        if graphs_on:
            graphs = llm.engine.runner.graphs
            assert graphs is not None
            assert [bound for bound, _ in graphs.graphs[1]] == [UNSPLIT_MAX_CONTEXT, 2048]
        del llm
    assert tokens[0] == tokens[1]


MIXED = dict(max_seqs=16, max_batched_tokens=512, prefill_chunk=256, dtype="float32")


def test_piecewise_graphs_give_the_eager_steps_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 256 beside decodes: most steps are mixed and replay the piecewise graphs.
    pieced = _dummy_tokens(monkeypatch, "triton", cuda_graphs=True, **MIXED)
    eager_mixed = _dummy_tokens(
        monkeypatch, "triton", cuda_graphs=True, cuda_graph_max_tokens=0, **MIXED
    )
    assert pieced == eager_mixed


def test_mixed_steps_replay_piecewise_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=1024, pa_memory_mb=512, **MIXED)
    piecewise = llm.engine.runner.piecewise
    assert piecewise is not None and piecewise.buckets[-1] == 512
    assert set(piecewise.graphs) == set(piecewise.buckets)
    assert all(len(graphs) == 29 for graphs in piecewise.graphs.values())  # 28 layers + 1
    counts: list[int] = []
    original = piecewise.forward

    def counting_forward(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        counts.append(input_ids.shape[0])
        return original(input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(piecewise, "forward", counting_forward)
    prompts = random_prompts([300, 40, 700], 151936, seed=8)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(counts) >= 3 and max(counts) <= 512  # every step with a prefill chunk


def test_async_scheduling_gives_the_synchronous_tokens() -> None:
    prompts = random_prompts([100, 300, 700, 5, 64, 1500], 151936, seed=9)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=33, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    outs = {}
    for mode in (True, False):
        llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=2048, pa_memory_mb=2048,
                  async_scheduling=mode, **MIXED)  # fmt: skip
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.block_manager.num_used_blocks == 0
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [40, 33, 7, 48, 25, 12]


def test_cuda_graphs_env_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    llm = LLM("dummy:tiny", device="cuda", pa_memory_mb=64)
    assert not llm.engine.runner.uses_cuda_graphs


def test_fraction_plan_leaves_room_for_the_profiled_peak() -> None:
    # The plan counts what this process already holds: an engine of an earlier test that the
    # garbage collector has not freed yet (its pool took 0.9 of the card) left 0 pages here.
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=4096, pa_memory_fraction=0.5)
    engine = llm.engine
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    assert total_bytes - free_bytes <= 0.5 * total_bytes + 256 * MIB  # within the fraction
    prompts = random_prompts([4000] * 2, 151936, seed=6)  # a full-budget step fits
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert engine.kv_cache.num_blocks > 0


def test_memory_budget_over_the_device_is_an_error_at_start() -> None:
    with pytest.raises(ConfigError, match=r"KV pool of .* GiB .* does not fit"):
        LLM("dummy:qwen3-0.6b", device="cuda", pa_memory_mb=10_000_000, max_seqs=4096)


def test_a_step_too_large_for_the_device_is_an_error_at_start() -> None:
    # 200k sampled rows of 152k float32 logits: far more than any GPU holds
    with pytest.raises(ConfigError, match=r"largest step .* does not fit"):
        LLM("dummy:qwen3-0.6b", device="cuda", max_seqs=200_000, max_batched_tokens=200_000,
            max_model_len=4096)  # fmt: skip


@pytest.mark.parametrize("num_kv_splits", [None, 32])
def test_split_decode_at_a_128k_context_matches_the_reference(num_kv_splits: int | None) -> None:
    from kernels.attention.paged_attention import paged_attention_ref
    from kernels.attention.paged_attention_triton import paged_attention

    context, block_size = 131072, 32
    gen = torch.Generator("cuda").manual_seed(0)
    shape = (context // block_size, block_size, 8, 128)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(shape[0], device="cuda", generator=gen).to(torch.int32)[None, :]
    seq_lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    starts = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    out = paged_attention(
        q, k_cache, v_cache, table, seq_lens, starts, scale=128**-0.5, max_query_len=1,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, k_cache, v_cache, table, [context], [0, 1], 128**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_rows", [1, 4, 8])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_at_llama3_8b_sizes_matches_torch(num_rows: int, silu_mul: bool) -> None:
    from kernels.elementwise.activation import silu_and_mul_ref
    from kernels.linear.gemv_triton import gemv

    gen = torch.Generator("cuda").manual_seed(num_rows)
    size_k = 14336 if silu_mul else 4096
    x = torch.randn(num_rows, 2 * size_k if silu_mul else size_k, device="cuda",
                    dtype=torch.bfloat16, generator=gen)  # fmt: skip
    weight = 0.02 * torch.randn(6144, size_k, device="cuda", dtype=torch.bfloat16, generator=gen)
    expected = (silu_and_mul_ref(x) if silu_mul else x).float() @ weight.float().T
    got = gemv(x, weight, silu_mul=silu_mul).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_the_gemv_lm_head_gives_cublas_logits_at_batch_one() -> None:
    model = LLM("dummy:qwen3-0.6b", device="cuda", max_model_len=512).engine.runner.model
    gen = torch.Generator("cuda").manual_seed(5)
    hidden = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    expected = hidden.float() @ model.lm_head.weight.float().T
    out = torch.empty(1, expected.shape[1], device="cuda", dtype=torch.bfloat16)
    for logits in (model.compute_logits(hidden), model.compute_logits(hidden, out=out)):
        scale = expected.abs().max().item()
        torch.testing.assert_close(logits.float(), expected, rtol=2e-2, atol=2e-2 * scale)
    assert out.abs().sum() > 0


def test_the_cudnn_prefill_path_gives_the_triton_kernels_logprobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PAGESTREAM_PREFILL_ATTN=sdpa`` (and ``sdpa-exact``) in bf16, cuDNN's dtype: chunks of
    1,024 over contexts of 0-2k (prompts of 3,000, 1,500 and 700 tokens, and one sharing the
    first's 2,048-token prefix from the cache), beside decodes, with piecewise graphs. The first
    token's five best logprobs agree with the Triton kernel's as values, sorted (a near-tie
    of a random model may order two tokens either way in bf16), and the path ran."""
    from engine.attention import backend
    from engine.attention.backend import PREFILL_ATTN_ENV
    from kernels.attention import prefill_sdpa

    monkeypatch.setattr(backend, "SDPA_MIN_SEQ_LEN", 1024)  # the path for every long chunk here
    prompts = random_prompts([3000, 1500, 700], 151936, seed=12)
    prompts.append([*prompts[0][:2048], *random_prompts([600], 151936, seed=13)[0]])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    settings = dict(max_model_len=4096, pa_memory_mb=2048, prefill_chunk=1024,
                    max_batched_tokens=1024, max_seqs=8)  # fmt: skip
    calls: list[int] = []
    real = prefill_sdpa.prefill_sdpa

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill_sdpa, "prefill_sdpa", counted)
    tops: dict[str, list[list[float]]] = {}
    for choice in ("triton", "sdpa", "sdpa-exact"):
        monkeypatch.setenv(PREFILL_ATTN_ENV, choice)
        llm = LLM("dummy:qwen3-0.6b", device="cuda", **settings)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tops[choice] = [
            sorted((lp for _, lp in out.logprobs[0].top), reverse=True)  # type: ignore[union-attr]
            for out in outs
        ]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert calls, "no chunk took the path"
    for choice in ("sdpa", "sdpa-exact"):
        for expected, got in zip(tops["triton"], tops[choice], strict=True):
            assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 0.1, (
                choice, expected, got,
            )  # fmt: skip
