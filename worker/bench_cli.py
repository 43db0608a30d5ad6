"""``pagestream bench``: one sub-subcommand per benchmark, each writing a JSON record."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from worker.cli import CommandError, LazyParser, Subparsers
from worker.cli_types import int_range, positive_int


def register(subparsers: Subparsers) -> None:
    subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, latency, kernels, serve; plot a record",
        description="Benchmarks of the engine; each writes a JSON record of its results.",
        configure=_configure_bench,
    )


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(
        title="benchmarks", dest="benchmark", metavar="BENCHMARK", parser_class=LazyParser
    )
    kinds.required = True
    kinds.add_parser(
        "throughput",
        help="offline throughput on random token-id prompts (no Redis)",
        description="Run random token-id prompts through the engine at once; report "
        "tokens/s and TTFT, and write a JSON record.",
        configure=_configure_bench_throughput,
    )
    kinds.add_parser(
        "latency",
        help="time to first token and per output token at batch 1..N, against the hardware limit",
        description="Run batches of equal random prompts; report TTFT, time per output token "
        "and the fraction of the weight+KV streaming limit reached (CUDA: copy bandwidth is "
        "measured in the same run).",
        configure=_configure_bench_latency,
    )
    kinds.add_parser(
        "kernels",
        help="paged-attention kernel bandwidth against measured copy bandwidth (CUDA)",
        description="Time the Triton paged-attention decode kernel across batch sizes, context "
        "lengths and block sizes; report achieved bandwidth as a fraction of copy bandwidth.",
        configure=_configure_bench_kernels,
    )
    kinds.add_parser(
        "kv-quality",
        help="quality of an fp8 KV cache against the model-dtype cache (greedy and logits)",
        description="Greedy agreement and teacher-forced logit error of --pa-cache-type "
        "fp8_e4m3 against the default cache, on the same weights and prompts.",
        configure=_configure_bench_kv_quality,
    )
    kinds.add_parser(
        "serve",
        help="N concurrent streams through Redis against workers; ratio to the offline engine",
        description="Stream random token-id prompts through Redis from --concurrency clients; "
        "report tokens/s, TTFT and time per output token percentiles, and the ratio to the "
        "offline engine on the same prompts. Starts its own Redis and worker unless --redis-url.",
        configure=_configure_bench_serve,
    )
    kinds.add_parser(
        "plot",
        help="draw the PNG plot of a benchmark JSON record",
        description="Draw a PNG beside each given benchmark record (needs matplotlib).",
        configure=_configure_bench_plot,
    )


def _configure_bench_serve(parser: argparse.ArgumentParser) -> None:
    from worker.bench_serve import configure

    configure(parser)


def _configure_bench_throughput(parser: argparse.ArgumentParser) -> None:
    from engine.config import add_engine_args

    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=positive_int, default=256, help="default 256")
    w.add_argument(
        "--input-len",
        type=int_range,
        default=(100, 1024),
        metavar="MIN-MAX",
        help="prompt lengths in tokens, drawn uniformly from MIN..MAX (default 100-1024)",
    )
    w.add_argument(
        "--output-len",
        type=int_range,
        default=(100, 1024),
        metavar="MIN-MAX",
        help="output lengths in tokens, drawn uniformly; EOS is ignored (default 100-1024)",
    )
    w.add_argument(
        "--output-json",
        metavar="PATH",
        help="where to write the JSON record "
        "(default bench/results/throughput-<model>-<device>-<UTC time>.json)",
    )
    w.add_argument(
        "--compare",
        type=_baselines,
        default=(),
        metavar="hf,paged-off",
        help="also run these baselines on the same prompts in this process: hf (transformers "
        "continuous batching, generate_batch) and/or paged-off (this engine, --paged-attn off)",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)  # its --seed also seeds the random prompts
    parser.set_defaults(handler=_run_bench_throughput, command_prog=parser.prog)


def _baselines(text: str) -> tuple[str, ...]:
    from engine.benchmark_compare import BASELINES

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(BASELINES)}, got {text!r}"
        )
    return names


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from engine import PagestreamError
    from engine.benchmark import ThroughputWorkload, format_results
    from engine.benchmark_compare import run_with_baselines
    from engine.config import engine_config_from_args

    try:
        workload = ThroughputWorkload(args.num_prompts, args.input_len, args.output_len, args.seed)
        config = engine_config_from_args(args)
        record = run_with_baselines(config, workload, args.compare, use_tqdm=not args.no_progress)
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    print(format_results(record["results"]))
    for name, baseline in record["baselines"].items():
        print(f"{name}: {baseline['output_tok_s']:.1f} output tok/s (x{baseline['ratio']:.2f})")
    _save(record, args.output_json)
    return 0


def _save(record: dict[str, Any], output_json: str | None) -> None:
    """Write the JSON record (and its plot when matplotlib is there); say where."""
    from engine.bench_plots import plot_record
    from engine.benchmark import default_record_path, write_record

    path = Path(output_json) if output_json else default_record_path(record)
    write_record(record, path)
    print(f"wrote {path}", file=sys.stderr)
    png = plot_record(record, path.with_suffix(".png"))
    if png is not None:
        print(f"wrote {png}", file=sys.stderr)


# -- latency ---------------------------------------------------------------------------------


def _configure_bench_latency(parser: argparse.ArgumentParser) -> None:
    from engine.config import add_engine_args

    w = parser.add_argument_group("workload")
    w.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=(1, 8, 32, 64),
        metavar="N,N,...",
        help="batch sizes to run (default 1,8,32,64)",
    )
    w.add_argument("--input-len", type=positive_int, default=128, help="default 128")
    w.add_argument("--output-len", type=positive_int, default=128, help="default 128")
    w.add_argument(
        "--compare",
        choices=["hf"],
        help="hf: also time transformers' generate (static batch, sdpa) at each batch size",
    )
    w.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)
    parser.set_defaults(handler=_run_bench_latency, command_prog=parser.prog)


def _run_bench_latency(args: argparse.Namespace) -> int:
    import torch

    from engine import LLMEngine, PagestreamError
    from engine.benchmark_latency import LatencyWorkload, add_hf_peer, run_latency
    from engine.config import engine_config_from_args

    try:
        workload = LatencyWorkload(args.batch_sizes, args.input_len, args.output_len, args.seed)
        engine = LLMEngine(engine_config_from_args(args))
        copy_bw = _copy_bandwidth(engine.device) if engine.device.type == "cuda" else None
        record = run_latency(
            engine, workload, copy_bytes_per_s=copy_bw, use_tqdm=not args.no_progress
        )
        del engine  # one model in memory at a time
        if args.compare == "hf":
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            add_hf_peer(record, args.model, workload)
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    print(_latency_table(record["results"]))
    _save(record, args.output_json)
    return 0


def _copy_bandwidth(device: Any) -> float:
    from kernels.benchmark import measure_copy_bandwidth

    return measure_copy_bandwidth(device)


def _latency_table(results: list[dict[str, Any]]) -> str:
    lines = ["batch  TTFT ms  TPOT ms  tok/s  limit ms  of limit"]
    for r in results:
        limit = (
            f"{r['limit_tpot_s'] * 1e3:8.2f}  {r['fraction_of_limit']:7.0%}"
            if "limit_tpot_s" in r
            else ""
        )
        lines.append(
            f"{r['batch']:5d}  {r['mean_ttft_s'] * 1e3:7.1f}  {r['mean_tpot_s'] * 1e3:7.2f}  "
            f"{r['output_tok_s']:5.0f}  {limit}"
        )
    return "\n".join(lines)


# -- kernels ---------------------------------------------------------------------------------


def _configure_bench_kernels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=_int_list, default=(1, 8, 64, 256), metavar="N,...")
    parser.add_argument(
        "--context-lens", type=_int_list, default=(512, 1024, 4096, 16384), metavar="N,..."
    )
    parser.add_argument("--block-sizes", type=_int_list, default=(16, 32, 64), metavar="N,...")
    parser.add_argument("--num-q-heads", type=positive_int, default=32)
    parser.add_argument("--num-kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--cache-type", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")
    parser.set_defaults(handler=_run_bench_kernels, command_prog=parser.prog)


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    import torch

    from engine.benchmark import machine_info
    from kernels.benchmark import bench_paged_attention, measure_copy_bandwidth

    if not torch.cuda.is_available():
        raise CommandError("the kernel benchmark needs a CUDA device")
    device = torch.device("cuda")
    cache_dtype = torch.float8_e4m3fn if args.cache_type == "fp8_e4m3" else None
    points = bench_paged_attention(
        args.batch_sizes, args.context_lens, args.block_sizes, num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=cache_dtype,
    )  # fmt: skip
    record = {
        "kind": "kernels",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
    _save(record, args.output_json)
    return 0


# -- kv-quality ------------------------------------------------------------------------------


def _configure_bench_kv_quality(parser: argparse.ArgumentParser) -> None:
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
    from engine import PagestreamError
    from engine.kv_quality import measure_kv_quality

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
    _save(record, args.output_json)
    return 0


# -- plot ------------------------------------------------------------------------------------


def _configure_bench_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+", metavar="RECORD.json")
    parser.set_defaults(handler=_run_bench_plot, command_prog=parser.prog)


def _run_bench_plot(args: argparse.Namespace) -> int:
    import json

    from engine.bench_plots import plot_record

    for name in args.records:
        path = Path(name)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read benchmark record {name}: {exc}") from exc
        png = plot_record(record, path.with_suffix(".png"), required=True)
        print(f"wrote {png}", file=sys.stderr)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected N,N,... got {text!r}")
    return values
