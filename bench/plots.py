"""PNG plots of benchmark records (matplotlib, optional: without it no plot is drawn)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import plots_features, redis_scale_plot
from engine.errors import ConfigError


def plot_record(record: dict[str, Any], path: Path, *, required: bool = False) -> Path | None:
    """Draw ``record`` to ``path``; None when matplotlib is missing (unless ``required``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if required:
            raise ConfigError("plots need matplotlib: pip install matplotlib") from None
        return None
    draws = {
        "throughput": _throughput,
        "throughput-sweep": _sweep,
        "latency": _latency,
        "kernels": _kernels,
        "serve": _serve,
        "multiturn": _multiturn,
        "serve-fleet": _serve_fleet,
        "quant": plots_features.quant,
        "speculative": plots_features.speculative,
        "tp-scaling": _tp_scaling,
        "matrix": plots_features.matrix,
        "cascade-decode": plots_features.cascade_decode,
        "multiturn-fleet": plots_features.multiturn_fleet,
        "redis-scale": redis_scale_plot.plot,
    }
    draw = draws.get(record.get("kind") or record.get("benchmark", ""))
    if draw is None:  # e.g. kv_quality: a handful of numbers read better as a table
        if required:
            raise ConfigError(f"no plot for a record of kind {record.get('kind')!r}")
        return None
    fig = draw(plt, record)
    machine = record["machine"]
    fig.suptitle(
        f"{record['settings'].get('model', '')} on {machine['device_name']} "
        f"(torch {machine['torch']}, triton {machine['triton']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _throughput(plt: Any, record: dict[str, Any]) -> Any:
    names = ["pagestream"]
    rates = [record["results"]["output_tok_s"]]
    for name, baseline in record.get("baselines", {}).items():
        names.append(name.replace("_", " "))
        rates.append(baseline["output_tok_s"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(names, rates, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    for bar, rate in zip(bars, rates, strict=True):
        ratio = rates[0] / rate
        label = f"{rate:,.0f}" + ("" if bar is bars[0] else f"\n(pagestream x{ratio:.1f})")
        ax.annotate(
            label, (bar.get_x() + bar.get_width() / 2, rate), ha="center", va="bottom", fontsize=8
        )
    settings = record["settings"]
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"{settings['num_prompts']} prompts, input {settings['input_len']}, output {settings['output_len']}",
        fontsize=9,
    )
    ax.set_ylim(0, max(rates) * 1.25)
    return fig


def _latency(plt: Any, record: dict[str, Any]) -> Any:
    results = record["results"]
    batches = [r["batch"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(batches, [r["mean_tpot_s"] * 1e3 for r in results], "o-", label="pagestream")
    if all("limit_tpot_s" in r for r in results):
        limit = [r["limit_tpot_s"] * 1e3 for r in results]
        ax.plot(batches, limit, "k--", label="weights + KV streaming limit")
    if all("vllm" in r for r in results):
        vllm = [r["vllm"]["tpot_s"] * 1e3 for r in results]
        ax.plot(batches, vllm, "s--", color="tab:orange", label="vLLM")
    if all("hf_generate" in r for r in results):
        hf = [r["hf_generate"]["tpot_s"] * 1e3 for r in results]
        ax.plot(batches, hf, "s-", color="tab:gray", label="transformers generate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("time per output token (ms)")
    ax.legend(fontsize=8)
    return fig


def _tp_scaling(plt: Any, record: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lines: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in record["results"]:
        lines[row["model"], row["tensor_parallel_size"]].append(row)
    for (model, size), rows in sorted(lines.items()):
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["tpot_s"] * 1e3 for r in rows], "o-", label=f"{model}, TP{size}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("time per output token (ms)")
    ax.legend(fontsize=8)
    return fig


def _kernels(plt: Any, record: dict[str, Any]) -> Any:
    by_block: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for point in record["results"]:
        by_block[point["block_size"]].append(point)
    fig, axes = plt.subplots(1, len(by_block), figsize=(4 * len(by_block), 3.5), squeeze=False)
    for ax, (block_size, points) in zip(axes[0], sorted(by_block.items()), strict=True):
        by_batch: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for point in points:
            by_batch[point["batch"]].append(point)
        for batch, series in sorted(by_batch.items()):
            series.sort(key=lambda p: p["context"])
            ax.plot(
                [p["context"] for p in series],
                [100 * p["fraction_of_copy"] for p in series],
                "o-",
                label=f"batch {batch}",
            )
        ax.axhline(75, color="k", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        top = max(100 * p["fraction_of_copy"] for p in points)
        ax.set_ylim(0, max(105, top * 1.08))  # decode reads only; a copy reads and writes
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"block size {block_size}", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def _serve(plt: Any, record: dict[str, Any]) -> Any:
    """Throughput through Redis beside the offline engine's; per-request time per output
    token on both sides (what the worker adds); time to first token through Redis."""
    results, offline = record["results"], record.get("offline")
    fig, (rate, tpot, ttft) = plt.subplots(1, 3, figsize=(12, 3.5))
    names, rates = ["through Redis"], [results["output_tok_s"]]
    if offline is not None:
        names.append("offline engine")
        rates.append(offline["output_tok_s"])
    rate.bar(names, rates, color=["tab:blue", "tab:gray"][: len(names)])
    rate.set_ylabel("output tokens / s")
    ratio = results.get("ratio_to_offline")
    rate.set_title(
        f"concurrency {record['settings']['concurrency']}"
        + ("" if ratio is None else f", ratio {ratio:.2f}"),
        fontsize=9,
    )
    labels = [key for key in results["tpot_s"] if key.startswith("p")]
    sides = [("through Redis", results["tpot_s"], "tab:blue")]
    if offline is not None and "tpot_s" in offline:  # records before per-request TPOT lack it
        sides.append(("offline engine", offline["tpot_s"], "tab:gray"))
    width = 0.8 / len(sides)
    for index, (name, cells, color) in enumerate(sides):
        xs = [i + (index - (len(sides) - 1) / 2) * width for i in range(len(labels))]
        tpot.bar(xs, [(cells[key] or 0) * 1e3 for key in labels], width, label=name, color=color)
    tpot.set_xticks(range(len(labels)), labels)
    tpot.set_ylabel("ms")
    added = results.get("added_tpot_p50_ms")
    tpot.set_title("time per output token" + ("" if added is None else f" (+{added:.2f} ms p50)"),
                   fontsize=9)  # fmt: skip
    tpot.legend(fontsize=8)
    ttft.bar(labels, [(results["ttft_s"][key] or 0) * 1e3 for key in labels], color="tab:blue")
    ttft.set_ylabel("ms")
    ttft.set_title("time to first token, through Redis", fontsize=9)
    return fig


def _serve_fleet(plt: Any, record: dict[str, Any]) -> Any:
    """Throughput against the number of workers with the ideal line (N x one worker's),
    efficiency annotated; p50 TTFT and TPOT against the number of workers."""
    rows = record["results"]
    counts = [row["num_workers"] for row in rows]
    cores = record["machine"]["cores_available"]
    with_cpu = all(row.get("busy_cores") for row in rows)
    fig, axes = plt.subplots(1, 3 if with_cpu else 2, figsize=(15 if with_cpu else 10, 3.5))
    rate, latency = axes[0], axes[1]
    rates = [row["output_tok_s"] for row in rows]
    rate.plot(counts, [row["ideal_output_tok_s"] for row in rows], "k--", label="ideal")
    rate.plot(counts, rates, "o-", color="tab:blue", label="measured")
    for count, value, row in zip(counts, rates, rows, strict=True):
        rate.annotate(f"{row['scaling_efficiency']:.2f}", (count, value), textcoords="offset points",
                      xytext=(0, -14), ha="center", fontsize=8)  # fmt: skip
    if cores < counts[-1]:
        rate.axvline(cores, color="tab:red", linewidth=0.8, label=f"{cores} cores")
    rate.set_xticks(counts, [str(c) for c in counts])
    rate.set_ylim(0, max(*rates, rows[-1]["ideal_output_tok_s"]) * 1.15)
    rate.set_xlabel("workers on one stream")
    rate.set_ylabel("output tokens / s")
    rate.set_title(f"{record['settings']['concurrency']} streams per worker; "
                   "scaling efficiency annotated", fontsize=9)  # fmt: skip
    rate.legend(fontsize=8)
    for name, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        latency.plot(counts, [(row[name]["p50"] or 0) * 1e3 for row in rows], "o-", label=label)
    latency.set_xticks(counts, [str(c) for c in counts])
    latency.set_yscale("log")
    latency.set_xlabel("workers on one stream")
    latency.set_ylabel("p50 (ms)")
    latency.legend(fontsize=8)
    if with_cpu:
        _busy_cores(axes[2], rows, cores)
    return fig


def _busy_cores(ax: Any, rows: list[dict[str, Any]], cores: int) -> None:
    """Stacked bars: the cores the workers, the client, Redis and everything else used."""
    labels = [str(row["num_workers"]) for row in rows]
    bottoms = [0.0] * len(rows)
    parts = (("workers", "tab:blue"), ("client", "tab:orange"), ("redis", "tab:red"),
             ("other", "tab:gray"))  # fmt: skip
    for part, color in parts:
        heights = [row["busy_cores"].get(part, 0.0) for row in rows]
        ax.bar(labels, heights, bottom=bottoms, label=part, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.axhline(cores, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlabel("workers on one stream")
    ax.set_ylabel("cores busy during the run")
    ax.set_title("other = every other process on the host", fontsize=9)
    ax.legend(fontsize=8)


def _sweep(plt: Any, record: dict[str, Any]) -> Any:
    """Output tok/s against prompt count, one line per engine, ratios annotated."""
    rows = record["results"]
    counts = [row["num_prompts"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ours = [row["pagestream"]["output_tok_s"] for row in rows]
    ax.plot(counts, ours, "o-", label="pagestream", color="tab:blue")
    if all("vllm" in row for row in rows):
        theirs = [row["vllm"]["output_tok_s"] for row in rows]
        version = record.get("vllm", {}).get("vllm", "")
        ax.plot(counts, theirs, "s--", label=f"vLLM {version}".strip(), color="tab:gray")
        for count, rate, row in zip(counts, ours, rows, strict=True):
            ax.annotate(f"x{row['ratio']:.2f}", (count, rate), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_ylim(0, max(ours + [r.get("vllm", {}).get("output_tok_s", 0) for r in rows]) * 1.2)
    ax.set_xlabel("prompts submitted at once")
    ax.set_ylabel("output tokens / s")
    settings = record["settings"]
    ax.set_title(f"input {settings['input_len']}, output {settings['output_len']}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _multiturn(plt: Any, record: dict[str, Any]) -> Any:
    """Host tier off against on: TTFT percentiles, throughput, prompt tokens by cache tier."""
    results = record["results"]
    runs = [("offload off", results["offload_off"], "tab:gray"),
            ("offload on", results["offload_on"], "tab:blue")]  # fmt: skip
    fig, (ttft, rate, tiers) = plt.subplots(1, 3, figsize=(12, 3.5))
    labels = ["p50", "p90"]
    for index, (name, run, color) in enumerate(runs):
        xs = [i + (index - 0.5) * 0.4 for i in range(len(labels))]
        values = [(run["ttft_s"][key] or 0) * 1e3 for key in labels]
        ttft.bar(xs, values, 0.4, label=name, color=color)
    ttft.set_xticks(range(len(labels)), labels)
    ttft.set_ylabel("ms")
    settings = record["settings"]
    ttft.set_title(f"TTFT: {settings['num_sessions']} sessions x {settings['num_turns']} turns, "
                   f"{settings['concurrency']} at once", fontsize=9)  # fmt: skip
    ttft.legend(fontsize=8)
    rate.bar([name for name, _, _ in runs], [run["total_tok_s"] for _, run, _ in runs],
             color=[color for _, _, color in runs])  # fmt: skip
    rate.set_ylabel("prompt + output tokens / s")
    rate.set_title(f"x{results['total_tok_s_ratio']:.2f} with the host tier", fontsize=9)
    names = [name for name, _, _ in runs]
    device = [run["prefix_cache"]["device_hit_tokens"] for _, run, _ in runs]
    host = [run["prefix_cache"]["host_hit_tokens"] for _, run, _ in runs]
    computed = [
        run["input_tokens"] - d - h for (_, run, _), d, h in zip(runs, device, host, strict=True)
    ]
    tiers.bar(names, device, label="GPU prefix cache", color="tab:green")
    tiers.bar(names, host, bottom=device, label="host tier", color="tab:orange")
    tops = [d + h for d, h in zip(device, host, strict=True)]
    tiers.bar(names, computed, bottom=tops, label="computed", color="tab:gray")
    tiers.set_ylabel("prompt tokens")
    tiers.set_ylim(0, max(top + c for top, c in zip(tops, computed, strict=True)) * 1.4)
    tiers.set_title(f"prompt KV source (host tier {settings['kv_offload_mb']} MiB)", fontsize=9)
    tiers.legend(fontsize=7, loc="upper center", ncol=3)
    return fig
