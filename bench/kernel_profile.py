"""Where a decode step's GPU time goes, kernel by kernel (torch.profiler, CUDA).

    python -m bench.kernel_profile --model dummy:llama3-8b --batch 128 --context 800
    python -m bench.kernel_profile --model dummy:llama3-8b --quantization q4_0 --batch 1

Fills ``--batch`` sequences with random prompts of ``--context`` tokens, then profiles
``--steps`` decode steps run eagerly (``cuda_graphs`` off, so every kernel is its own launch
and the profiler names it), and prints the kernels by total GPU time with their share of the
step, next to the step's floor: every weight and every sequence's KV read once at the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.kernels import measure_copy_bandwidth
from bench.latency import decode_weight_bytes
from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--quantization", default="auto", help="as the engine flag")
    args = parser.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(model=args.model, cuda_graphs=False, max_model_len=args.context + 256,
                     max_seqs=max(args.batch, 1), async_scheduling=False,
                     quantization=args.quantization)
    )  # fmt: skip
    vocab = engine.loaded.arch.vocab_size
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for index in range(args.batch):
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(f"p{index}", prompt_token_ids=prompt, sampling=sampling)
    engine.step_profiler.enabled = True  # names each step's kind: profile decode steps only
    num_decodes = 0
    while num_decodes < 3:  # prefill until every sequence decodes, then warm
        engine.step()
        steps = engine.step_profiler.steps
        num_decodes = num_decodes + 1 if steps and steps[-1].kind == "decode" else 0
    engine.step_profiler.enabled = False
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    _report(prof, engine, args)


def _report(prof: Any, engine: LLMEngine, args: argparse.Namespace) -> None:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events) / args.steps
    weight_bytes = decode_weight_bytes(engine.loaded.arch, engine.loaded.weights_bytes, args.batch)
    step_bytes = weight_bytes + args.batch * (args.context + 8) * (
        engine.kv_cache.spec.bytes_per_token
    )
    floor_us = step_bytes / measure_copy_bandwidth(engine.device) * 1e6
    print(f"{args.model} batch {args.batch} context {args.context}: GPU {total_us:.0f} us per "
          f"decode step, floor {floor_us:.0f} us (x{total_us / floor_us:.2f})")  # fmt: skip
    by_role: dict[str, float] = {}
    for event in events:
        role = _role(event.key)
        by_role[role] = by_role.get(role, 0.0) + event.self_device_time_total / args.steps
    print("  by role: " + ", ".join(
        f"{role} {us:.0f} us ({100 * us / total_us:.0f}%)"
        for role, us in sorted(by_role.items(), key=lambda item: -item[1])
    ))  # fmt: skip
    for event in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        per_step = event.self_device_time_total / args.steps
        print(f"{per_step:9.0f} us {100 * per_step / total_us:5.1f}%  "
              f"{event.count // args.steps:4d}x  {event.key[:90]}")  # fmt: skip


ROLES = (  # (role, substrings of a kernel's name), first match wins
    ("rotary + kv write", ("rotary_write_kv",)),  # the fused kernel the engine launches
    ("attention", ("attention", "attn")),
    ("kv write", ("kv_write", "store_kv")),
    ("norm", ("rms", "norm")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "act_and_mul")),
    ("x to int8", ("quantize_x",)),  # the int8-activation GEMV's rounding
    (
        "gemm",
        ("gemm", "gemv", "mma", "cutlass", "sm90", "ampere", "cublas", "splitk", "xmma", "nvjet"),
    ),
    ("sampling", ("argmax", "softmax", "sort", "topk", "exponential", "multinomial")),
)


def _role(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((role for role, keys in ROLES if any(k in name for k in keys)), "other")


if __name__ == "__main__":
    main()
