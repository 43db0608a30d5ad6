"""The piecewise forward (graph pieces around eager attention) equals the model's forward.

On the CPU the pieces run eagerly through the same static buffers, padding rows and cuts that
CUDA graphs replay on a GPU (test_gpu.py checks the captured graphs there), so these tests
pin down the cut itself: every layer's halves, the padding, the hand-off buffers, and that
the qkv projection writes into its buffer with no copy after it.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.models.layers import DecoderLayer
from engine.models.linears import input_linear
from engine.piecewise_graphs import PiecewiseGraphs, token_buckets
from engine.quant.linear import QuantizedLinear
from kernels.elementwise.norm import rms_norm_ref
from kernels.linear.quant import FORMATS
from tests.conftest import random_prompts
from tests.test_quant_kernels import DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
# Chunked prefill beside decodes: most steps are mixed, with token counts off the buckets.
SETTINGS = dict(device="cpu", pa_block_size=16, max_seqs=4, max_batched_tokens=64, prefill_chunk=40)


def test_token_buckets_cover_every_count_with_little_padding() -> None:
    buckets = token_buckets(8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == 16 and buckets[-1] == 8192
    assert all(size % 16 == 0 for size in buckets)
    for smaller, larger in itertools.pairwise(buckets):
        assert larger - smaller <= max(16, smaller // 8)  # at most ~12% padding above 128
    assert token_buckets(100)[-1] == 100 and token_buckets(8)[-1] == 8


def _with_piecewise(llm: LLM, max_tokens: int) -> list[int]:
    """Give ``llm``'s runner uncaptured piecewise graphs; returns the token counts it ran."""
    runner = llm.engine.runner
    piecewise = PiecewiseGraphs(runner.model, runner.kv_cache.layers, max_tokens, runner.device)
    seen: list[int] = []
    forward = piecewise.forward

    def counting_forward(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(input_ids.shape[0])
        return forward(input_ids, *args)  # type: ignore[arg-type]

    piecewise.forward = counting_forward  # type: ignore[method-assign]
    runner.piecewise = piecewise
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_piecewise_engine_gives_the_plain_engines_tokens(
    kind: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs[kind])
    prompts = random_prompts([45, 7, 30, 19], 320, seed=21)
    prompts.append([*prompts[0][:32], 9, 8])  # a prefix-cache hit: attention reads old pages
    plain = LLM(model, **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model, **SETTINGS)
    seen = _with_piecewise(llm, max_tokens=64)
    pieced = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in pieced] == [o.token_ids for o in plain]
    assert any(count not in token_buckets(64) for count in seen)  # padded steps ran
    assert any(count > 4 for count in seen)  # prefill chunks went through the pieces


def test_piecewise_hidden_states_equal_the_models(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dirs["qwen3"]), **SETTINGS)
    runner = llm.engine.runner
    seqs = llm.engine.scheduler
    for index, prompt in enumerate(random_prompts([20, 9], 320, seed=2)):
        llm.engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling=GREEDY)
    llm.engine._apply_inbox()
    batch = seqs.schedule(0.0)
    inputs = runner.prepare_inputs(batch)  # 29 tokens: a bucket of 32 with 3 padding rows
    expected = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta)
    piecewise = PiecewiseGraphs(runner.model, runner.kv_cache.layers, 64, runner.device)
    hidden = piecewise.forward(inputs.input_ids, inputs.positions, inputs.meta)
    assert hidden.shape == expected.shape == (29, runner.model.arch.hidden_size)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_a_step_over_the_largest_bucket_runs_eagerly(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    prompts = random_prompts([45, 30], 320, seed=5)
    plain = LLM(model, **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model, **SETTINGS)
    seen = _with_piecewise(llm, max_tokens=32)  # the 40-token chunks do not fit
    pieced = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in pieced] == [o.token_ids for o in plain]
    assert seen and max(seen) <= 32


