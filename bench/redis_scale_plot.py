"""The plot of a ``redis-scale`` record (``bench.plots`` draws it)."""

from __future__ import annotations

from typing import Any


def plot(plt: Any, record: dict[str, Any]) -> Any:
    """Tokens/s of each setup (the ratio and the ideal N x single marked) and each
    primary's busy fraction."""
    rows = record["results"]
    names = [f"{row['redis']}\n({row['primaries']} primar{'ies' if row['primaries'] > 1 else 'y'}"
             f"{')' + chr(10) + 'home shards' if row.get('readers_home_shards') else ')'}"
             for row in rows]  # fmt: skip
    colors = ["tab:gray", "tab:blue", "tab:green"][: len(rows)]
    fig, (rate, busy) = plt.subplots(1, 2, figsize=(10, 3.5))
    rates = [row["tokens_per_s"] for row in rows]
    rate.bar(names, rates, color=colors)
    ideal = rates[0] * rows[1]["primaries"]
    rate.axhline(ideal, color="k", linestyle="--", linewidth=0.8, label="primaries x single")
    rate.axhline(rates[0] * record["targets"]["ratio_at_least"], color="tab:red",
                 linewidth=0.8, label="target")  # fmt: skip
    rate.set_ylabel("tokens / s (read end to end)")
    title = f"cluster / single: {record['ratio']:.2f}x"
    if record.get("ratio_home_shards") is not None:
        title += f", readers on home shards {record['ratio_home_shards']:.2f}x"
    rate.set_title(title, fontsize=9)
    rate.legend(fontsize=8)
    for index, row in enumerate(rows):
        fractions = row["redis_cpu_busy_by_primary"]
        label = "homed" if row.get("readers_home_shards") else row["redis"]
        busy.bar([f"{label} {i}" for i in range(len(fractions))], fractions,
                 color=colors[index])  # fmt: skip
    busy.tick_params(axis="x", labelrotation=45, labelsize=8)
    busy.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    busy.set_ylabel("primary's CPU busy (1 = a core)")
    return fig
