"""The PNG of a campaign's trend (workflow/archive/trend.py's frame): each bench cell's line over the directories, its band
shaded, its regressions marked, its noise ringed (trend.unsteady: a noisy cell, a comparison the machine probe
refused), and the gate verdicts in a strip under it. `evident trend` and the archive's
trends pages (workflow/archive/trend_page.py) write it, through trend.write.
"""

from __future__ import annotations

from pathlib import Path

from evident.workflow.core.gates import GATES, NOT_RUN
from evident.workflow.core.plots import figure, save_png
from evident.workflow.plan.runs import label_key


def plot(frame, path: str | Path, title: str, ylabel: str, unsteady=lambda row: False) -> Path:
    """One line per cell (x: the directories in order, labelled by commit) with its band shaded, regressions
    marked, the points `unsteady(row)` says are noise ringed, and a strip of gate verdicts under it (Gate.state:
    green passes, red fails the run, grey not run or measured nothing). Bare Figure on the Agg canvas, no
    "Software" chunk (same frame, same bytes), written atomically."""
    dirs = frame.drop_duplicates("order").sort_values("order")
    xs, labels = list(dirs["order"]), [f"{c}" for c in dirs["commit"]]
    gates = [g for g in GATES if (dirs[f"gate_{g.name}"].astype(object).fillna("") != "").any()]
    fig = figure(figsize=(max(9.0, 4.5 + 0.55 * len(xs)), 4.8 + 0.32 * len(gates)))
    if gates:
        ax, strip = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [4.0, 0.35 * len(gates) + 0.3]})
    else:
        ax, strip = fig.subplots(1, 1), None
    cells = frame[frame["cell"].astype(object).fillna("") != ""]
    flagged, ringed = [], []
    for name in sorted(cells["cell"].unique(), key=label_key):
        c = cells[(cells["cell"] == name) & cells["value"].notna()].sort_values("order")
        if c.empty:
            continue
        line, = ax.plot(c["order"], c["value"], marker="o", markersize=4, label=name)
        banded = c[c["band_lo"].notna() & c["band_hi"].notna()]
        if len(banded):
            ax.fill_between(banded["order"].astype(float), banded["band_lo"].astype(float),
                            banded["band_hi"].astype(float), color=line.get_color(), alpha=0.18, linewidth=0)
            ax.errorbar(banded["order"], banded["value"], fmt="none", ecolor=line.get_color(), alpha=0.6,
                        yerr=[(banded["value"] - banded["band_lo"]).astype(float),
                              (banded["band_hi"] - banded["value"]).astype(float)], capsize=2, linewidth=0.8)
        flagged.append(c[c["regression"]])
        ringed += [(r["order"], r["value"]) for r in c.to_dict("records") if unsteady(r)]
    bad = [b for b in flagged if len(b)]
    if bad:
        ax.scatter([x for b in bad for x in b["order"]], [v for b in bad for v in b["value"]], marker="X", s=90,
                   color="#cf222e", zorder=5, label="regression (slower beyond the noise)")
    if ringed:
        ax.scatter(*zip(*ringed), s=110, facecolors="none", edgecolors="#57606a", linewidths=1.2, zorder=4,
                   label="noise: a noisy cell or the machine differed (no claim)")
    if cells.empty:
        ax.text(0.5, 0.5, "no bench cells in these directories", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.set_xticks(xs)
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    bottom = ax
    if strip is not None:
        colors = {"pass": "#2da44e", "fail": "#cf222e", NOT_RUN: "#d0d7de"}
        for j, g in enumerate(gates):
            for x, v in zip(dirs["order"], dirs[f"gate_{g.name}"].astype(object).fillna("")):
                strip.scatter([x], [j], marker="s", s=110, color=colors[g.state(v)])
        strip.set_yticks(range(len(gates)))
        strip.set_yticklabels([g.name for g in gates], fontsize=8)
        strip.set_ylim(-0.6, len(gates) - 0.4)
        strip.set_xlabel("gates: green passes, red fails the run, grey not run or measured nothing", fontsize=8)
        bottom = strip
    bottom.set_xticks(xs)
    bottom.set_xticklabels(labels, rotation=45 if len(xs) > 6 else 0, ha="right" if len(xs) > 6 else "center",
                           fontsize=8)
    fig.tight_layout()
    return save_png(fig, path, dpi=110)
