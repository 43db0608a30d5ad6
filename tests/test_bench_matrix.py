"""``bench matrix``: its workloads, its model plan and flags, the peer's arguments, and how a
peer process is followed and stopped (the whole run on the CPU: test_bench_matrix_run.py)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from bench.matrix import model_name, plan_groups
from bench.matrix_workloads import WORKLOAD_NAMES, parse_workload_names, select_workloads
from bench.peer_process import PeerError, run_peer_module
from bench.vllm_peer import _parser as vllm_child_parser
from bench.vllm_peer import matrix_peer_args
from bench.workloads import BenchPrompt, make_random_prompts, warmup_prompts
from engine.config import EngineConfig
from engine.errors import ConfigError
from tests.test_cli import SMALL_POOL, run_cli

VOCAB = 1000


def _prompts(name: str) -> list[BenchPrompt]:
    (workload,) = select_workloads((name,))
    assert workload.throughput is not None
    return make_random_prompts(workload.throughput, VOCAB)


@pytest.mark.parametrize("num_prompts", [64, 256, 1024])
def test_the_standard_workloads_draw_in_and_out_from_100_to_1024(num_prompts: int) -> None:
    prompts = _prompts(f"standard-{num_prompts}")
    assert len(prompts) == num_prompts
    assert all(100 <= len(p.token_ids) <= 1024 and 100 <= p.output_len <= 1024 for p in prompts)
    assert len({len(p.token_ids) for p in prompts}) > num_prompts // 8  # drawn, not fixed


@pytest.mark.parametrize(
    ("name", "num_prompts", "input_len", "output_len"),
    [
        ("prefill-heavy", 256, 4096, 128),
        ("decode-heavy", 1024, 128, 1024),
        ("long-context", 32, 32768, 256),
    ],
)
def test_the_fixed_length_workloads(
    name: str, num_prompts: int, input_len: int, output_len: int
) -> None:
    prompts = _prompts(name)
    assert len(prompts) == num_prompts
    assert {len(p.token_ids) for p in prompts} == {input_len}
    assert {p.output_len for p in prompts} == {output_len}


def test_long_context_warms_up_on_a_few_prompts_only() -> None:
    (workload,) = select_workloads(("long-context",))
    assert workload.throughput is not None and workload.longest_request_len == 32768 + 256
    warm = warmup_prompts(_prompts("long-context"), workload.throughput.num_warmup_prompts)
    assert len(warm) == 4


def test_the_shared_prefix_is_one_2048_token_run_before_each_own_128() -> None:
    prompts = _prompts("shared-prefix")
    assert len(prompts) == 256 and {p.output_len for p in prompts} == {256}
    assert {len(p.token_ids) for p in prompts} == {2048 + 128}
    assert len({tuple(p.token_ids[:2048]) for p in prompts}) == 1  # really shared
    assert len({tuple(p.token_ids[2048:]) for p in prompts}) == 256  # each its own
    # its own tokens are those the same workload draws without a prefix
    (workload,) = select_workloads(("shared-prefix",))
    assert workload.throughput is not None
    plain = workload.throughput.__class__(256, (128, 128), (256, 256))
    assert [p.token_ids[2048:] for p in prompts] == [
        p.token_ids for p in make_random_prompts(plain, VOCAB)
    ]
    # the warm-up cannot put the prefix in the cache for the timed run
    assert all(w.token_ids[:2048] != prompts[0].token_ids[:2048] for w in warmup_prompts(prompts))


def test_shared_prefixes_are_four_system_prompts_of_64_prompts_each() -> None:
    """The extra row for cascade decode over several prefixes a step: not one of ``all``."""
    assert "shared-prefixes" not in WORKLOAD_NAMES
    assert parse_workload_names("shared-prefixes,shared-prefix") == (
        "shared-prefix", "shared-prefixes",
    )  # fmt: skip
    prompts = _prompts("shared-prefixes")
    assert len(prompts) == 256 and {len(p.token_ids) for p in prompts} == {2048 + 128}
    heads = [tuple(p.token_ids[:2048]) for p in prompts]
    assert len(set(heads)) == 4 and all(heads[i] == heads[i % 4] for i in range(256))
    # the first system prompt is the one-prefix row's, the prompts' own tokens too
    single = _prompts("shared-prefix")
    assert heads[0] == tuple(single[0].token_ids[:2048])
    assert [p.token_ids[2048:] for p in prompts] == [p.token_ids[2048:] for p in single]
    (tiny,) = select_workloads(("shared-prefixes",), scale=0.01)  # 3 prompts: 3 prefixes
    assert tiny.throughput is not None and tiny.throughput.num_shared_prefixes == 3


def test_tpot_rows_are_one_latency_batch_of_128_in_and_out() -> None:
    b1, b64 = select_workloads(("tpot-b1", "tpot-b64"))
    assert b1.latency is not None and b64.latency is not None
    assert (b1.latency.batch_sizes, b64.latency.batch_sizes) == ((1,), (64,))
    assert (b64.latency.input_len, b64.latency.output_len) == (128, 128)
    assert (b1.metric, b1.throughput) == ("tpot_s", None)


def test_scale_shrinks_counts_and_lengths_but_keeps_them_valid() -> None:
    shared, long_context, b64 = select_workloads(
        ("shared-prefix", "long-context", "tpot-b64"), seed=7, scale=0.01
    )
    assert shared.throughput is not None and long_context.throughput is not None
    assert (shared.throughput.num_prompts, shared.throughput.shared_prefix_len) == (3, 20)
    assert shared.throughput.input_len == (1, 1) and shared.throughput.seed == 7
    assert long_context.throughput.input_len == (328, 328)
    assert b64.latency is not None and b64.latency.output_len == 2  # TPOT needs 2 tokens
    with pytest.raises(ConfigError, match="scale"):
        select_workloads(("tpot-b1",), scale=1.5)


def test_workload_names_come_back_in_the_matrixs_order() -> None:
    assert parse_workload_names("all") == WORKLOAD_NAMES
    assert parse_workload_names("tpot-b1, standard-64") == ("standard-64", "tpot-b1")
    with pytest.raises(ConfigError, match=r"unknown workload.*standard-65"):
        parse_workload_names("standard-65")


def test_a_workload_longer_than_the_context_moves_to_the_long_context_sibling() -> None:
    workloads = select_workloads(WORKLOAD_NAMES)
    models = [model_name("qwen3-0.6b"), model_name("llama3-8b")]
    groups = plan_groups(models, workloads, EngineConfig())
    assert [(g.label, g.model, len(g.workloads)) for g in groups] == [
        ("qwen3-0.6b", "dummy:qwen3-0.6b", 9),  # 40960 tokens hold 32768 + 256
        ("llama3-8b", "dummy:llama3-8b", 8),
        ("llama3-8b", "dummy:llama3.1-8b", 1),
    ]
    assert groups[2].workloads[0].name == "long-context"
    with pytest.raises(ConfigError, match=r"long-context needs 33024 tokens.*smollm2-135m"):
        plan_groups(["dummy:smollm2-135m"], workloads, EngineConfig())
    with pytest.raises(ConfigError, match="prefill-heavy needs 4224 tokens"):
        plan_groups(models[:1], workloads, EngineConfig(max_model_len=4096))


def test_the_vllm_child_builds_the_same_workloads_from_its_flags() -> None:
    workloads = select_workloads(("shared-prefix", "tpot-b64"), seed=3, scale=0.5)
    config = EngineConfig(model="dummy:qwen3-0.6b", max_seqs=128, seed=3)
    flags = matrix_peer_args(config, workloads, 0.5, profile_every=4)
    assert flags == [
        "--model", "dummy:qwen3-0.6b", "--max-seqs", "128",
        "--workloads", "shared-prefix,tpot-b64", "--scale", "0.5", "--seed", "3",
        "--profile-every", "4",
    ]  # fmt: skip
    child = vllm_child_parser().parse_args(["matrix", *flags, "--out", "x.json"])
    assert select_workloads(child.workloads, seed=child.seed, scale=child.scale) == workloads
    assert child.profile_every == 4  # the child samples its steps as the engine does


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workloads", "standard-2"], "unknown workload(s) standard-2"),
        (["--scale", "2"], "expected a number in (0, 1]"),
        (["--compare", "sglang"], "invalid choice: 'sglang'"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["bench", "matrix", "--models", "tiny", *flags], capsys)
    assert code == 2 and message in err


def test_the_default_models_are_the_dummy_shapes_named() -> None:
    # argparse applies --models' type to a string default only: a bare default shape reached
    # --compare vllm unconverted, which refused it
    from commands import build_parser

    args = build_parser().parse_args(["bench", "matrix"])
    named = build_parser().parse_args(["bench", "matrix", "--models", "qwen3-0.6b,llama3-8b"])
    assert args.models == named.models == ("dummy:qwen3-0.6b", "dummy:llama3-8b")


def test_model_is_refused_in_favour_of_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["bench", "matrix", "--model", "dummy:tiny", *SMALL_POOL], capsys)
    assert code == 1 and "leave --model out" in err


PEER = textwrap.dedent(
    """
    import argparse, json, os, sys, time
    from bench.peer_process import write_json_atomically
    from pathlib import Path
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    record = {"pid": os.getpid(), "results": [{"n": 1}]}
    write_json_atomically(Path(args.out), record)
    if args.fail:
        sys.exit(3)
    time.sleep(60)
    """
)


def test_a_peer_is_followed_and_stopped_when_the_parent_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow_peer.py").write_text(PEER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    seen: list[dict[str, object]] = []

    def stop_after_first(record: dict[str, object]) -> None:
        seen.append(record)
        raise KeyboardInterrupt  # what SIGTERM becomes in bench matrix

    with pytest.raises(KeyboardInterrupt):
        run_peer_module("slow_peer", [], name="slow", on_record=stop_after_first)
    (record,) = seen
    assert record["results"] == [{"n": 1}]
    with pytest.raises(ProcessLookupError):  # terminated and reaped, not left holding a GPU
        os.kill(int(record["pid"]), 0)  # type: ignore[call-overload]
    with pytest.raises(PeerError, match="the slow peer failed \\(exit code 3\\)"):
        run_peer_module("slow_peer", ["--fail"], name="slow")


def test_the_table_names_triton_builds_inside_a_rows_timed_run() -> None:
    """A row whose engine side built Triton kernels on the clock says so under the table,
    with the count, the seconds and the slowest kernels; a row that built none says nothing."""
    from bench.matrix_record import format_matrix

    builds = {"count": 3, "seconds": 1.5, "kernels": [
        {"name": "kernels.attention.gather_rows_triton._gather_rows_kernel", "count": 2,
         "seconds": 1.2},
        {"name": "kernels.attention.merge_states_triton._merge_states_kernel", "count": 1,
         "seconds": 0.3},
    ]}  # fmt: skip
    row = {"model": "qwen3-0.6b", "metric": "output_tok_s", "ratio": 0.9, "meets_target": False,
           "pagestream_tok_s": 450.0, "vllm_tok_s": 500.0}  # fmt: skip
    record = {"peer": "vllm", "results": [
        {**row, "workload": "long-context", "pagestream": {"jit_compiles": builds}},
        {**row, "workload": "standard-256",
         "pagestream": {"jit_compiles": {"count": 0, "seconds": 0, "kernels": []}}},
    ]}  # fmt: skip
    lines = format_matrix(record).splitlines()
    notes = [line for line in lines if "Triton builds" in line]
    assert notes == [
        "qwen3-0.6b long-context: 3 Triton builds in the timed run, 1.50 s "
        "(_gather_rows_kernel, _merge_states_kernel)"
    ]
