"""``pagestream bench``: one sub-subcommand per benchmark, each writing a JSON record."""

from __future__ import annotations

import argparse
from typing import Any

from commands.parser import CommandError, LazyParser, Subparsers
from worker.arg_types import int_list, int_range, positive_int


def register(subparsers: Subparsers) -> None:
    subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, latency, matrix, kernels, serve, multiturn; plot a record",
        description="Benchmarks of the engine; each writes a JSON record of its results.",
        configure=_configure_bench,
    )


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    from commands import bench_device

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
        configure=bench_device.configure_latency,
    )
    kinds.add_parser(
        "speculative",
        help="speculative decoding's speedup at batch 1 and 8, on prompts it suits",
        description="Run the same greedy requests without and with speculative decoding "
        "(--speculative ngram unless given): TPOT, tok/s, speedup, acceptance rate and "
        "whether the outputs match. The prompts ask to repeat a passage (copying suits "
        "prompt lookup); the record says so.",
        configure=bench_device.configure_speculative,
    )
    kinds.add_parser(
        "kernels",
        help="paged-attention kernel bandwidth against measured copy bandwidth (CUDA)",
        description="Time the Triton paged-attention decode kernel across batch sizes, context "
        "lengths and block sizes; report achieved bandwidth as a fraction of copy bandwidth.",
        configure=bench_device.configure_kernels,
    )
    kinds.add_parser(
        "kv-quality",
        help="quality of an fp8 KV cache against the model-dtype cache (greedy and logits)",
        description="Greedy agreement and teacher-forced logit error of --pa-cache-type "
        "fp8_e4m3 against the default cache, on the same weights and prompts.",
        configure=bench_device.configure_kv_quality,
    )
    kinds.add_parser(
        "quant",
        help="quantized weights against the float model: bytes, greedy and logit error, speed",
        description="Each --quantization format against none on the same prompts: weights GB, "
        "greedy agreement, teacher-forced logit error, batch-1 time per output token against "
        "the weight-streaming limit, and offline throughput.",
        configure=bench_device.configure_quant,
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
        "multiturn",
        help="multi-turn chat (shared system prompt, many sessions) with the host KV tier off and on",
        description="Sessions that share a long system prompt come back for several turns (each "
        "prompt = system + history + a new user turn); run once without and once with "
        "--kv-offload-mb and report TTFT, throughput and the prompt tokens each cache tier served.",
        configure=_configure_bench_multiturn,
    )
    kinds.add_parser(
        "matrix",
        help="a workload matrix on several models against vLLM in one session: one record per card",
        description="Run the workload matrix (standard at 64/256/1024 prompts, prefill-heavy, "
        "decode-heavy, shared prefix, long context, batch 1 and 64 TPOT) on each model, and with "
        "--compare vllm the same prompts through vLLM first; write one row per model and "
        "workload, each as it is measured, to bench/results/matrix-<card>.json and a plot.",
        configure=_configure_bench_matrix,
    )
    kinds.add_parser(
        "redis-scale",
        help="tokens/s one Redis primary streams against an N-primary cluster (no engine)",
        description="Start one Redis primary, then an N-primary Redis Cluster, and stream "
        "tokens through each with processes that speak the protocol without an engine "
        "(workers and clients); report tokens/s, Redis commands/s and CPU per token, and the "
        "cluster / single ratio.",
        configure=_configure_bench_redis_scale,
    )
    kinds.add_parser(
        "plot",
        help="draw the PNG plot of a benchmark JSON record",
        description="Draw a PNG beside each given benchmark record (needs matplotlib).",
        configure=bench_device.configure_plot,
    )


def _configure_bench_matrix(parser: argparse.ArgumentParser) -> None:
    from commands.bench_matrix import configure_matrix

    configure_matrix(parser)


def _configure_bench_redis_scale(parser: argparse.ArgumentParser) -> None:
    from bench.redis_scale_cli import configure

    configure(parser)


def _configure_bench_serve(parser: argparse.ArgumentParser) -> None:
    from bench.serve import configure

    configure(parser)


def _configure_bench_throughput(parser: argparse.ArgumentParser) -> None:
    from engine.config_flags import add_engine_args

    w = parser.add_argument_group("workload")
    w.add_argument(
        "--num-prompts",
        type=int_list,
        default=(256,),
        metavar="N[,N,...]",
        help="default 256; several counts (e.g. 64,256,1024,4096) make a sweep record of "
        "throughput against the number of prompts",
    )
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
        metavar="vllm,hf,paged-off",
        help="also run these baselines on the same prompts: vllm (vLLM's offline API in a "
        "subprocess, when vLLM is importable), hf (transformers continuous batching, "
        "generate_batch) and/or paged-off (this engine, --paged-attn off); a sweep takes vllm",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)  # its --seed also seeds the random prompts
    parser.set_defaults(handler=_run_bench_throughput, command_prog=parser.prog)


