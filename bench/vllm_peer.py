"""vLLM as a same-run peer: the project's own workloads through vLLM's offline API.

The parent (``pagestream bench throughput/latency --compare vllm``) calls ``run_vllm_peer``,
which starts this module in a subprocess (vLLM and the engine never share a process or GPU
memory) and reads back its JSON. The child builds exactly the prompts the engine ran (same
workload code, same seed), loads the same weights (``dummy:`` shapes as random weights of the
same config via ``load_format="dummy"``, or the same HF directory), and times greedy
generation with EOS ignored, so both engines make the same number of tokens.

    python -m bench.vllm_peer throughput --model dummy:qwen3-0.6b --num-prompts 256,1024 \\
        --input-len 100-1024 --output-len 100-1024 --max-seqs 256 --out vllm.json
    python -m bench.vllm_peer latency --model dummy:llama3-8b --batch-sizes 1,64 --out v.json
    python -m bench.vllm_peer speculative --model DIR --speculative-method draft_model \
        --speculative-model DRAFT_DIR --batch-sizes 1,8 --out v.json
    python -m bench.vllm_peer matrix --model dummy:llama3-8b --workloads standard-256,tpot-b1 \
        --out v.json

``throughput --json-schema FILE`` puts every request under that JSON schema through vLLM's
structured outputs (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``,
its default backend unless ``PAGESTREAM_VLLM_ARGS`` sets ``structured_outputs_config``); a
``dummy:`` model then gets the bundled SmolLM2 tokenizer, as ``bench/structured.py`` gives the
engine.

``speculative`` runs ``bench speculative``'s copy prompts (the same token ids, from the
model's own tokenizer and chat template), greedy, stopping at EOS, once per process: the
parent starts it twice, without and with vLLM's own speculation (``ngram`` prompt lookup or
``draft_model``), and reads vLLM's acceptance counters. ``matrix`` runs ``bench matrix``'s
workloads by name (``bench/matrix_workloads.py``) on one load of the model. The record is
rewritten after each result, so the parent can follow it (``bench/peer_process.py``).

vLLM's own scheduling settings stay at its defaults (what its users get), except the number
of running sequences, which follows the engine's ``--max-seqs``; the record says which token
budget vLLM used. ``PAGESTREAM_VLLM_ARGS`` (JSON) adds or overrides ``vllm.LLM`` arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.peer_process import OnRecord, run_peer_module, write_json_atomically
from bench.peer_process import PeerError as PeerError  # where the commands import it from

if TYPE_CHECKING:
    from bench.latency import LatencyWorkload
    from bench.matrix_workloads import MatrixWorkload
    from bench.speculative import SpeculativeWorkload
    from bench.workloads import ThroughputWorkload
    from engine.config import EngineConfig

VLLM_ARGS_ENV = "PAGESTREAM_VLLM_ARGS"
INSTALL_HINT = (
    "vLLM is not importable here: install it (pip install vllm) or put it on PYTHONPATH; "
    "on the lent GPU, the kit in shared/peers/vllm-0.26 unpacks it"
)
FORCE_CUDA_ENV = "PAGESTREAM_VLLM_FORCE_CUDA"  # read by vllm_site/sitecustomize.py
VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"  # its sitecustomize.py


# -- the parent's side ------------------------------------------------------------------------


def check_vllm_importable() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise PeerError(INSTALL_HINT)


def run_vllm_peer(
    kind: str, arguments: list[str], on_record: OnRecord | None = None
) -> dict[str, Any]:
    """Run this module's ``kind`` in a subprocess; its JSON record (``on_record`` gets it
    after each result, while the child still runs)."""
    check_vllm_importable()
    return run_peer_module(
        "bench.vllm_peer",
        [kind, *arguments],
        name="vLLM",
        on_record=on_record,
        env={FORCE_CUDA_ENV: "1"},
        path_first=str(VLLM_SITE),
    )


def add_vllm_latency(record: dict[str, Any], vllm: dict[str, Any]) -> None:
    """Put vLLM's figures beside the engine's at each batch size: ``tpot_ratio`` is the
    engine's TPOT over vLLM's (below 1: the engine is faster), likewise ``ttft_ratio``."""
    theirs = {row["batch"]: row for row in vllm["results"]}
    for row in record["results"]:
        peer = dict(theirs[row["batch"]])
        peer["tpot_ratio"] = row["mean_tpot_s"] / peer["tpot_s"]
        peer["ttft_ratio"] = row["mean_ttft_s"] / peer["ttft_s"]
        row["vllm"] = peer
    record["vllm"] = {k: v for k, v in vllm.items() if k != "results"}


def throughput_peer_args(config: EngineConfig, workloads: list[ThroughputWorkload]) -> list[str]:
    """The child's flags for the engine's throughput workloads (one vLLM load for all)."""
    first = workloads[0]
    return [
        *_engine_args(config),
        "--num-prompts", ",".join(str(w.num_prompts) for w in workloads),
        "--input-len", "-".join(map(str, first.input_len)),
        "--output-len", "-".join(map(str, first.output_len)),
        "--seed", str(first.seed),
    ]  # fmt: skip


def latency_peer_args(config: EngineConfig, workload: LatencyWorkload) -> list[str]:
    return [
        *_engine_args(config),
        "--batch-sizes", ",".join(map(str, workload.batch_sizes)),
        "--latency-input-len", str(workload.input_len),
        "--latency-output-len", str(workload.output_len),
        "--seed", str(workload.seed),
    ]  # fmt: skip


def speculative_peer_args(
    config: EngineConfig, workload: SpeculativeWorkload
) -> tuple[list[str], list[str]]:
    """The child's flags for ``bench speculative``'s two runs: without speculation, and with
    vLLM's counterpart of the engine's (prompt lookup, or the same draft model's directory)."""
    target = dataclasses.replace(config, model=_hf_dir(config.model, "model"))
    plain = [
        *_engine_args(target),
        "--batch-sizes", ",".join(map(str, workload.batch_sizes)),
        "--speculative-output-len", str(workload.output_len),
        "--seed", str(workload.seed),
    ]  # fmt: skip
    spec = [*plain, "--num-speculative-tokens", str(config.speculative_tokens())]
    if config.speculative_method() == "model":
        assert config.speculative_model is not None
        spec += ["--speculative-method", "draft_model",
                 "--speculative-model", _hf_dir(config.speculative_model, "draft model")]  # fmt: skip
    else:
        spec += ["--speculative-method", "ngram",
                 "--ngram-min", str(config.speculative_ngram_min),
                 "--ngram-max", str(config.speculative_ngram_max)]  # fmt: skip
    return plain, spec


def matrix_peer_args(
    config: EngineConfig, workloads: list[MatrixWorkload], scale: float, profile_every: int = 0
) -> list[str]:
    """The child's flags for ``bench matrix``: the engine's limits and the workloads by name."""
    return [
        *_engine_args(config),
        "--workloads", ",".join(w.name for w in workloads),
        "--scale", repr(scale),
        "--seed", str(config.seed),
        "--profile-every", str(profile_every),
    ]  # fmt: skip


def _hf_dir(name: str, what: str) -> str:
    """The Hugging Face directory the engine reads for ``name`` (a GGUF, the bundled model
    included, is the directory it is converted into), which vLLM loads too. A speculative
    run needs the tokenizer's chat template, so not a ``dummy:`` shape."""
    if name.startswith("dummy:"):
        raise PeerError(
            f"bench speculative --compare vllm needs a {what} with weights and a tokenizer, "
            f"not {name}"
        )
    from engine.loader import resolve_model_dir

    return str(resolve_model_dir(name).resolve())


def add_vllm_speculative(
    record: dict[str, Any], plain: dict[str, Any], spec: dict[str, Any]
) -> None:
    """vLLM's two runs beside the engine's at each batch size; ``ratio`` is the engine's
    tok/s with speculation over vLLM's with its own (above 1: the engine is faster),
    ``plain_ratio`` the same without."""
    without = {row["batch"]: row for row in plain["results"]}
    for row in record["results"]:
        theirs = next(r for r in spec["results"] if r["batch"] == row["batch"])
        base = without[row["batch"]]
        ours_spec, ours_plain = row["speculative"]["output_tok_s"], row["plain"]["output_tok_s"]
        row["vllm"] = {
            "plain": base,
            "speculative": theirs,
            "speedup_tok_s": theirs["output_tok_s"] / base["output_tok_s"],
            "acceptance_rate": theirs.get("acceptance_rate"),
            "ratio": ours_spec / theirs["output_tok_s"],
            "plain_ratio": ours_plain / base["output_tok_s"],
        }
    record["vllm"] = {k: v for k, v in spec.items() if k != "results"}


def _engine_args(config: EngineConfig) -> list[str]:
    if config.model.startswith("dummy:"):
        model = config.model
    elif Path(config.model).is_dir():
        model = str(Path(config.model).resolve())
    else:
        raise PeerError(
            f"--compare vllm needs a dummy:<shape> or a Hugging Face directory, not {config.model!r}"
        )
    args = ["--model", model, "--max-seqs", str(config.max_seqs)]
    if config.tensor_parallel_size > 1:  # vLLM on as many GPUs
        args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.quantization == "fp8":  # vLLM's own fp8: per-channel weights quantized at load
        args += ["--quantization", "fp8"]
    elif config.quantization not in ("auto", "none"):
        raise PeerError(
            f"--compare vllm: vLLM cannot quantize to {config.quantization} at load; compare "
            "--quantization fp8 or none"
        )
    return args


# -- the child's side -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    llm, vocab_size, model_info = _load_vllm(args)
    record: dict[str, Any] = {"peer": "vllm", "kind": args.kind, **model_info, "results": []}
    write_json_atomically(Path(args.out), record)
    for result in _results(llm, vocab_size, args):
        record["results"].append(result)
        write_json_atomically(Path(args.out), record)  # the parent follows it result by result
    return 0


def _results(llm: Any, vocab_size: int, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.kind == "throughput":
        for num in args.num_prompts:
            workload = _throughput_workload(args, num)
            schema = None if args.json_schema is None else Path(args.json_schema).read_text()
            yield {"num_prompts": num, **_throughput(llm, vocab_size, workload, schema)}
    elif args.kind == "speculative":
        for batch in args.batch_sizes:
            yield _speculative(llm, vocab_size, args, batch)
    elif args.kind == "matrix":
        from bench.matrix_workloads import select_workloads

        for row in select_workloads(args.workloads, seed=args.seed, scale=args.scale):
            result = _matrix_result(llm, vocab_size, row, args.profile_every)
            yield {"workload": row.name, **result}
    else:
        for batch in args.batch_sizes:
            yield _latency(llm, vocab_size, _latency_workload(args, batch), batch)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.vllm_peer", description=__doc__
    )
    parser.add_argument("kind", choices=["throughput", "latency", "speculative", "matrix"])
    parser.add_argument("--model", required=True, help="dummy:<shape> or an HF directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--num-prompts", type=_ints, default=(256,))
    parser.add_argument("--input-len", type=_range, default=(100, 1024))
    parser.add_argument("--output-len", type=_range, default=(100, 1024))
    parser.add_argument("--batch-sizes", type=_ints, default=(1, 8, 32, 64))
    parser.add_argument("--latency-input-len", type=int, default=128)
    parser.add_argument("--latency-output-len", type=int, default=128)
    parser.add_argument("--speculative-output-len", type=int, default=256)
    parser.add_argument("--speculative-method", choices=["ngram", "draft_model"])
    parser.add_argument("--speculative-model", help="the draft model's HF directory")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--workloads", type=_names, default=(), help="matrix workload names")
    parser.add_argument("--scale", type=float, default=1.0, help="matrix workload scale")
    parser.add_argument(
        "--profile-every", type=int, default=0, help="matrix: profile about one step in N (0: none)"
    )
    parser.add_argument("--json-schema", help="throughput: a file holding a JSON schema")
    return parser


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _load_vllm(args: argparse.Namespace) -> tuple[Any, int, dict[str, Any]]:
    # The engine core in this process: simpler, and no NVML probe of a child process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model_dir, load_format, vocab_size = _model_dir(args.model)
    if args.json_schema is not None and load_format == "dummy":
        from engine.structured.tokenizers import bundled_tokenizer

        bundled_tokenizer().save_pretrained(model_dir)
    force_cuda_platform()
    import torch
    import vllm

    speculative = args.kind == "speculative"
    settings: dict[str, Any] = {
        "model": model_dir,
        "load_format": load_format,
        # the copy prompts come from the tokenizer's chat template, and requests end at EOS;
        # grammars map tokens to text
        "skip_tokenizer_init": not speculative and args.json_schema is None,
        "dtype": "bfloat16",
        "max_num_seqs": args.max_seqs,
        "tensor_parallel_size": args.tensor_parallel_size,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "quantization": args.quantization,
        # latency repeats the same prompts: cached prefixes would skip the prefill it times
        "enable_prefix_caching": args.kind != "latency",
        **_speculative_settings(args),
        **json.loads(os.environ.get(VLLM_ARGS_ENV, "{}")),
    }
    llm = vllm.LLM(**settings)
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "model": args.model,
        "settings": {k: v for k, v in settings.items() if k != "model"},
        **_scheduler_settings(llm),
    }
    return llm, vocab_size, info


