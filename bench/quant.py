"""Quantized weights against the float model: bytes, quality and speed per format.

    pagestream bench quant --model dummy:llama3-8b --formats q8_0,q4_0,q4_1,fp8
    pagestream bench quant --model smollm2-135m --formats gguf   (or python -m bench.quant)

The reference is ``--quantization none`` in the model dtype (bf16 on CUDA). For each format,
on the same prompts (text for a model with a tokenizer, else random ids):
- weights: bytes of every parameter and packed plane, against the reference's;
- quality: greedy agreement (share of identical outputs, mean share before the first
  difference) and teacher-forced logit error (mean/max absolute, relative to the logits'
  spread, KL, top-1 agreement) on the reference's own greedy sequences (bench/kv_quality.py);
- speed: batch-1 time per output token against the weight-streaming limit (the bytes a decode
  step reads, every weight but an untied embedding plus the KV, over the copy bandwidth
  measured in the same run; bench/latency.py), and offline throughput on random prompts
  (bench/throughput.py).
The reference itself gets the speed rows too, so every ratio comes from one run.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.kv_quality import greedy_agreement, logit_error, quality_prompts
from bench.latency import LatencyWorkload, run_latency
from bench.records import check_output_json, machine_info, save, utc_now
from bench.throughput import run_throughput
from bench.workloads import ThroughputWorkload
from engine.llm import LLM
from engine.memory import release_device_memory
from engine.quant.linear import QuantizedLinear
from engine.sampling_params import SamplingParams
from worker.arg_types import non_negative_int, positive_int

REFERENCE = "none"


def measure_quant(
    model: str,
    formats: list[str],
    *,
    num_prompts: int = 8,
    input_len: int = 128,
    output_len: int = 64,
    throughput: ThroughputWorkload | None = None,
    seed: int = 0,
    **settings: Any,
) -> dict[str, Any]:
    """The record (see module docstring) of each of ``formats`` against ``none``."""
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    latency = LatencyWorkload(batch_sizes=(1,), input_len=input_len, output_len=output_len)
    reference = LLM(model, quantization=REFERENCE, **settings)
    prompts = quality_prompts(reference, num_prompts, input_len, seed)
    ref_outputs = [o.token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    sequences = [list(p) + out for p, out in zip(prompts, ref_outputs, strict=True)]
    ref_logits = _scored_logits(reference, sequences, prompts)
    device = reference.engine.device
    copy_bytes_per_s = _copy_bandwidth(device)
    results = {REFERENCE: _speed(reference, latency, throughput, copy_bytes_per_s)}
    del reference
    release_device_memory()
    for fmt in formats:
        llm = LLM(model, quantization=fmt, **settings)
        outputs = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        logits = _scored_logits(llm, sequences, prompts)
        results[fmt] = {
            **greedy_agreement(ref_outputs, outputs),
            **logit_error(ref_logits, logits, [1] * len(logits)),
            **_speed(llm, latency, throughput, copy_bytes_per_s),
        }
        del llm
        release_device_memory()
        print(fmt, _summary_line(results[fmt], results[REFERENCE]), flush=True)
    run = {"model": model, "formats": formats, "num_prompts": len(prompts),
           "input_len": input_len, "output_len": output_len, "seed": seed}  # fmt: skip
    return {
        "kind": "quant",
        "created_utc": utc_now(),
        "machine": machine_info(device),
        "settings": {**run, "reference": REFERENCE, **settings},
        "copy_bytes_per_s": copy_bytes_per_s,
        "results": results,
    }


def _scored_logits(
    llm: LLM, sequences: list[list[int]], prompts: list[list[int]]
) -> list[torch.Tensor]:
    """Teacher-forced logits from each prompt's last token on (the rest is not compared)."""
    runner = llm.engine.runner
    return [
        runner.teacher_forced_logits(seq)[len(prompt) - 1 :].cpu()
        for seq, prompt in zip(sequences, prompts, strict=True)
    ]


def _copy_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from bench.kernels import measure_copy_bandwidth

    return measure_copy_bandwidth(device)


