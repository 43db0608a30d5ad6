"""``pagestream bench latency | speculative | kernels | kv-quality | quant | plot``: latency
against the hardware limit, speculative decoding's speedup, kernel bandwidth, fp8 KV quality,
quantized weights against float, and plots
of any record. ``worker/bench_cli.py``
registers them beside ``throughput`` and ``serve``."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC
from pathlib import Path
from typing import Any

from bench.records import check_output_json, save
from commands.parser import CommandError
from worker.arg_types import int_list, positive_int

# -- latency ---------------------------------------------------------------------------------


def configure_latency(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--batch-sizes",
        type=int_list,
        default=(1, 8, 32, 64),
        metavar="N,N,...",
        help="batch sizes to run (default 1,8,32,64)",
    )
    w.add_argument("--input-len", type=positive_int, default=128, help="default 128")
    w.add_argument("--output-len", type=positive_int, default=128, help="default 128")
    w.add_argument(
        "--compare",
        choices=["hf", "vllm"],
        help="hf: also time transformers' generate (static batch, sdpa) at each batch size; "
        "vllm: vLLM's offline API in a subprocess (when importable), before the engine loads",
    )
    finish_engine_bench(parser, w, _run_bench_latency)


def finish_engine_bench(
    parser: argparse.ArgumentParser,
    workload: argparse._ArgumentGroup,
    handler: Any,
) -> None:
    """The tail every engine benchmark's parser shares: its record path, the progress switch,
    the engine flags and the handler."""
    from engine.config_flags import add_engine_args

    workload.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    workload.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)
    parser.set_defaults(handler=handler, command_prog=parser.prog)


def _run_bench_latency(args: argparse.Namespace) -> int:
    from bench.latency import LatencyWorkload, add_hf_peer, run_latency
    from bench.vllm_peer import PeerError, add_vllm_latency, latency_peer_args, run_vllm_peer
    from engine import LLMEngine, PagestreamError
    from engine.config_flags import engine_config_from_args
    from engine.memory import release_device_memory

    check_output_json(args.output_json)
    try:
        workload = LatencyWorkload(args.batch_sizes, args.input_len, args.output_len, args.seed)
        config = engine_config_from_args(args)
        vllm = None
        if args.compare == "vllm":  # first, on an empty GPU, in its own process
            vllm = run_vllm_peer("latency", latency_peer_args(config, workload))
        engine = LLMEngine(config)
        copy_bw = _copy_bandwidth(engine.device) if engine.device.type == "cuda" else None
        record = run_latency(
            engine, workload, copy_bytes_per_s=copy_bw, use_tqdm=not args.no_progress
        )
        engine.shutdown()
        del engine  # one model in memory at a time
        if args.compare == "hf":
            release_device_memory()
            add_hf_peer(record, args.model, workload)
        if vllm is not None:
            add_vllm_latency(record, vllm)
    except (PagestreamError, PeerError) as exc:
        raise CommandError(str(exc)) from exc
    print(_latency_table(record["results"]))
    save(record, args.output_json)
    return 0


def _copy_bandwidth(device: Any) -> float:
    from bench.kernels import measure_copy_bandwidth

    return measure_copy_bandwidth(device)


def _latency_table(results: list[dict[str, Any]]) -> str:
    lines = ["batch  TTFT ms  TPOT ms  tok/s  limit ms  of limit  vLLM TPOT ms (ours/theirs)"]
    for r in results:
        limit = (
            f"{r['limit_tpot_s'] * 1e3:8.2f}  {r['fraction_of_limit']:7.0%}"
            if "limit_tpot_s" in r
            else ""
        )
        vllm = (
            f"  {r['vllm']['tpot_s'] * 1e3:7.2f} ({r['vllm']['tpot_ratio']:.2f})"
            if "vllm" in r
            else ""
        )
        lines.append(
            f"{r['batch']:5d}  {r['mean_ttft_s'] * 1e3:7.1f}  {r['mean_tpot_s'] * 1e3:7.2f}  "
            f"{r['output_tok_s']:5.0f}  {limit}{vllm}"
        )
    return "\n".join(lines)


# -- speculative decoding --------------------------------------------------------------------


def configure_speculative(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--batch-sizes",
        type=int_list,
        default=(1, 8),
        metavar="N,N,...",
        help="batch sizes to run (default 1,8)",
    )
    w.add_argument(
        "--output-len", type=positive_int, default=256, help="most tokens a request makes"
    )
    w.add_argument(
        "--compare",
        choices=["vllm"],
        help="vllm: also run vLLM's offline API (subprocesses, before the engine loads) on the "
        "same prompts, without and with its own prompt lookup or draft model",
    )
    finish_engine_bench(parser, w, _run_bench_speculative)


def _run_bench_speculative(args: argparse.Namespace) -> int:
    from bench.speculative import (
        SpeculativeWorkload,
        format_results,
        format_vllm_results,
        run_speculative,
    )
    from bench.vllm_peer import (
        PeerError,
        add_vllm_speculative,
        check_vllm_importable,
        run_vllm_peer,
        speculative_peer_args,
    )
    from engine import PagestreamError
    from engine.config_flags import engine_config_from_args

    check_output_json(args.output_json)
    try:
        workload = SpeculativeWorkload(args.batch_sizes, args.output_len, args.seed)
        # --num-speculative-tokens alone means prompt lookup here
        lookup = args.speculative == "off" and args.speculative_model is None
        config = engine_config_from_args(args, speculative="ngram" if lookup else args.speculative)
        peers = None
        if args.compare == "vllm":  # first, on an empty GPU, each run in its own process
            check_vllm_importable()
            plain_args, spec_args = speculative_peer_args(config, workload)
            peers = (
                run_vllm_peer("speculative", plain_args),
                run_vllm_peer("speculative", spec_args),
            )
        record = run_speculative(config, workload, use_tqdm=not args.no_progress)
        if peers is not None:
            add_vllm_speculative(record, *peers)
    except (PagestreamError, PeerError) as exc:
        raise CommandError(str(exc)) from exc
    print(format_results(record["results"]))
    if peers is not None:
        print(format_vllm_results(record["results"]))
    save(record, args.output_json)
    return 0


# -- kernels ---------------------------------------------------------------------------------


def configure_kernels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int_list, default=(1, 8, 64, 256), metavar="N,...")
    parser.add_argument(
        "--context-lens", type=int_list, default=(512, 1024, 4096, 16384), metavar="N,..."
    )
    parser.add_argument("--block-sizes", type=int_list, default=(16, 32, 64), metavar="N,...")
    parser.add_argument("--num-q-heads", type=positive_int, default=32)
    parser.add_argument("--num-kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--cache-type", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    parser.set_defaults(handler=_run_bench_kernels, command_prog=parser.prog)


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from datetime import datetime

    import torch

    from bench.kernels import bench_paged_attention, measure_copy_bandwidth
    from bench.records import machine_info

    if not torch.cuda.is_available():
        raise CommandError("the kernel benchmark needs a CUDA device")
    check_output_json(args.output_json)
    device = torch.device("cuda")
    cache_dtype = torch.float8_e4m3fn if args.cache_type == "fp8_e4m3" else None
    points = bench_paged_attention(
        args.batch_sizes, args.context_lens, args.block_sizes, num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=cache_dtype,
    )  # fmt: skip
    record = {
        "kind": "kernels",
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("handler",)},
            "model": "paged-attention",
        },
        "copy_bytes_per_s": measure_copy_bandwidth(device),
        "results": points,
    }
    for point in points:
        print(
            f"batch {point['batch']:4d} context {point['context']:6d} block {point['block_size']:3d}: "
            f"{point['time_us']:9.1f} us  {point['fraction_of_copy']:6.1%} of copy bandwidth"
        )
    save(record, args.output_json)
    return 0


# -- kv-quality ------------------------------------------------------------------------------


def configure_kv_quality(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="default smollm2-135m")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"]
    )
    parser.add_argument("--num-prompts", type=positive_int, default=8, help="default 8")
    parser.add_argument(
        "--input-len", type=positive_int, default=128, help="random prompts only (default 128)"
    )
    parser.add_argument("--output-len", type=positive_int, default=64, help="default 64")
    parser.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    parser.set_defaults(handler=_run_bench_kv_quality, command_prog=parser.prog)


def _run_bench_kv_quality(args: argparse.Namespace) -> int:
    from bench.kv_quality import measure_kv_quality
    from engine import PagestreamError

    check_output_json(args.output_json)
    try:
        record = measure_kv_quality(
            args.model, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, device=args.device, dtype=args.dtype,
            max_model_len=2048 if args.model.startswith("dummy:") else None,
        )  # fmt: skip
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    for name, value in record["results"].items():
        print(f"{name:32s} {value:.4g}")
    save(record, args.output_json)
    return 0


# -- quant -----------------------------------------------------------------------------------


def configure_quant(parser: argparse.ArgumentParser) -> None:
    from bench.quant import add_quant_args

    add_quant_args(parser)
    parser.set_defaults(handler=_run_bench_quant, command_prog=parser.prog)


def _run_bench_quant(args: argparse.Namespace) -> int:
    from bench.quant import run_from_args
    from engine import PagestreamError

    check_output_json(args.output_json)
    try:
        record = run_from_args(args)
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    save(record, args.output_json)
    return 0


# -- plot ------------------------------------------------------------------------------------


def configure_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+", metavar="RECORD.json")
    parser.set_defaults(handler=_run_bench_plot, command_prog=parser.prog)


def _run_bench_plot(args: argparse.Namespace) -> int:
    import json

    from bench.plots import plot_record
    from engine.errors import ConfigError

    for name in args.records:
        path = Path(name)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read benchmark record {name}: {exc}") from exc
        if not isinstance(record, dict):
            raise CommandError(f"{name}: not a benchmark record (a JSON object with a kind)")
        try:
            png = plot_record(record, path.with_suffix(".png"), required=True)
        except ConfigError as exc:  # no matplotlib, or a kind that has no plot
            raise CommandError(f"{name}: {exc}") from exc
        except (KeyError, IndexError, TypeError) as exc:  # a field the plot reads is missing
            raise CommandError(f"{name}: {_incomplete(record, exc)}") from exc
        print(f"wrote {png}", file=sys.stderr)
    return 0


def _incomplete(record: dict[str, Any], exc: Exception) -> str:
    """What a record of a kind with a plot lacks (a file cut short, or edited by hand)."""
    kind = record.get("kind") or record.get("benchmark")
    if isinstance(exc, KeyError):
        return f"a {kind} record without {exc.args[0]!r}, which its plot needs"
    return f"a malformed {kind} record: {exc}"
