"""Plots of the feature benchmarks: quantized weights (``quant``) and speculative decoding
(``speculative``) against the plain engine, and the workload ``matrix`` against a peer. Called
by ``bench.plots.plot_record``."""

from __future__ import annotations

from typing import Any


def quant(plt: Any, record: dict[str, Any]) -> Any:
    """Per format: weights, batch-1 time per token and throughput, each beside the float one."""
    results = record["results"]
    names = list(results)
    colors = ["tab:gray"] + ["tab:blue"] * (len(names) - 1)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    panels = [
        ("weights (GB)", [r["weights_gb"] for r in results.values()]),
        ("batch-1 time per output token (ms)",
         [r["batch1"]["mean_tpot_s"] * 1e3 for r in results.values()]),
        ("output tokens / s", [(r.get("throughput") or {}).get("output_tok_s", 0.0)
                               for r in results.values()]),
    ]  # fmt: skip
    reference = names[0]
    for ax, (label, values) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=colors)
        for bar, value in zip(bars, values, strict=True):
            ratio = value / values[0] if values[0] else 0.0
            text = f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
            ax.annotate(f"{text}\n(x{ratio:.2f})", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_ylim(0, max(values) * 1.3 or 1)
        ax.set_title(label, fontsize=9)
    axes[0].set_ylabel(f"against {reference}")
    return fig


def speculative(plt: Any, record: dict[str, Any]) -> Any:
    """Per batch size: output tok/s without and with drafts, and the acceptance rate."""
    rows = record["results"]
    batches = [str(row["batch"]) for row in rows]
    fig, (rate, accepted) = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.4
    xs = range(len(rows))
    rate.bar([x - width / 2 for x in xs], [row["plain"]["output_tok_s"] for row in rows],
             width, label="plain", color="tab:gray")  # fmt: skip
    rate.bar([x + width / 2 for x in xs], [row["speculative"]["output_tok_s"] for row in rows],
             width, label="speculative", color="tab:blue")  # fmt: skip
    for x, row in zip(xs, rows, strict=True):
        top = max(row["plain"]["output_tok_s"], row["speculative"]["output_tok_s"])
        rate.annotate(f"x{row['speedup_tok_s']:.2f}", (x, top), ha="center", va="bottom",
                      fontsize=8)  # fmt: skip
    rate.set_xticks(list(xs), batches)
    rate.set_xlabel("batch size")
    rate.set_ylabel("output tokens / s")
    rate.legend(fontsize=8)
    k = record["settings"].get("num_speculative_tokens_resolved")
    rate.set_title(f"{record['settings'].get('speculative', '')} drafts, K={k}", fontsize=9)
    accepted.bar(batches, [100 * (row["acceptance_rate"] or 0.0) for row in rows],
                 color="tab:green")  # fmt: skip
    accepted.set_xlabel("batch size")
    accepted.set_ylabel("% of draft tokens accepted")
    accepted.set_ylim(0, 105)
    return fig


def matrix(plt: Any, record: dict[str, Any]) -> Any:
    """Per workload, one bar per model: how far ahead of the peer pagestream is (``speedup``:
    the tok/s ratio, or the peer's TPOT over ours), with the 1.0 and target lines. Rows still
    missing a side are left out. A profiled matrix (``--profile-every``) adds, per row, both
    sides' kernel seconds stacked by kind."""
    rows = [row for row in record["results"] if "speedup" in row]
    peer = record["peer"] or "peer"
    profiled = [
        row
        for row in rows
        if "kernel_profile" in row.get("pagestream", {}) and "kernel_profile" in row.get(peer, {})
    ]
    workloads = list(dict.fromkeys(row["workload"] for row in record["results"]))
    models = record["settings"]["models"]
    width_in = max(6.0, 0.9 * len(workloads) + 2)
    if profiled:
        fig, (ax, kinds_ax) = plt.subplots(1, 2, figsize=(width_in + 1.2 * len(profiled) + 2, 3.8))
        _kernel_kinds(kinds_ax, profiled, peer)
    else:
        fig, ax = plt.subplots(figsize=(width_in, 3.8))
    width = 0.8 / max(len(models), 1)
    for index, model in enumerate(models):
        cells = {row["workload"]: row["speedup"] for row in rows if row["model"] == model}
        xs = [i + (index - (len(models) - 1) / 2) * width for i, w in enumerate(workloads)
              if w in cells]  # fmt: skip
        values = [cells[w] for w in workloads if w in cells]
        bars = ax.bar(xs, values, width, label=model)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=6)  # fmt: skip
    target = record["targets"]["output_tok_s"]
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"pagestream / {peer}\n(TPOT rows: {peer} TPOT / ours)", fontsize=8)
    top = max([row["speedup"] for row in rows] + [target])
    ax.set_ylim(0, top * 1.15)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _kernel_kinds(ax: Any, rows: list[dict[str, Any]], peer: str) -> None:
    """Two stacked bars a row (pagestream, then the peer): estimated kernel seconds by kind."""
    from bench.kernel_sample import CATEGORIES

    labels, stacks = [], []
    for row in rows:
        for side in ("pagestream", peer):
            labels.append(f"{row['model']} {row['workload']}\n{side}")
            stacks.append(row[side]["kernel_profile"]["categories_s"])
    bottoms = [0.0] * len(stacks)
    for kind in CATEGORIES:
        heights = [stack.get(kind, 0.0) for stack in stacks]
        if any(heights):
            ax.bar(range(len(stacks)), heights, 0.7, bottom=bottoms, label=kind)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(stacks)), labels, rotation=30, ha="right", fontsize=6)
    ax.set_ylabel("kernel seconds over the run (sampled steps, scaled)", fontsize=8)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
