"""Two evidence directories side by side: what limits the comparison, verdicts, bench cells and metrics.

Plain data in and out (the CLI prints it, `evident diff A B`). A is the baseline, B the run under review.
"""

from __future__ import annotations

import math

from evident.workflow.archive.archive import Evidence, as_dict
from evident.workflow.bench import benchstats
from evident.workflow.core import layout
from evident.workflow.core.evidence import flatten
from evident.workflow.plan.runs import cell_label, cell_prompts, is_http, is_rate, label_key, run_name

IGNORED_CONFIG_KEYS = {"repeat", "bench.baseline"}
"""Config keys that differ between comparable runs by design: they do not limit a comparison."""


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def bench_cells(ev: Evidence) -> dict[str, list[tuple[str, dict]]]:
    """Bench cells by label (`single-graph-b8`, runs.label): the run name carries the decode path and the label the
    prompt contract, so two paths, or the same-prompt and distinct-prompts cells (`single-graph-distinct-b8`), at one
    backend and batch are two cells. A record without `kernels` predates it: the torch path; without a prompt
    contract: same-prompt. A cell of the benchmark over HTTP is labelled by its target and concurrency
    (`http-engine-c4`, runs.http_cell), never as an in-process one; a cell of its rate rung by its target and rate
    (`http-engine-r2`, runs.rate_cell). Every file that claims a cell is kept, so that two of them are reported, not
    one silently chosen."""
    cells: dict[str, list[tuple[str, dict]]] = {}
    for p in sorted((ev.path / layout.BENCH).glob("*.json")):
        cell = ev.read(layout.bench_cell(p.stem))
        if is_http(cell) or is_rate(cell) or isinstance(cell, dict) and "backend" in cell and "batch" in cell:
            try:
                key = cell_label(cell)
            except (TypeError, ValueError, OverflowError, KeyError):
                continue
            cells.setdefault(key, []).append((p.name, cell))
    return cells


def identity(cell: dict) -> dict:
    """What a diff or trend row says a cell is: backend, path, prompt contract and batch, or (HTTP; backend and batch
    None) target, path (the builtin engine's), prompt contract and concurrency, or (the rate rung) its rate."""
    if is_http(cell) or is_rate(cell):
        return {"backend": None, "kernels": cell.get("kernels"), "prompts": cell_prompts(cell), "batch": None,
                "target": str(cell["target"]), "concurrency": int(cell["concurrency"]) if is_http(cell) else None,
                "rate": float(cell["rate"]) if is_rate(cell) else None}
    return {"backend": str(cell["backend"]), "kernels": str(cell.get("kernels", "torch")), "prompts": cell_prompts(cell),
            "batch": int(cell["batch"]), "target": None, "concurrency": None, "rate": None}


def tok_s(cell: dict | None) -> float | None:
    """A cell's tokens a second (benchstats.throughput), None where it has none."""
    try:
        return number(benchstats.throughput(cell["stats"]))
    except (KeyError, TypeError, ValueError):
        return None