class CopyRecorder(TorchDispatchMode):
    """Records the destination of every ``copy_`` run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.destinations: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.destinations.append(args[0])
        return func(*args, **(kwargs or {}))


def add_rms_norm_in_place(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference with the Triton kernel's contract: the sum lands in ``residual``."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps), residual


def test_a_piece_leaves_qkv_where_the_projection_wrote_it(tiny_model_dirs: dict[str, Path]) -> None:
    runner = LLM(str(tiny_model_dirs["qwen3"]), **SETTINGS).engine.runner
    piecewise = PiecewiseGraphs(runner.model, runner.kv_cache.layers, 64, runner.device)
    act, layers, bucket = piecewise.act, piecewise.layers, 32
    for view in (act.q, act.k, act.v):
        assert view.untyped_storage().data_ptr() == act.qkv.untyped_storage().data_ptr()
    act.input_ids[:bucket] = torch.randint(
        0, 320, (bucket,), generator=torch.Generator().manual_seed(3)
    )
    with torch.inference_mode():
        embeddings = runner.model.embed_tokens(act.input_ids[:bucket])
        q, k, v, _ = layers[0].pre_attention(embeddings, None)  # the eager layer's own
        with CopyRecorder() as piece_0:
            piecewise._run_piece(0, bucket)
    assert [dest.data_ptr() for dest in piece_0.destinations] == [act.residual.data_ptr()]
    for got, expected in ((act.q, q), (act.k, k), (act.v, v)):
        assert torch.equal(got[:bucket], expected)
    # piece 1: the torch ops' add + norm returns a new residual, copied in once; q, k, v never
    with torch.inference_mode(), CopyRecorder() as piece_1:
        piecewise._run_piece(1, bucket)
    assert [dest.data_ptr() for dest in piece_1.destinations] == [act.residual.data_ptr()]
    # with the fused kernel's contract (the residual buffer added into in place), no copy at all
    layer: DecoderLayer
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.ops = dataclasses.replace(norm.ops, fused_add_rms_norm=add_rms_norm_in_place)
    with torch.inference_mode(), CopyRecorder() as piece_1:
        piecewise._run_piece(1, bucket)
    assert piece_1.destinations == []


def _quantized(bias: bool) -> QuantizedLinear:
    linear = QuantizedLinear(64, 48, FORMATS["q8_0"], bias=bias)
    gen = torch.Generator().manual_seed(7)
    linear.load_rows(0, 48, torch.randn(48, 64, generator=gen))
    if linear.bias is not None:
        linear.bias.data = torch.randn(48, generator=gen)
    return linear.to(DEVICE)


def _in_place(got: torch.Tensor, block: torch.Tensor, expected: torch.Tensor) -> bool:
    """``got`` is ``block``'s rows 1..5, equal to ``expected``; rows 0 and 6 left zero."""
    return (
        got.data_ptr() == block[1].data_ptr()
        and torch.equal(got, expected)
        and not block[0].any()
        and not block[6].any()
    )


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_writes_its_product_into_the_given_rows(bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=bias).to(DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    block = torch.zeros(7, 48, device=DEVICE)  # out: rows 1..5, as a bucket's rows of qkv
    with torch.inference_mode(), CopyRecorder() as recorder:
        got = input_linear(x, linear, out=block[1:6])
    with torch.inference_mode():
        assert _in_place(got, block, linear(x))
    assert recorder.destinations == []  # mm (addmm with the bias) wrote the rows itself


@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_linear_writes_its_product_into_the_given_rows(bias: bool) -> None:
    linear = _quantized(bias)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    block = torch.zeros(7, 48, device=DEVICE)
    with torch.inference_mode():
        # on the CPU the reference, copied in once; on CUDA the kernels
        assert _in_place(input_linear(x, linear, out=block[1:6]), block, linear(x))
        block.zero_()  # the kernels' path (the interpreter on the CPU), the bias added in place
        got = linear.kernel_forward(x, out=block[1:6])
        assert _in_place(got, block, linear.kernel_forward(x))
