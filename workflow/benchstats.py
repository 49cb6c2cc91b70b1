"""Decode-benchmark statistics: per-cell summaries, the noise rule, directional claims, the table
and the plot.

A *cell* is one (backend, batch) pair of the decode benchmark. The bench stage measures
`repeats` runs of a fixed prompt and N new tokens; one repeat is recorded as

    {"ttft_ms": 12.3, "first_decode_ms": 4.1, "steady_ms": [3.9, 4.0, ...]}   # N - 2 steady

`ttft_ms` covers start -> every row has its first token, `first_decode_ms` the first -> second
token (kept apart because it still pays warm-up costs), and `steady_ms` the N - 2 remaining
decode intervals; each interval is one batched step producing one token for every row.

Everything here fails closed: a sample that cannot be a real measurement (zero, negative,
NaN, inf, a missing or extra interval) raises BenchError instead of being averaged in, and two
cells are only called "faster"/"slower" when they measured the same thing and the difference
is larger than the run-to-run noise. Nothing here imports the engine or torch.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from workflow.runs import SAME, SHORT, cell_prompts
from workflow.traces import markdown

NOISE = 0.05
"""A cell is noisy when its per-repeat TPOT medians spread by more than this fraction of their
median: (max - min) / median > NOISE."""

MIN_REPEATS = 3
"""Fewer repeats than this cannot tell run-to-run noise from signal, so the cell is noisy."""

FRAME_COLUMNS = [
    "backend", "prompts", "batch", "ttft_p50_ms", "first_decode_p50_ms", "tpot_avg_ms", "tpot_p50_ms",
    "tpot_p95_ms", "tpot_p99_ms", "tpot_max_ms", "tpot_count", "decode_tok_s", "spread", "noisy",
    "first_warmup_over_repeat_s", "floor_ms", "floor_fraction", "floor_MB", "unique_experts_mean",
    "unique_experts_min", "unique_experts_max",
]

MARKDOWN_HEADER = [
    "backend", "prompts", "batch", "steady TPOT p50 (ms)", "TPOT avg (ms)", "p95", "decode tok/s", "floor (ms)",
    "floor / TPOT p50", "unique experts a MoE layer", "noisy",
]

_CELL_KEYS = ("backend", "batch", "contract", "versions", "model", "stats")


class BenchError(ValueError):
    """A benchmark record that cannot be trusted; raised instead of producing a number."""


# --- samples ---------------------------------------------------------------------------------

def _samples(samples, what: str = "samples") -> np.ndarray:
    """Convert to a float array and reject anything that is not a real, positive duration.

    Zero means the timer did not cover the work (or its resolution is too coarse); negative
    means clock misuse; NaN/inf means a broken measurement. Any of them would silently bend an
    average or a percentile, so they stop the stage instead.
    """
    if samples is None or isinstance(samples, (str, bytes, dict)):
        raise BenchError(f"{what}: expected a list of durations, got {type(samples).__name__}")
    try:
        arr = np.asarray(list(samples), dtype=float)
    except (TypeError, ValueError) as exc:
        raise BenchError(f"{what}: not numeric ({exc})") from None
    if arr.ndim != 1:
        raise BenchError(f"{what}: expected a flat list, got shape {arr.shape}")
    if arr.size == 0:
        raise BenchError(f"{what}: no samples")
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BenchError(f"{what}: sample {i} is {arr[i]} (not finite)")
    nonpos = arr <= 0
    if nonpos.any():
        i = int(np.flatnonzero(nonpos)[0])
        raise BenchError(f"{what}: sample {i} is {arr[i]} (<= 0: the timer did not cover the work)")
    return arr


def stats(samples: list[float]) -> dict:
    """count/avg/p50/p95/p99/max/min of positive durations (ms).

    Percentiles use numpy's default (linear interpolation between closest ranks), so any reader
    can recompute them from the raw samples with `np.percentile`.
    """
    arr = _samples(samples)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {
        "count": int(arr.size),
        "avg": float(arr.mean()),
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(arr.max()),
        "min": float(arr.min()),
    }


# --- one cell --------------------------------------------------------------------------------

def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise BenchError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def tok_s(batch: int, steady_ms) -> float:
    """Decode throughput over steady intervals: batch * steps / seconds (a throughput, not 1000 / mean TPOT)."""
    steps = np.asarray(steady_ms, dtype=float)
    return batch * steps.size / (float(steps.sum()) / 1000.0)


def summarize_cell(repeats: list[dict], batch: int, new_tokens: int) -> dict:
    """Validate every repeat of one (backend, batch) cell and summarize it.

    Steady TPOT pools the steady intervals of all repeats (a step is a step, whichever repeat
    it came from). decode_tok_s counts tokens actually produced over the time actually spent:
    batch * steady steps / steady seconds, so it is a throughput, not 1000 / mean TPOT.

    Noise is judged between repeats, not within one: `repeat_tpot_p50` is each repeat's steady
    median and `spread` = (max - min) / median of those. The cell is noisy when spread > NOISE,
    or when it has fewer than MIN_REPEATS repeats: with one or two repeats the spread is not an
    estimate of the noise at all (one repeat always gives 0), so the cell cannot support a
    claim. `spread` is still reported as computed (0.0 for a single repeat), and `noise_reason`
    says why a cell is noisy (None when it is not).
    """
    batch = _positive_int(batch, "batch")
    new_tokens = _positive_int(new_tokens, "new_tokens")
    if new_tokens < 3:
        raise BenchError(f"new_tokens must be >= 3 to have any steady decode interval, got {new_tokens}")
    if not isinstance(repeats, (list, tuple)) or not repeats:
        raise BenchError("no repeats to summarize")
    expected = new_tokens - 2

    ttft, first, steady, per_repeat = [], [], [], []
    for i, rep in enumerate(repeats):
        if not isinstance(rep, dict):
            raise BenchError(f"repeat {i}: expected a dict, got {type(rep).__name__}")
        missing = [k for k in ("ttft_ms", "first_decode_ms", "steady_ms") if k not in rep]
        if missing:
            raise BenchError(f"repeat {i}: missing {', '.join(missing)}")
        s = _samples(rep["steady_ms"], f"repeat {i} steady_ms")
        if s.size != expected:
            raise BenchError(
                f"repeat {i}: {s.size} steady samples, expected {expected} (new_tokens {new_tokens} - 2)"
            )
        ttft.append(float(_samples([rep["ttft_ms"]], f"repeat {i} ttft_ms")[0]))
        first.append(float(_samples([rep["first_decode_ms"]], f"repeat {i} first_decode_ms")[0]))
        steady.append(s)
        per_repeat.append(float(np.median(s)))

    all_steady = np.concatenate(steady)
    decode_tok_s = tok_s(batch, all_steady)
    spread = (max(per_repeat) - min(per_repeat)) / float(np.median(per_repeat))

    if len(repeats) < MIN_REPEATS:
        noisy = True
        noise_reason = (
            f"only {len(repeats)} repeat(s); at least {MIN_REPEATS} are needed to measure run-to-run noise"
        )
    elif spread > NOISE:
        noisy = True
        noise_reason = f"repeat TPOT p50 spread {spread:.4f} > {NOISE}"
    else:
        noisy = False
        noise_reason = None

    return {
        "ttft": stats(ttft),
        "first_decode": stats(first),
        "tpot": stats(all_steady.tolist()),
        "decode_tok_s": float(decode_tok_s),
        "repeat_tpot_p50": per_repeat,
        "spread": float(spread),
        "noisy": noisy,
        "noise_reason": noise_reason,
    }


# --- comparing two cells ---------------------------------------------------------------------

def contract_of(bench: dict) -> dict:
    """What a cell measured: backend, batch, contract, versions and model hashes.

    Two cells are comparable only when these are all equal. A cell document missing any of
    them (or its stats) is malformed and raises, rather than comparing as "unknown == unknown".
    """
    if not isinstance(bench, dict):
        raise BenchError(f"cell document must be a dict, got {type(bench).__name__}")
    missing = [k for k in _CELL_KEYS if k not in bench]
    if missing:
        raise BenchError(f"cell document missing {', '.join(missing)}")
    for key in ("contract", "versions", "model", "stats"):
        if not isinstance(bench[key], dict):
            raise BenchError(f"cell document {key!r} must be a dict, got {type(bench[key]).__name__}")
    return {
        "backend": bench["backend"],
        "batch": bench["batch"],
        "contract": dict(bench["contract"]),
        "versions": dict(bench["versions"]),
        "model": dict(bench["model"]),
    }


def _differing_keys(a: dict, b: dict) -> list[str]:
    """Keys whose values differ, including keys present on one side only."""
    return sorted(str(k) for k in set(a) | set(b) if k not in a or k not in b or a[k] != b[k])


def _pct(current: float, baseline: float) -> float:
    return (current - baseline) / baseline * 100.0


def directional_claim(current: dict, baseline: dict) -> dict:
    """"faster"/"slower" on steady TPOT p50, or "no directional claim" with every reason.

    A claim needs (1) the same backend, batch, contract, versions and model hashes, (2) neither
    cell noisy, and (3) a relative TPOT p50 difference strictly larger than the larger of the two
    cells' spreads. The change percentages are (current - baseline) / baseline; a negative
    tpot_p50_change_pct means current is faster. They are reported whenever the two cells
    measured the same thing (even when noise blocks the claim, so a reader sees how small the
    difference was) and are None when they did not (a percentage between different experiments
    invites exactly the reading this function exists to prevent).
    """
    a, b = contract_of(current), contract_of(baseline)
    reasons: list[str] = []
    if a["backend"] != b["backend"]:
        reasons.append(f"backend differs ({a['backend']} vs {b['backend']})")
    if a["batch"] != b["batch"]:
        reasons.append(f"batch differs ({a['batch']} vs {b['batch']})")
    keys = _differing_keys(a["contract"], b["contract"])
    if keys:
        reasons.append(f"contract differs (keys {', '.join(keys)})")
    keys = _differing_keys(a["versions"], b["versions"])
    if keys:
        reasons.append(f"versions differ ({', '.join(keys)})")
    keys = _differing_keys(a["model"], b["model"])
    if keys:
        reasons.append(f"model differs ({', '.join(keys)})")
    comparable = not reasons

    cs, bs = current["stats"], baseline["stats"]
    if cs.get("noisy", True):
        reasons.append(f"current cell noisy ({cs.get('noise_reason') or 'flagged noisy'})")
    if bs.get("noisy", True):
        reasons.append(f"baseline cell noisy ({bs.get('noise_reason') or 'flagged noisy'})")

    tpot_pct = tok_pct = None
    if comparable:
        cur_p50, base_p50 = float(cs["tpot"]["p50"]), float(bs["tpot"]["p50"])
        tpot_pct = _pct(cur_p50, base_p50)
        tok_pct = _pct(float(cs["decode_tok_s"]), float(bs["decode_tok_s"]))
        if not reasons:
            noise = max(float(cs["spread"]), float(bs["spread"]))
            if abs(tpot_pct) / 100.0 <= noise:
                reasons.append(
                    f"difference within noise (|{tpot_pct:+.2f}%| <= spread {noise * 100:.2f}%)"
                )

    if reasons:
        return {"claim": "no directional claim", "tpot_p50_change_pct": tpot_pct,
                "tok_s_change_pct": tok_pct, "reason": "; ".join(reasons)}
    return {"claim": "faster" if tpot_pct < 0 else "slower", "tpot_p50_change_pct": tpot_pct,
            "tok_s_change_pct": tok_pct, "reason": None}


# --- table, markdown, plot -------------------------------------------------------------------

def summary_frame(cells: list[dict]):
    """One row per cell in FRAME_COLUMNS order, sorted by backend, prompt contract (workflow.runs: same-prompt
    first, then distinct-prompts), then batch; the floor columns from the cell's `floor`
    (workflow.floor.bench_floor; empty for a cell that predates it).

    Fails on no cells or on a repeated (backend, prompts, batch): either would make a table or a plot
    line that silently shows something other than one measurement per point.
    """
    import pandas as pd

    if not cells:
        raise BenchError("no cells to summarize")
    rows, seen = [], set()
    for cell in cells:
        for k in ("backend", "batch", "stats"):
            if k not in cell:
                raise BenchError(f"cell document missing {k}")
        key = (cell["backend"], cell_prompts(cell), cell["batch"])
        if key in seen:
            raise BenchError(f"duplicate cell backend={key[0]} prompts={key[1]} batch={key[2]}")
        seen.add(key)
        s = cell["stats"]
        fl = cell.get("floor") or {}
        unique = fl.get("unique_experts") or {}
        rows.append({
            "backend": str(cell["backend"]),
            "prompts": key[1],
            "batch": int(cell["batch"]),
            "ttft_p50_ms": s["ttft"]["p50"],
            "first_decode_p50_ms": s["first_decode"]["p50"],
            "tpot_avg_ms": s["tpot"]["avg"],
            "tpot_p50_ms": s["tpot"]["p50"],
            "tpot_p95_ms": s["tpot"]["p95"],
            "tpot_p99_ms": s["tpot"]["p99"],
            "tpot_max_ms": s["tpot"]["max"],
            "tpot_count": int(s["tpot"]["count"]),
            "decode_tok_s": s["decode_tok_s"],
            "spread": s["spread"],
            "noisy": bool(s["noisy"]),
            # a compile's time, apart from the steady figures (cells of older evidence lack it)
            "first_warmup_over_repeat_s": cell.get("first_warmup_over_repeat_s"),
            "floor_ms": fl.get("floor_ms"), "floor_fraction": fl.get("floor_fraction"),
            "floor_MB": fl["bytes"]["total"] / 1e6 if fl.get("bytes") else None,
            "unique_experts_mean": unique.get("mean"), "unique_experts_min": unique.get("min"),
            "unique_experts_max": unique.get("max"),
        })
    frame = pd.DataFrame(rows, columns=FRAME_COLUMNS)
    same_first = lambda col: col.map(lambda v: v != SAME) if col.name == "prompts" else col  # noqa: E731
    return frame.sort_values(["backend", "prompts", "batch"], kind="mergesort", key=same_first).reset_index(drop=True)


def _known(v) -> bool:
    return v is not None and v == v  # a CSV's empty field reads back as NaN


def markdown_table(frame) -> str:
    """The SUMMARY.md bench table, one row per cell, in the frame's order: each figure with its prompt contract
    (`same`, `distinct`) and its floor beside it (— where the cell has none)."""
    rows = [[str(r.backend), SHORT.get(r.prompts, str(r.prompts)), str(int(r.batch)),
             f"{r.tpot_p50_ms:.3f}", f"{r.tpot_avg_ms:.3f}", f"{r.tpot_p95_ms:.3f}", f"{r.decode_tok_s:.1f}",
             f"{r.floor_ms:.3f}" if _known(r.floor_ms) else "—",
             f"{100 * r.floor_fraction:.0f}%" if _known(r.floor_fraction) else "—",
             f"{r.unique_experts_mean:.1f} ({r.unique_experts_min:.0f}–{r.unique_experts_max:.0f})"
             if _known(r.unique_experts_mean) else "—",
             "yes" if r.noisy else "no"]
            for r in frame.itertuples(index=False)]
    return markdown(MARKDOWN_HEADER, rows) + "\n"


def plot(frame, path: str | Path) -> Path:
    """Two panels (decode tok/s vs batch, steady TPOT p50 vs batch), one line per backend and prompt contract
    (a distinct-prompts line, dashed, is named `<backend> distinct`).

    Uses a bare Figure on the Agg canvas (no pyplot global state, no backend switch for the
    rest of the process) and strips the PNG "Software" text chunk so the same frame always gives
    the same bytes; the file is written atomically.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from workflow.evidence import write_bytes

    if len(frame) == 0:
        raise BenchError("nothing to plot")
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_tok, ax_tpot = fig.subplots(1, 2)
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    batches = sorted(int(b) for b in frame["batch"].unique())
    lines = frame.sort_values(["backend", "prompts", "batch"]).groupby(["backend", "prompts"], sort=True)
    for i, ((backend, prompts), group) in enumerate(lines):
        m = markers[i % len(markers)]
        name = str(backend) + ("" if prompts == SAME else f" {SHORT.get(prompts, prompts)}")
        style = "-" if prompts == SAME else "--"
        ax_tok.plot(group["batch"], group["decode_tok_s"], style, marker=m, label=name)
        ax_tpot.plot(group["batch"], group["tpot_p50_ms"], style, marker=m, label=name)
    for ax, ylabel, title in (
        (ax_tok, "decode throughput (tokens/s)", "Decode throughput vs batch"),
        (ax_tpot, "steady TPOT p50 (ms/step)", "Steady TPOT p50 vs batch"),
    ):
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xticks(batches)
        ax.grid(True, alpha=0.3)
        ax.legend(title="backend")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, metadata={"Software": None})
    return write_bytes(path, buf.getvalue())
