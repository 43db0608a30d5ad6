"""Tensor parallelism on two GPUs (NCCL; skipped with fewer): the tokens of one GPU, CUDA
graphs with the all-reduces captured inside them, and the process of a two-GPU engine ends
however it ends (shutdown, end of script, Ctrl-C, a rank killed): NCCL's teardown waited on
ranks that were gone or stuck, forever (issue 28)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.ranks import exit_with_parent
from tests.conftest import random_prompts
from tests.test_tensor_parallel_exit import (
    ExitRun,
    assert_ended_in_order,
    assert_stopped_cleanly,
    run_exit_script,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
PROMPTS = random_prompts([5, 37, 70, 16, 101], 320, seed=3)
DEAD_RANK_EXIT_BOUND_S = 30.0  # the error, rank 0's bounded teardown and CUDA's own exit
# A small engine: the default 256 rows and 8,192-token steps capture some 20 decode graphs and
# more piecewise ones on each rank, a minute of every test spent capturing (2x H200)
SMALL = dict(max_seqs=8, max_batched_tokens=512)


def _tokens(model: str, **settings: object) -> tuple[list[list[int]], bool]:
    """Greedy tokens of ``PROMPTS``, and whether decode steps replayed CUDA graphs."""
    tokens, graphed, _ = _tokens_and_sums(model, **settings)
    return tokens, graphed


def _tokens_and_sums(model: str, **settings: object) -> tuple[list[list[int]], bool, str]:
    """``_tokens``, and which path summed the decode steps' all-reduces: ``nccl``, the peer
    method, and ``+norm`` where the sums before a norm were fused with it (a peer path
    that failed to set up falls back to NCCL with a warning: the tests must see it).

    A two-GPU engine runs in a new process of its own: peer buffers are mapped once per
    process (``peer_allreduce.agree_to_map``), and each test is to get them."""
    if settings.get("tensor_parallel_size", 1) == 1:
        return _run_tokens_and_sums(model, **settings)
    spawn = multiprocessing.get_context("spawn")  # the environment as the test set it
    # a killed pytest must not leave the engine (and its ranks) holding the GPUs (two H100s)
    with ProcessPoolExecutor(
        1, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(),)
    ) as fresh:
        return fresh.submit(_run_tokens_and_sums, model, **settings).result(timeout=300)


def _run_tokens_and_sums(model: str, **settings: object) -> tuple[list[list[int]], bool, str]:
    with LLM(model, device="cuda", **SMALL, **settings) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        sums = llm.engine.runner.group.sums
        return [out.token_ids for out in outputs], llm.engine.runner.uses_cuda_graphs, sums


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: its one KV head on both ranks
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_two_gpus_fp32_give_the_tokens_of_one(
    kind: str, cuda_graphs: bool, tiny_model_dirs: dict[str, Path]
) -> None:
    model = str(tiny_model_dirs[kind])
    settings = dict(dtype="float32", pa_block_size=16, pa_context_len=160, max_model_len=160)
    expected, _ = _tokens(model, **settings)
    sharded, graphed, sums = _tokens_and_sums(
        model, tensor_parallel_size=2, cuda_graphs=cuda_graphs, **settings
    )
    assert sharded == expected
    assert graphed == cuda_graphs
    assert sums == "auto+norm"


@pytest.mark.parametrize("path", ["nccl", "one-shot", "two-shot"])
def test_each_all_reduce_path_gives_the_tokens_of_one_gpu(
    path: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside the decode graphs and outside them (prefill), whichever path sums."""
    monkeypatch.setenv("PAGESTREAM_TP_ALLREDUCE", path)  # rank 0 and, inherited, rank 1
    model = str(tiny_model_dirs["llama"])
    settings = dict(dtype="float32", pa_block_size=16, pa_context_len=160, max_model_len=160)
    expected, _ = _tokens(model, **settings)
    sums = {"nccl": "nccl", "one-shot": "one-shot+norm", "two-shot": "two-shot"}[path]
    assert _tokens_and_sums(model, tensor_parallel_size=2, **settings) == (expected, True, sums)


