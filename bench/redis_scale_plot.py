"""The plot of a ``redis-scale`` record (``bench.plots`` draws it)."""

from __future__ import annotations

from typing import Any


def plot(plt: Any, record: dict[str, Any]) -> Any:
    """Tokens/s of each setup (the ratio and the ideal N x single marked) and each
    primary's busy fraction."""
    rows = record["results"]
    names = [f"{row['redis']}\n({row['primaries']} primaries)" for row in rows]
    fig, (rate, busy) = plt.subplots(1, 2, figsize=(10, 3.5))
    rates = [row["tokens_per_s"] for row in rows]
    rate.bar(names, rates, color=["tab:gray", "tab:blue"])
    ideal = rates[0] * rows[1]["primaries"]
    rate.axhline(ideal, color="k", linestyle="--", linewidth=0.8, label="primaries x single")
    rate.axhline(rates[0] * record["targets"]["ratio_at_least"], color="tab:red",
                 linewidth=0.8, label="target")  # fmt: skip
    rate.set_ylabel("tokens / s (read end to end)")
    rate.set_title(f"cluster / single: {record['ratio']:.2f}x", fontsize=9)
    rate.legend(fontsize=8)
    for index, row in enumerate(rows):
        fractions = row["redis_cpu_busy_by_primary"]
        busy.bar([f"{row['redis']} {i}" for i in range(len(fractions))], fractions,
                 color="tab:gray" if index == 0 else "tab:blue")  # fmt: skip
    busy.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    busy.set_ylabel("primary's CPU busy (1 = a core)")
    return fig
