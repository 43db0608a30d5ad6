"""``PAGESTREAM_GEMV_FOLDS``: a decoder layer's residual add and RMSNorm in the prologue of the
GEMV after them (qkv, a dense MLP's gate_up, a MoE router), a router's top-k in its GEMV's
epilogue, through the engine.

The GEMV takes decode rows on a GPU only; here its table says "the GEMV" for every linear at
one row and the kernel runs in Triton's interpreter, so the engine's own path (the layer
leaving its norm to the linear, the new residual the GEMV writes) runs on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from engine import LLM, SamplingParams
from engine.attention.backend import ATTN_BACKEND_ENV
from engine.models import linears
from kernels.linear.gemv_triton import GemvConfig
from tests.conftest import gemv_on_one_tile

PROMPT = [17, 42, 99, 3, 250, 7]
SAMPLING = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=2)
DECODE_STEPS = 3  # every token but the first (the prefill's rows take no GEMV)


@pytest.fixture
def gemv_everywhere(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str]]:
    """Every plain linear at one row on one GEMV tile, fp32 and off the GPU too; per GEMV
    call, the folds it carried."""
    monkeypatch.setattr(
        linears,
        "takes_gemv",
        lambda x, linear: x.shape[0] <= 1 and isinstance(linear, nn.Linear) and linear.bias is None,
    )
    return gemv_on_one_tile(monkeypatch, GemvConfig(block_n=64, block_k=64, num_warps=1))


def run(monkeypatch: pytest.MonkeyPatch, folds: str, model: str) -> Any:
    monkeypatch.setenv(linears.GEMV_FOLDS_ENV, folds)
    llm = LLM(model, dtype="float32", max_seqs=1, cuda_graphs=False)
    return llm.generate([PROMPT], SAMPLING, use_tqdm=False)[0]


# norms folded a decode step, both of each layer's: into qkv (the first layer's with no
# residual to add), a dense MLP's gate_up, a MoE block's router (which keeps the normed rows
# for the experts)
@pytest.mark.parametrize(("model", "folds_per_step"), [("dummy:tiny", 4), ("dummy:tiny-moe", 4)])
def test_norms_folded_into_the_gemv_give_the_same_tokens_and_logprobs(
    monkeypatch: pytest.MonkeyPatch,
    gemv_everywhere: list[frozenset[str]],
    model: str,
    folds_per_step: int,
) -> None:
    """One sequence, greedy: the same tokens and logprobs as with every norm a kernel."""
    plain = run(monkeypatch, "", model)
    assert gemv_everywhere and not any(gemv_everywhere)
    gemv_everywhere.clear()
    folded = run(monkeypatch, "norm", model)
    assert_same(folded, plain)
    # the decode steps: every token but the first (the prefill's rows take no GEMV)
    assert sum("norm" in c for c in gemv_everywhere) == folds_per_step * DECODE_STEPS
    assert not any("route" in c for c in gemv_everywhere)


@pytest.mark.parametrize("folds", ["topk", "norm,topk"])
def test_a_router_s_top_k_in_its_gemv_gives_the_same_tokens_and_logprobs(
    monkeypatch: pytest.MonkeyPatch, gemv_everywhere: list[frozenset[str]], folds: str
) -> None:
    """The Triton backend (interpreted): the MoE layer's router routes in its GEMV's
    epilogue at the decode steps, ``route_topk`` runs at the prefill only; alone and with the
    norms folded too."""
    from kernels.moe import fused_moe_triton

    monkeypatch.setenv(ATTN_BACKEND_ENV, "triton")
    routed: list[int] = []
    real = fused_moe_triton.route_topk

    def counted(*args: Any, **kwargs: Any) -> Any:
        routed.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_moe_triton, "route_topk", counted)
    plain = run(monkeypatch, "", "dummy:tiny-moe")
    assert len(routed) == 1 + DECODE_STEPS  # one MoE layer
    routed.clear()
    gemv_everywhere.clear()
    folded = run(monkeypatch, folds, "dummy:tiny-moe")
    assert_same(folded, plain)
    assert routed == [len(PROMPT)]  # the prefill's; the decodes routed in the router's GEMV
    assert sum("route" in c for c in gemv_everywhere) == DECODE_STEPS


def assert_same(folded: Any, plain: Any) -> None:
    assert folded.token_ids == plain.token_ids
    for a, b in zip(folded.logprobs, plain.logprobs, strict=True):
        assert a is not None and b is not None
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_an_unknown_fold_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import ConfigError

    monkeypatch.setenv(linears.GEMV_FOLDS_ENV, "norm,nrom")
    with pytest.raises(ConfigError, match="PAGESTREAM_GEMV_FOLDS: unknown nrom"):
        LLM("dummy:tiny", max_seqs=1)
