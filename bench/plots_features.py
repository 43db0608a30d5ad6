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
    missing a side are left out. A profiled matrix (``--profile-every``) marks each row's
    ``kernel_ceiling`` and adds, per row, both sides' kernel seconds stacked by kind."""
    from bench.kernel_sample import kernel_ceiling

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
    ceiling_label = f"ceiling with {peer}'s GEMM / attention speed"
    for index, model in enumerate(models):
        cells = {row["workload"]: row for row in rows if row["model"] == model}
        xs = [i + (index - (len(models) - 1) / 2) * width for i, w in enumerate(workloads)
              if w in cells]  # fmt: skip
        values = [cells[w]["speedup"] for w in workloads if w in cells]
        bars = ax.bar(xs, values, width, label=model)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=6)  # fmt: skip
        for x, w in zip(xs, [w for w in workloads if w in cells], strict=True):
            theirs = cells[w].get(peer, {}).get("kernel_profile")
            ceiling = kernel_ceiling(theirs) if theirs else None  # records made before the field
            if ceiling is not None:
                ax.plot([x - width / 2, x + width / 2], [ceiling, ceiling], color="k",
                        linestyle=":", linewidth=1.2, label=ceiling_label)  # fmt: skip
                ceiling_label = "_nolegend_"
    target = record["targets"]["output_tok_s"]
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"pagestream / {peer}\n(TPOT rows: {peer} TPOT / ours)", fontsize=8)
    if profiled:  # the profiler slows each side by its own amount: these are not the rows'
        ax.set_title("ratios of the profiled runs (not the rows'); the ceilings", fontsize=8)
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


def cascade_decode(plt: Any, record: dict[str, Any]) -> Any:
    """Per model's heads: the cascade's speedup over the plain decode by batch size, one line
    per prefix length (``bench.cascade_decode``; the steps of one prefix)."""
    rows = [row for row in record["results"] if row.get("groups", 1) == 1]
    models = list(dict.fromkeys(row["model"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [row for row in rows if row["model"] == model]
        for prefix in sorted({row["prefix"] for row in mine}):
            line = sorted((row["batch"], row["speedup"]) for row in mine if row["prefix"] == prefix)
            ax.plot([str(b) for b, _ in line], [x for _, x in line], marker="o",
                    label=f"{prefix:,}-token prefix")  # fmt: skip
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"{model}'s heads", fontsize=9)
        ax.set_xlabel("decodes in the step")
        ax.set_ylabel("plain decode time / cascade's")
        ax.legend(fontsize=7)
    return fig


FLEET_PARTS = (  # TTFT p50 parts of a multiturn-fleet row, bottom to top
    ("submit", "client's route", "tab:purple"),
    ("queue", "queue", "tab:orange"),
    ("engine", "engine", "tab:blue"),
    ("rest", "rest", "tab:gray"),
)


def multiturn_fleet(plt: Any, record: dict[str, Any]) -> Any:
    """Shared group against routing, per worker count: TTFT p50 (split into its parts where the
    row has them, p90 marked), the prefix hit rate and output tokens/s."""
    rows = record["rows"]
    counts = sorted({row["workers"] for row in rows})
    modes = [mode for mode in ("shared", "routed") if any(row["mode"] == mode for row in rows)]
    by = {(row["mode"], row["workers"]): row for row in rows}
    fig, (ttft, hits, rate) = plt.subplots(1, 3, figsize=(12, 3.5))
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        xs = [i + (index - (len(modes) - 1) / 2) * width for i in range(len(counts))]
        present = [(x, by[(mode, n)]) for x, n in zip(xs, counts, strict=True) if (mode, n) in by]
        _ttft_bars(ttft, present, width, labelled=index == 0)
        for x, _ in present:
            ttft.annotate(mode, (x, 0), ha="center", va="bottom", fontsize=6, rotation=90,
                          color="white")  # fmt: skip
        hatch = "" if mode == "shared" else "//"
        hits.bar([x for x, _ in present], [row["prefix_hit_rate"] for _, row in present], width,
                 label=mode, color="tab:green", hatch=hatch, edgecolor="black")  # fmt: skip
        rate.bar([x for x, _ in present], [row["output_tok_s"] for _, row in present], width,
                 label=mode, color="tab:blue", hatch=hatch, edgecolor="black")  # fmt: skip
    workload = record["settings"]["workload"]
    ttft.set_title(f"TTFT p50 (p90 marked): {workload['num_sessions']} sessions x "
                   f"{workload['num_turns']} turns, {workload['concurrency']} at once",
                   fontsize=9)  # fmt: skip
    ttft.set_ylabel("ms")
    ttft.legend(fontsize=7)
    hits.set_title("prefix hit rate", fontsize=9)
    hits.set_ylim(0, 1)
    rate.set_title("output tokens / s", fontsize=9)
    for ax in (ttft, hits, rate):
        ax.set_xticks(range(len(counts)), [f"{n} worker{'s' * (n > 1)}" for n in counts])
    hits.legend(fontsize=7)
    return fig


def _ttft_bars(ax: Any, present: list[tuple[float, dict[str, Any]]], width: float,
               labelled: bool) -> None:  # fmt: skip
    """One mode's TTFT p50 bars, stacked by part where the rows split it, and p90 ticks."""
    xs = [x for x, _ in present]
    if all(row.get("ttft_parts_p50_s") for _, row in present):
        bottoms = [0.0] * len(present)
        # rows before the client's part was split out hold it in their queue
        parts = [
            p for p in FLEET_PARTS if all(p[0] in row["ttft_parts_p50_s"] for _, row in present)
        ]
        for key, label, color in parts:
            values = [row["ttft_parts_p50_s"].get(key, 0.0) * 1e3 for _, row in present]
            ax.bar(xs, values, width, bottom=bottoms, color=color,
                   label=label if labelled else None)  # fmt: skip
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    else:
        ax.bar(xs, [row["ttft_s"]["p50"] * 1e3 for _, row in present], width, color="tab:blue",
               label="p50" if labelled else None)  # fmt: skip
    ax.scatter(xs, [row["ttft_s"]["p90"] * 1e3 for _, row in present], marker="_", s=200,
               color="black", label="p90" if labelled else None)  # fmt: skip