@pytest.mark.parametrize(
    ("dtype", "fused"), [("float32", "1"), ("bfloat16", "1"), ("bfloat16", "0")]
)
def test_sums_fused_with_the_norm_give_the_unfused_tokens(
    fused: str, dtype: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """o_proj's and down's sums in one kernel with the residual add and RMSNorm after them
    (``auto`` fuses every decode-size sum at two ranks), in the decode graphs and the
    piecewise ones, or turned off (``fused`` 0). fp32: TP1's tokens; bf16: those of TP2 on
    NCCL, since the fused path rounds where the unfused one does."""
    monkeypatch.setenv("PAGESTREAM_TP_FUSED_NORM", fused)
    model = str(tiny_model_dirs["llama"])
    settings = dict(dtype=dtype, pa_block_size=16, pa_context_len=160, max_model_len=160)
    if dtype == "float32":
        expected, _ = _tokens(model, **settings)
    else:
        monkeypatch.setenv("PAGESTREAM_TP_ALLREDUCE", "nccl")
        expected, _ = _tokens(model, tensor_parallel_size=2, **settings)
        monkeypatch.setenv("PAGESTREAM_TP_ALLREDUCE", "auto")
    sums = "auto+norm" if fused == "1" else "auto"
    assert _tokens_and_sums(model, tensor_parallel_size=2, **settings) == (expected, True, sums)


def test_peer_sums_equal_the_fp32_sum_at_every_size() -> None:
    """The bench's own check: bf16 sums of random inputs, every path, small to 4 MiB."""
    from bench.allreduce import METHODS, run

    sizes = [8, 4096, 4096 * 3 + 8, 8192 * 64, 2**21]
    record = run(2, sizes=sizes)
    assert {(row["bytes"] // 2, row["method"]) for row in record["results"]} == {
        (n, m) for n in sizes for m in METHODS
    }
    # two bf16 values ~N(0, 1): one rounding of their sum, <= 2^-8 of |sum| < 16
    assert max(row["max_abs_err"] for row in record["results"]) <= 0.0625


def test_swapped_pages_come_back_on_both_ranks(tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    settings = dict(
        dtype="float32", pa_block_size=16, pa_context_len=160, max_model_len=160, preemption="swap"
    )
    assert _tokens(model, tensor_parallel_size=2, **settings)[0] == _tokens(model, **settings)[0]


def _exit_run(scenario: str, model_dir: Path, ctrl_c_after: str | None = None) -> ExitRun:
    args = ("--model", str(model_dir), "--device", "cuda")
    return run_exit_script(scenario, *args, ctrl_c_after=ctrl_c_after)


def test_shutdown_ends_the_process(tiny_model_dirs: dict[str, Path]) -> None:
    run = _exit_run("shutdown", tiny_model_dirs["llama"])
    assert run.returncode == 0, run.output[-4000:]
    assert_stopped_cleanly(run)


def test_the_end_of_the_script_ends_the_process(tiny_model_dirs: dict[str, Path]) -> None:
    """The hang of issue 28: the finalizer's teardown at exit, without shutdown()."""
    run = _exit_run("fall-off", tiny_model_dirs["llama"])
    assert run.returncode == 0, run.output[-4000:]
    assert_stopped_cleanly(run)


@pytest.mark.parametrize(
    ("scenario", "ctrl_c_after"), [("interrupt-step", None), ("wait-for-ctrl-c", "decoding")]
)
def test_ctrl_c_mid_generation_ends_the_process(
    scenario: str, ctrl_c_after: str | None, tiny_model_dirs: dict[str, Path]
) -> None:
    run = _exit_run(scenario, tiny_model_dirs["llama"], ctrl_c_after)
    # Killed by its own SIGINT, as Python ends on an unhandled KeyboardInterrupt; on two H200s
    # (torch 2.11, NCCL) the interpreter exited with status 1 instead, after the same
    # traceback and the same ordered teardown: the status is not what this test is about.
    assert run.returncode in (-signal.SIGINT, 1), run.output[-4000:]
    assert "KeyboardInterrupt" in run.output
    assert_ended_in_order(run, "(0|-9)", after="decoding")


def test_a_dead_rank_is_an_error_and_the_process_ends(tiny_model_dirs: dict[str, Path]) -> None:
    """NCCL waits for a dead peer inside the step: rank 0 aborts the step's communicators
    and raises (exit code 1), before the fallback exit (STUCK_EXIT_CODE), within seconds."""
    run = _exit_run("kill-rank", tiny_model_dirs["llama"])
    assert run.returncode == 1, run.output[-4000:]
    (pid,) = run.rank_pids
    assert re.search(
        rf"EngineDeadError: tensor-parallel rank 1 \(pid {pid}\) exited with code -9", run.output
    ), run.output[-4000:]
    assert run.seconds_to_exit_after("decoding") < DEAD_RANK_EXIT_BOUND_S, run.output[-4000:]
    assert_ended_in_order(run, "-9", after="decoding")
