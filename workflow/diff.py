"""Two evidence directories side by side: what limits the comparison, verdicts, bench cells and metrics.

Plain data in and out (the CLI prints it, `evident diff A B`). A is the baseline, B the run under review.
"""

from __future__ import annotations

import math

from workflow import benchstats
from workflow.archive import Evidence, as_dict
from workflow.evidence import flatten
from workflow.runs import run_name

IGNORED_CONFIG_KEYS = {"repeat", "bench.baseline"}
"""Config keys that differ between comparable runs by design: they do not limit a comparison."""


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _bench_cells(ev: Evidence) -> dict[tuple, dict]:
    cells = {}
    for p in sorted((ev.path / "bench").glob("*-b*.json")):
        cell = ev.read(f"bench/{p.name}")
        if isinstance(cell, dict) and "backend" in cell and "batch" in cell:
            try:
                cells[(str(cell["backend"]), int(cell["batch"]))] = cell
            except (TypeError, ValueError, OverflowError):
                continue
    return cells


def _stat(cell: dict | None, *keys):
    try:
        v = cell["stats"]
        for k in keys:
            v = v[k]
        return float(v)
    except (KeyError, TypeError, ValueError):
        return None


def bench_diff(a: Evidence, b: Evidence) -> list[dict]:
    """Per bench cell: both TPOT p50 and tok/s, their change, and bench_report's directional claim
    (A is the baseline, B the current run): a claim only where contract, versions and model match
    and neither cell is noisy."""
    ca, cb = _bench_cells(a), _bench_cells(b)
    out = []
    for key in sorted(set(ca) | set(cb)):
        x, y = ca.get(key), cb.get(key)
        if x is None or y is None:
            claim = {"claim": "no directional claim", "tpot_p50_change_pct": None, "tok_s_change_pct": None,
                     "reason": f"only in {'B' if x is None else 'A'}"}
        else:
            try:
                claim = benchstats.directional_claim(y, x)
            except (benchstats.BenchError, KeyError, TypeError, ValueError, AttributeError) as e:
                claim = {"claim": "no directional claim", "tpot_p50_change_pct": None, "tok_s_change_pct": None,
                         "reason": f"malformed cell: {e}"}
        out.append({"backend": key[0], "batch": key[1],
                    "a_tpot_p50_ms": _stat(x, "tpot", "p50"), "b_tpot_p50_ms": _stat(y, "tpot", "p50"),
                    "a_tok_s": _stat(x, "decode_tok_s"), "b_tok_s": _stat(y, "decode_tok_s"), **claim})
    return out


def _number(v) -> float | None:
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
        x, y = _number(ma.get(k)), _number(mb.get(k))
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
        comp = as_dict(ev.read("parity/comparison.json"))
        return {f"parity {run_name(str(c.get('backend')), str(c.get('kernels', 'torch')))} "
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
    ka = {n: as_dict(f).get("sha256") for n, f in as_dict(as_dict(a.read("checkpoint.json")).get("files")).items()}
    kb = {n: as_dict(f).get("sha256") for n, f in as_dict(as_dict(b.read("checkpoint.json")).get("files")).items()}
    if ka != kb:
        out.append(f"checkpoint differs ({', '.join(_changed(ka, kb))})")
    for ev, side in ((a, "A"), (b, "B")):
        if not ev.sealed:
            out.append(f"{side} is not sealed: its files are not vouched for")
    return out


def diff(a: Evidence, b: Evidence) -> dict:
    return {"a": a.label, "b": b.label, "limits": limits(a, b), "verdicts": verdict_diff(a, b),
            "bench": bench_diff(a, b), "metrics": metric_diff(a, b)}