def _speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``vllm.LLM`` arguments of a speculative run: the method, and statistics on (vLLM
    counts drafts only then)."""
    if args.kind != "speculative":
        return {}
    if args.speculative_method is None:
        return {"disable_log_stats": False}
    config: dict[str, Any] = {
        "method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if args.speculative_method == "draft_model":
        config["model"] = args.speculative_model
    else:
        config.update(prompt_lookup_min=args.ngram_min, prompt_lookup_max=args.ngram_max)
    return {"disable_log_stats": False, "speculative_config": config}


def _scheduler_settings(llm: Any) -> dict[str, Any]:
    """The token budget and sequence cap vLLM chose (attribute paths differ across versions)."""
    try:
        scheduler = llm.llm_engine.vllm_config.scheduler_config
        return {
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_num_seqs": scheduler.max_num_seqs,
        }
    except AttributeError as exc:
        return {"scheduler_settings_unknown": repr(exc)}


def _model_dir(model: str) -> tuple[str, str, int]:
    """(a directory vLLM loads, its load format, the vocabulary size): a dummy shape is its
    config with random weights."""
    if not model.startswith("dummy:"):
        from transformers import AutoConfig

        return model, "auto", AutoConfig.from_pretrained(model).vocab_size
    from engine.loader.dummy import dummy_hf_config

    config = dummy_hf_config(model.removeprefix("dummy:"))
    config.torch_dtype = "bfloat16"
    directory = tempfile.mkdtemp(prefix="pagestream-vllm-config-")
    config.save_pretrained(directory)
    _add_expert_count_alias(Path(directory) / "config.json")
    return directory, "dummy", config.vocab_size


def _add_expert_count_alias(config_path: Path) -> None:
    """transformers 5 writes a Qwen-MoE's expert count as ``num_local_experts``; older
    transformers (and the vLLM model reading it) take ``num_experts``: write both."""
    data = json.loads(config_path.read_text())
    if "num_local_experts" in data and data.get("model_type", "").startswith("qwen"):
        data.setdefault("num_experts", data["num_local_experts"])
        config_path.write_text(json.dumps(data, indent=2))


def force_cuda_platform() -> None:
    """vLLM finds its platform through NVML, which fails on some VMs whose CUDA works."""
    import vllm.platforms as platforms

    try:
        platforms.cuda_platform_plugin()
    except Exception as exc:  # any probe failure: the CUDA build is still the right one
        print(f"vllm platform probe failed ({exc!r}); using CUDA", file=sys.stderr)
    platforms.builtin_platform_plugins["cuda"] = lambda: "vllm.platforms.cuda.CudaPlatform"


def _greedy(num_tokens: int, json_schema: str | None = None) -> Any:
    from vllm import SamplingParams

    structured = None
    if json_schema is not None:  # vLLM 0.26's structured outputs (guided_json before)
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(json=json_schema)
    return SamplingParams(
        max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True, temperature=0,
        detokenize=False, structured_outputs=structured,
    )  # fmt: skip


def _generate(
    llm: Any, prompts: list[list[int]], output_lens: list[int], json_schema: str | None = None
) -> list[Any]:
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [_greedy(n, json_schema) for n in output_lens]
    return list(llm.generate(inputs, params, use_tqdm=False))


def _throughput_workload(args: argparse.Namespace, num: int) -> ThroughputWorkload:
    from bench.workloads import ThroughputWorkload

    return ThroughputWorkload(num, args.input_len, args.output_len, args.seed)


def _throughput(
    llm: Any,
    vocab_size: int,
    workload: ThroughputWorkload,
    json_schema: str | None = None,
    profile_every: int = 0,
) -> dict[str, Any]:
    """The engine's throughput run: the same prompts and warm-up, all submitted at once (each
    under ``json_schema`` when given; about one step in ``profile_every`` profiled, as pagestream's
    are: ``bench/kernel_sample.py``)."""
    from bench.kernel_sample import KernelSampler
    from bench.workloads import make_random_prompts, warmup_prompts

    prompts = make_random_prompts(workload, vocab_size)
    warm = warmup_prompts(prompts, workload.num_warmup_prompts)  # the engine's own warm-up
    _generate(llm, [p.token_ids for p in warm], [p.output_len for p in warm], json_schema)
    sampler = KernelSampler(profile_every, "cuda") if profile_every else None
    if sampler is not None:  # LLM.generate's loop calls llm_engine.step(): sample through it
        llm.llm_engine.step = sampler.wrapping(llm.llm_engine.step)
    start_s = time.perf_counter()
    try:
        outs = _generate(
            llm, [p.token_ids for p in prompts], [p.output_len for p in prompts], json_schema
        )
    finally:
        if sampler is not None:
            del llm.llm_engine.step  # the class's method again
    elapsed_s = time.perf_counter() - start_s
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(p.token_ids) for p in prompts)
    result = {
        "elapsed_s": elapsed_s,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed_s,
        "total_tok_s": (num_in + num_out) / elapsed_s,
        **({} if sampler is None else {"kernel_profile": sampler.summary()}),
    }
    print(f"vllm throughput {len(prompts)} prompts: {result['output_tok_s']:.0f} out tok/s")
    return result


def _matrix_result(
    llm: Any, vocab_size: int, workload: MatrixWorkload, profile_every: int = 0
) -> dict[str, Any]:
    if workload.latency is not None:
        return _latency(llm, vocab_size, workload.latency, workload.latency.batch_sizes[0])
    assert workload.throughput is not None
    return _throughput(llm, vocab_size, workload.throughput, profile_every=profile_every)


def _speculative(llm: Any, vocab_size: int, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """``bench speculative``'s run at one batch size: the same prompt ids, warmed up on the
    prompts reversed (no prefix-cache hits), greedy, ``--speculative-output-len`` tokens at
    most; the drafts vLLM made and kept in that run."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.speculative import WARMUP_OUTPUT_LEN, copy_prompts
    from engine.inputs import PromptEncoder

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoder = PromptEncoder(args.model, tokenizer, vocab_size, args.max_model_len or 1 << 30)
    prompts, _ = copy_prompts(encoder, vocab_size, batch, args.seed)

    def generate(token_ids: list[list[int]], num_tokens: int) -> list[Any]:
        greedy = SamplingParams(temperature=0, max_tokens=num_tokens, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in token_ids]
        return list(llm.generate(inputs, greedy, use_tqdm=False))

    generate([p[::-1] for p in prompts], WARMUP_OUTPUT_LEN)
    before = _draft_counts(llm)
    start_s = time.perf_counter()
    outs = generate(prompts, args.speculative_output_len)
    elapsed_s = time.perf_counter() - start_s
    after = _draft_counts(llm)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result: dict[str, Any] = {
        "batch": batch,
        "elapsed_s": elapsed_s,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed_s,
    }
    if before is not None and after is not None and after[0] > before[0]:
        drafted, accepted = after[0] - before[0], after[1] - before[1]
        result.update(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                      acceptance_rate=accepted / drafted)  # fmt: skip
    print(f"vllm speculative batch {batch}: {result['output_tok_s']:.1f} out tok/s", flush=True)
    return result