def _speed(
    llm: LLM,
    latency: LatencyWorkload,
    throughput: ThroughputWorkload | None,
    copy_bytes_per_s: float | None,
) -> dict[str, Any]:
    engine = llm.engine
    model = engine.loaded.model
    formats = sorted({m.fmt.name for m in model.modules() if isinstance(m, QuantizedLinear)})
    batch_1 = run_latency(engine, latency, copy_bytes_per_s=copy_bytes_per_s, use_tqdm=False)
    speed: dict[str, Any] = {
        "weights_bytes": engine.loaded.weights_bytes,
        "weights_gb": engine.loaded.weights_bytes / 1e9,
        "linear_formats": formats,
        "batch1": _with_streaming_limit(batch_1["results"][0], engine, copy_bytes_per_s),
        "cuda_graphs": engine.runner.uses_cuda_graphs,
    }
    if throughput is not None:
        results = run_throughput(engine, throughput, use_tqdm=False)["results"]
        speed["throughput"] = {key: results[key] for key in
                               ("output_tok_s", "total_tok_s", "mean_ttft_s", "tpot_s",
                                "elapsed_s", "num_preemptions")}  # fmt: skip
    return speed


def _with_streaming_limit(
    batch_1: dict[str, Any], engine: Any, copy_bytes_per_s: float | None
) -> dict[str, Any]:
    """The batch-1 result with the bytes a decode step really streams: bench latency counts
    every weight, but an untied embedding is read one row a token (1 GB of llama3-8b's 5 GB
    at 4 bits), which would flatter the quantized formats most."""
    model = engine.loaded.model
    embedding_bytes = 0
    if not model.arch.tie_word_embeddings:
        weight = model.embed_tokens.weight
        embedding_bytes = weight.numel() * weight.element_size()
    streamed = batch_1["decode_step_bytes"] - embedding_bytes
    result = {**batch_1, "streamed_step_bytes": streamed}
    if copy_bytes_per_s:
        result["streaming_limit_tpot_s"] = streamed / copy_bytes_per_s
        result["fraction_of_streaming_limit"] = (
            result["streaming_limit_tpot_s"] / batch_1["mean_tpot_s"]
        )
    return result


def _summary_line(result: dict[str, Any], reference: dict[str, Any]) -> str:
    gb = result["weights_bytes"] / 1e9
    tpot_ms = result["batch1"]["mean_tpot_s"] * 1e3
    ref_tpot_ms = reference["batch1"]["mean_tpot_s"] * 1e3
    line = (
        f"weights {gb:.2f} GB ({result['weights_bytes'] / reference['weights_bytes']:.2f}x), "
        f"greedy identical {result['greedy_identical_share']:.2f}, "
        f"top-1 {result['teacher_forced_top1_agreement']:.3f}, "
        f"logit max err {result['logit_max_abs_error']:.3g}, "
        f"batch-1 TPOT {tpot_ms:.2f} ms (reference {ref_tpot_ms:.2f})"
    )
    if "fraction_of_streaming_limit" in result["batch1"]:
        line += f", {result['batch1']['fraction_of_streaming_limit']:.2f} of the streaming limit"
    if "throughput" in result:
        line += f", {result['throughput']['output_tok_s']:.0f} out tok/s"
    return line


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagestream bench quant`` (and ``python -m bench.quant``)."""
    parser.add_argument("--model", default="dummy:llama3-8b", help="default dummy:llama3-8b")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1,fp8", metavar="F,F,...",
                        help="--quantization values to compare with none "
                        "(default q8_0,q4_0,q4_1,fp8; gguf for a quantized GGUF)")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    # refused here, not after minutes of loading models
    parser.add_argument("--num-prompts", type=positive_int, default=8,
                        help="quality prompts (default 8)")  # fmt: skip
    parser.add_argument("--input-len", type=positive_int, default=128,
                        help="random prompts (default 128)")  # fmt: skip
    parser.add_argument("--output-len", type=positive_int, default=64, help="default 64")
    parser.add_argument("--throughput-prompts", type=non_negative_int, default=256,
                        help="prompts of the throughput run (input and output 128..512); "
                        "0 = skip (default 256)")  # fmt: skip
    parser.add_argument("--max-model-len", type=positive_int, default=2048, help="default 2048")
    parser.add_argument("--output-json", metavar="PATH", help="where to write the JSON record")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The record for flags added by :func:`add_quant_args`."""
    throughput = None
    if args.throughput_prompts:
        throughput = ThroughputWorkload(args.throughput_prompts, (128, 512), (128, 512))
    return measure_quant(
        args.model, args.formats.split(","), num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, throughput=throughput,
        device=args.device, max_model_len=args.max_model_len,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_quant_args(parser)
    args = parser.parse_args(argv)
    check_output_json(args.output_json)
    save(run_from_args(args), args.output_json)


if __name__ == "__main__":
    main()