def _ratio(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


def _stat(cell: dict | None, *keys):
    try:
        v = cell["stats"]
        for k in keys:
            v = v[k]
        return float(v)
    except (KeyError, TypeError, ValueError):
        return None


def bench_diff(a: Evidence, b: Evidence) -> list[dict]:
    """Per bench cell (`cell`: its run name and batch, `single-graph-b8`): both TPOT p50 and tok/s, their change
    and ratio B/A, and bench_report's directional claim (A is the baseline, B the current run): a claim only
    where contract, versions and model match, neither cell is noisy, the machine probes agree and the change
    passes the minimum effect (`probe_ratio`: B's probe over A's). Changes and ratios only where the two
    cells measured the same thing (as benchstats.directional_claim says), None otherwise."""
    ca, cb = bench_cells(a), bench_cells(b)
    out = []
    for key in sorted(set(ca) | set(cb), key=label_key):
        xs, ys = ca.get(key, []), cb.get(key, [])
        x, y = (xs[0][1] if xs else None), (ys[0][1] if ys else None)
        several = [f"{side} has {len(files)} files for this cell ({', '.join(n for n, _ in files)})"
                   for side, files in (("A", xs), ("B", ys)) if len(files) > 1]
        if several:
            claim = no_claim("; ".join(several))
        elif x is None or y is None:
            claim = no_claim(f"only in {'B' if x is None else 'A'}")
        else:
            claim = cell_claim(y, x)
        either = y if y is not None else x
        row = {"cell": key, **identity(either),
               "a_tpot_p50_ms": _stat(x, "tpot", "p50"), "b_tpot_p50_ms": _stat(y, "tpot", "p50"),
               "a_tok_s": tok_s(x), "b_tok_s": tok_s(y), **claim}
        rate = is_rate(either)
        # a rate cell's ratios stand where the two measured the same thing, though neither side has a noise estimate
        same = claim["reason"] == ONE_RUN if rate else claim["tpot_p50_change_pct"] is not None
        row["tpot_p50_ratio"] = _ratio(row["b_tpot_p50_ms"], row["a_tpot_p50_ms"]) if same else None
        row["tok_s_ratio"] = _ratio(row["b_tok_s"], row["a_tok_s"]) if same else None
        if rate:
            row["figures"] = rate_figures(x, y, same)
            if x is not None and y is not None and not several:  # the terminal shows the reason: every figure in it
                row["reason"] += ". " + figures_text(row["figures"])
        out.append(row)
    return out


ONE_RUN = "one run a rate, no noise estimate"
"""Why two comparable cells of the rate rung make no directional claim: each rate runs once, no repeats (trend reads
it)."""

RATE_FIGURES = {  # a rate cell's figures a diff compares: (the name it prints, its unit, where in `stats`)
    "completed": ("completed", "", ("completed",)),
    "ttft_p50_ms": ("TTFT p50", " ms", ("ttft", "p50")), "ttft_p99_ms": ("TTFT p99", " ms", ("ttft", "p99")),
    "tpot_p50_ms": ("TPOT p50", " ms", ("tpot", "p50")), "tpot_p99_ms": ("TPOT p99", " ms", ("tpot", "p99")),
    "output_tok_s": ("output tok/s", "", ("output_tok_s",)), "goodput": ("goodput", "/s", ("goodput",)),
}


def rate_claim(current: dict, baseline: dict) -> dict:
    """Two cells of the rate rung (`http-<target>-r<R>`): never a directional claim, since a rate is run once and so
    has no noise estimate (the reason ONE_RUN, with the changes, where they measured the same thing); where their
    contracts (SLO, requests, seed, prompt, ...), versions or model differ, what differs and no change."""
    reasons = []
    for key, what in (("contract", "contract differs (keys {})"), ("versions", "versions differ ({})"),
                      ("model", "model differs ({})")):
        if not isinstance(current.get(key), dict) or not isinstance(baseline.get(key), dict):
            return no_claim(f"malformed cell: no {key}")
        if keys := _changed(current[key], baseline[key]):
            reasons.append(what.format(", ".join(keys)))
    if reasons:
        return no_claim("; ".join(reasons))
    pct = lambda b, a: None if a is None or b is None or a == 0 else (b - a) / a * 100.0  # noqa: E731
    return {**no_claim(ONE_RUN), "tpot_p50_change_pct": pct(_stat(current, "tpot", "p50"), _stat(baseline, "tpot", "p50")),
            "tok_s_change_pct": pct(tok_s(current), tok_s(baseline))}


def rate_figures(a: dict | None, b: dict | None, same: bool) -> dict:
    """Each of RATE_FIGURES on both sides, and B/A where the two measured the same thing (`same`); `requests` beside
    `completed`. A rate where nothing completed has no percentile (None)."""
    out = {}
    for name, (_, _, keys) in RATE_FIGURES.items():
        x, y = _stat(a, *keys), _stat(b, *keys)
        out[name] = {"a": x, "b": y, "ratio": _ratio(y, x) if same and name != "completed" else None}
    out["completed"].update(a_requests=_stat(a, "requests"), b_requests=_stat(b, "requests"))
    return out


def figures_text(figures: dict) -> str:
    """A rate row's figures in words, A → B (B/A): what the terminal's footnote prints."""
    def v(x, unit=""):
        return "—" if x is None else f"{x:.4g}{unit}"

    c = figures["completed"]
    parts = [f"completed {v(c['a'])}/{v(c['a_requests'])} → {v(c['b'])}/{v(c['b_requests'])}"]
    for name, (what, unit, _) in RATE_FIGURES.items():
        f = figures[name]
        if name != "completed" and (f["a"] is not None or f["b"] is not None):
            parts.append(f"{what} {v(f['a'])} → {v(f['b'], unit)}" + (f" ({f['ratio']:.3f})" if f["ratio"] is not None else ""))
    ratios = any(f.get("ratio") is not None for f in figures.values())
    return ("A → B (B/A): " if ratios else "A → B: ") + ", ".join(parts)


no_claim = benchstats.no_claim


def cell_claim(current: dict, baseline: dict) -> dict:
    """benchstats.directional_claim (rate_claim for the rate rung's cells), a malformed cell being no claim rather
    than an error."""
    if is_rate(current) or is_rate(baseline):
        return rate_claim(current, baseline)
    try:
        return benchstats.directional_claim(current, baseline)
    except (benchstats.BenchError, KeyError, TypeError, ValueError, AttributeError) as e:
        return no_claim(f"malformed cell: {e}")


def number(v) -> float | None:
    """v as a float where it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def metric_diff(a: Evidence, b: Evidence) -> list[dict]:
    """Every stage metric (what MLflow shows) side by side. Single values carry no noise estimate, so
    they make no directional claim; the bench cells above do."""
    ma = {f"{r['name']}.{k}": v for r in a.records for k, v in r.get("metrics", {}).items()}
    mb = {f"{r['name']}.{k}": v for r in b.records for k, v in r.get("metrics", {}).items()}
    out = []
    for k in sorted(set(ma) | set(mb)):
        x, y = number(ma.get(k)), number(mb.get(k))
        delta = None if x is None or y is None else y - x
        pct = None if delta is None or x == 0 else delta / abs(x) * 100.0
        out.append({"metric": k, "a": ma.get(k), "b": mb.get(k), "delta": delta, "delta_pct": pct})
    return out


def verdict_diff(a: Evidence, b: Evidence) -> list[dict]:
    """Gate verdicts, stage outcomes and parity cells, wherever A and B differ."""
    out = []
    ga, gb = a.gates, b.gates
    for k in sorted(set(ga) | set(gb)):
        if ga.get(k) != gb.get(k):
            out.append({"what": f"gate {k}", "a": ga.get(k), "b": gb.get(k)})
    sa = {r["name"]: r.get("status") for r in a.records}
    sb = {r["name"]: r.get("status") for r in b.records}
    for k in sorted(set(sa) | set(sb)):
        if sa.get(k) != sb.get(k):
            out.append({"what": f"stage {k}", "a": sa.get(k), "b": sb.get(k)})

    def cells(ev):
        comp = as_dict(ev.read(layout.COMPARISON))
        return {f"parity {c.get('target') or run_name(str(c.get('backend')), str(c.get('kernels', 'torch')))} "
                f"b{c.get('batch')} {c.get('case')}": c.get("verdict")
                for c in (comp.get("cells") if isinstance(comp.get("cells"), list) else []) if isinstance(c, dict)}

    pa, pb = cells(a), cells(b)
    for k in sorted(set(pa) | set(pb)):
        if pa.get(k) != pb.get(k):
            out.append({"what": k, "a": pa.get(k), "b": pb.get(k)})
    return out


def limits(a: Evidence, b: Evidence) -> list[str]:
    """Differences in what was measured (not in the code under test) that limit or void a comparison."""
    out = []
    if a.campaign != b.campaign:
        out.append(f"campaign differs ({a.campaign} vs {b.campaign})")
    keys = [k for k in _changed(flatten(a.config), flatten(b.config)) if k not in IGNORED_CONFIG_KEYS]
    if keys:
        out.append(f"config differs at {', '.join(keys)}")
    pa, pb = as_dict(a.env.get("packages")), as_dict(b.env.get("packages"))
    versions = [f"{k} {pa.get(k)} vs {pb.get(k)}" for k in _changed(pa, pb)]
    if versions:
        out.append(f"versions differ: {'; '.join(versions)}")
    env_keys = [k for k in _changed({k: v for k, v in a.env.items() if k != "packages"},
                                    {k: v for k, v in b.env.items() if k != "packages"})]
    if env_keys:
        out.append(f"environment differs at {', '.join(env_keys)}")
    ka = {n: as_dict(f).get("sha256") for n, f in as_dict(as_dict(a.read(layout.CHECKPOINT)).get("files")).items()}
    kb = {n: as_dict(f).get("sha256") for n, f in as_dict(as_dict(b.read(layout.CHECKPOINT)).get("files")).items()}
    if ka != kb:
        out.append(f"checkpoint differs ({', '.join(_changed(ka, kb))})")
    for ev, side in ((a, "A"), (b, "B")):
        if not ev.sealed:
            out.append(f"{side} is not sealed: its files are not vouched for")
    return out


def diff(a: Evidence, b: Evidence) -> dict:
    return {"a": a.label, "b": b.label, "limits": limits(a, b), "verdicts": verdict_diff(a, b),
            "bench": bench_diff(a, b), "metrics": metric_diff(a, b)}