def _draft_counts(llm: Any) -> tuple[int, int] | None:
    """vLLM's (draft tokens, accepted tokens) so far; None without speculation or metrics."""
    try:
        values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    except Exception:  # statistics off, or another metrics API
        return None
    drafted = values.get("vllm:spec_decode_num_draft_tokens")
    accepted = values.get("vllm:spec_decode_num_accepted_tokens")
    if drafted is None or accepted is None:
        return None
    return int(drafted), int(accepted)


def _latency_workload(args: argparse.Namespace, batch: int) -> LatencyWorkload:
    from bench.latency import LatencyWorkload

    return LatencyWorkload((batch,), args.latency_input_len, args.latency_output_len, args.seed)


def _latency(llm: Any, vocab_size: int, workload: LatencyWorkload, batch: int) -> dict[str, Any]:
    """TTFT: a 1-token run; TPOT: (time of output_len tokens - TTFT) / (output_len - 1). The
    difference of two runs: a prompt served from the prefix cache cancels out of TPOT."""
    prompts = workload.prompts(batch, vocab_size)
    _generate(llm, prompts, [16] * batch)  # warm-up

    def median_s(num_tokens: int) -> float:
        times = []
        for _ in range(3):
            start_s = time.perf_counter()
            _generate(llm, prompts, [num_tokens] * batch)
            times.append(time.perf_counter() - start_s)
        return statistics.median(times)

    ttft_s, total_s = median_s(1), median_s(workload.output_len)
    tpot_s = (total_s - ttft_s) / (workload.output_len - 1)
    result = {"batch": batch, "ttft_s": ttft_s, "tpot_s": tpot_s, "output_tok_s": batch / tpot_s}
    print(f"vllm latency batch {batch}: TTFT {ttft_s * 1e3:.1f} ms, TPOT {tpot_s * 1e3:.2f} ms")
    return result


if __name__ == "__main__":
    sys.exit(main())