def _configure_bench_multiturn(parser: argparse.ArgumentParser) -> None:
    from commands.bench_device import finish_engine_bench

    w = parser.add_argument_group("workload")
    w.add_argument("--num-sessions", type=positive_int, default=64, help="chats (default 64)")
    w.add_argument("--num-turns", type=positive_int, default=4, help="turns per chat (default 4)")
    w.add_argument("--system-len", type=positive_int, default=1024,
                   help="tokens of the shared system prompt (default 1024)")  # fmt: skip
    w.add_argument("--user-len", type=int_range, default=(32, 128), metavar="MIN-MAX",
                   help="tokens per user turn, drawn uniformly (default 32-128)")  # fmt: skip
    w.add_argument("--output-len", type=positive_int, default=64,
                   help="tokens per reply, EOS ignored (default 64)")  # fmt: skip
    w.add_argument("--concurrency", type=positive_int, default=16,
                   help="sessions with a turn in flight at once (default 16)")  # fmt: skip
    w.add_argument("--workers", type=int_list, metavar="N[,N,...]",
                   help="through Redis against N worker processes per count, with --routing's "
                   "modes (docs/routing.md); default: the offline engine, host KV tier off and on")  # fmt: skip
    w.add_argument("--routing", type=_routing_modes, default=("shared", "routed"),
                   metavar="shared,routed",
                   help="with --workers: the shared consumer group, prefix-aware routing, or "
                   "both (default both)")  # fmt: skip
    # the engine's --kv-offload-mb is the tier of the second run; its --seed the prompts'
    finish_engine_bench(parser, w, _run_bench_multiturn)


def _routing_modes(text: str) -> tuple[str, ...]:
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    if not modes or set(modes) - {"shared", "routed"}:
        raise argparse.ArgumentTypeError(f"expected shared, routed or both, got {text!r}")
    return modes


def _run_bench_multiturn(args: argparse.Namespace) -> int:
    from bench.multiturn import MultiTurnWorkload, format_results, run_multiturn
    from bench.records import check_output_json, save
    from engine import PagestreamError
    from engine.config_flags import engine_config_from_args

    check_output_json(args.output_json)
    try:
        workload = MultiTurnWorkload(
            args.num_sessions, args.num_turns, args.system_len, args.user_len, args.output_len,
            args.concurrency, args.seed,
        )  # fmt: skip
        if args.workers:
            from bench.multiturn_fleet import run_multiturn_fleet

            record = run_multiturn_fleet(args, workload, args.workers, list(args.routing))
        else:
            record = run_multiturn(
                engine_config_from_args(args), workload, use_tqdm=not args.no_progress
            )
    except PagestreamError as exc:
        raise CommandError(str(exc)) from exc
    if not args.workers:
        print(format_results(record["results"]))
    save(record, args.output_json)
    return 0


def _baselines(text: str) -> tuple[str, ...]:
    from bench.compare import BASELINES

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(BASELINES)}, got {text!r}"
        )
    return names


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from bench.compare import run_with_baselines
    from bench.records import check_output_json, save
    from bench.throughput import format_results
    from bench.vllm_peer import PeerError, check_vllm_importable
    from bench.workloads import ThroughputWorkload
    from engine import PagestreamError
    from engine.config_flags import engine_config_from_args

    sweep = len(args.num_prompts) > 1
    if sweep and set(args.compare) - {"vllm"}:
        raise CommandError("a sweep of several --num-prompts compares with vllm only")
    check_output_json(args.output_json)
    try:
        if "vllm" in args.compare:
            check_vllm_importable()  # before minutes of work, not after
        workloads = [
            ThroughputWorkload(n, args.input_len, args.output_len, args.seed)
            for n in args.num_prompts
        ]
        config = engine_config_from_args(args)
        if sweep:
            return _run_sweep(args, config, workloads)
        record = run_with_baselines(
            config, workloads[0], args.compare, use_tqdm=not args.no_progress
        )
    except (PagestreamError, PeerError) as exc:
        raise CommandError(str(exc)) from exc
    print(format_results(record["results"]))
    for name, baseline in record["baselines"].items():
        print(f"{name}: {baseline['output_tok_s']:.1f} output tok/s (x{baseline['ratio']:.2f})")
    save(record, args.output_json)
    return 0


def _run_sweep(args: argparse.Namespace, config: Any, workloads: list[Any]) -> int:
    from bench.records import save
    from bench.sweep import format_sweep, run_sweep

    record = run_sweep(
        config, workloads, compare_vllm="vllm" in args.compare, use_tqdm=not args.no_progress
    )
    print(format_sweep(record))
    save(record, args.output_json)
    return 0
