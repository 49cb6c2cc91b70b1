"""A campaign's history (`evident trend`, the archive's trends pages in workflow/archive/trend_page.py): each bench cell's
steady TPOT p50 (or decode tok/s) with its repeat-spread band, and each gate's verdict, over the campaign's
sealed evidence directories, with the regressions beyond the noise flagged as `evident diff` flags them.

- Which directories: the sealed ones only (an unsealed directory's files are vouched for by nothing).
- Their order (`in_order`): commit order, oldest first, where every directory's commit is in the working
  directory's git history (`git rev-list --topo-order`; directories of one commit by the manifest's
  `created_utc`, then the id); else (a commit from another clone or branch, no git) by `created_utc`, which
  follows the commits when each commit is run in turn. The frame says which (`frame.attrs["ordered_by"]`).
- A cell: one bench file `bench/<backend>-b<B>.json`, named as evidence names runs, `<run name>-b<B>`
  (workflow/plan/runs.py: `single-b8`, `single-graph-b8`, `hf-b1`, a distinct-prompts cell `single-distinct-b8`); a
  record without `kernels` is the torch path, one without a prompt contract same-prompt. As in workflow/archive/diff.py, two
  decode paths, or the two prompt contracts, at one backend and batch are two cells. A cell of the benchmark over
  HTTP, `bench/http-<target>-c<C>.json`, is its own (`http-engine-c4`); its tok/s is its output tok/s. A cell of
  the rate rung, `bench/http-<target>-r<R>.json` (`http-engine-r2`), is a series too: its TPOT p50, output tok/s or
  (`--metric goodput`, rate cells only) goodput, with no band and never a claim (a rate runs once: no noise
  estimate; diff.rate_claim).
- The band: for TPOT p50, the min and max of the cell's per-repeat TPOT p50s (`stats.repeat_tpot_p50`, the
  spread the noise rule reads); for tok/s, the min and max of the per-repeat decode tok/s, recomputed from the
  cell's raw `repeats` by `benchstats.tok_s`, as the cell's own. A cell
  without them has no band (empty in the CSV).
- The flag: each cell against a previous directory that has the same cell (`baseline`: the latest on a like
  machine, by the probe, else the one whose probe was nearest), through
  benchstats.directional_claim (the rule `evident diff` and bench_report apply: same contract, versions and
  model, neither cell noisy, the machine probes alike, a TPOT p50 change beyond the larger spread and the minimum
  effect). `slower` is a regression. The claim is on TPOT p50 whichever metric is shown: it is the only
  noise-aware rule the bench records.
- The marks: a noisy cell's point (`noisy`) and a comparison the machine probe refused (`probe_ratio`, the cell's
  probe median over its baseline's; `probe_ms` the cell's own) are `~` in the terminal and ringed in the PNG.
- Fewer than two sealed directories: one is written and printed as it is (one point per cell, nothing to
  compare, said so); none is an error, as is a campaign that does not exist (the known ones are listed).

Plain data in and out (a pandas frame, one row per directory and cell; a directory without a cell keeps one
row with an empty cell, so that its gate verdicts are there); printing is `cmd_trend`'s (fitted to a terminal
by workflow/core/terminal.py), the PNG workflow/archive/trend_plot.py's.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from evident.workflow.archive import archive, diff
from evident.workflow.archive.trend_plot import plot
from evident.workflow.bench import benchstats
from evident.workflow.core.evidence import commit_history, write_text
from evident.workflow.core.gates import GATES
from evident.workflow.core.terminal import pct, split_table, table, wrap
from evident.workflow.plan.runs import is_http, is_rate, label_key

TPOT, TOK_S, GOODPUT = "tpot_p50_ms", "tok_s", "goodput"
METRICS = {TPOT: "steady TPOT p50 (ms)", TOK_S: "decode throughput (tokens/s)",
           GOODPUT: "goodput (good requests/s, rate cells under an SLO)"}
BANDS = {TPOT: "min-max of the cell's per-repeat TPOT p50s",
         TOK_S: "min-max of the cell's per-repeat decode tok/s",
         GOODPUT: "none (a rate cell is one run)"}
WHAT = {TPOT: "steady TPOT p50", TOK_S: "decode tok/s", GOODPUT: "goodput"}
OUT = "_trends"
"""Under the archive root: `evidence/_trends/<campaign>.{png,csv}` (`_` starts no campaign name)."""
ERROR = 2

COLUMNS = ["campaign", "order", "evidence", "commit", "created_utc", "cell", "backend", "kernels", "prompts", "batch",
           "target", "concurrency", "rate",
           "metric", "value", "band_lo", "band_hi", "spread", "noisy", "probe_ms", "baseline", "tpot_p50_change_pct",
           "tok_s_change_pct", "probe_ratio", "claim", "regression", "reason"] + [f"gate_{g.name}" for g in GATES]
REGRESSION = "slower"


class TrendError(ValueError):
    """A trend that cannot be drawn: no such campaign, no sealed directory, a --cell that matches nothing."""


# --- reading ---------------------------------------------------------------------------------

def campaigns(root: str | Path = archive.ROOT) -> list[str]:
    """The campaign folders under `root` (as archive.evidence_dirs finds them), with or without directories."""
    root = Path(root)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name[0].isalnum()) if root.is_dir() else []


def directories(root: str | Path, campaign: str) -> tuple[list[archive.Evidence], str]:
    """The campaign's sealed directories, oldest first, and by what (`in_order`)."""
    root = Path(root)
    if campaign not in campaigns(root):
        known = ", ".join(campaigns(root)) or "none"
        raise TrendError(f"no campaign {campaign!r} under {root.as_posix()}/ (known: {known})")
    found, ordered_by = in_order(archive.listing(root, campaign), root.parent)
    if not found:
        n = len(archive.evidence_dirs(root, campaign))
        raise TrendError(f"campaign {campaign!r} has no sealed directory under {root.as_posix()}/ "
                         f"({n} unsealed): nothing to draw")
    return found, ordered_by


ORDERS = {"commit": "in commit order (the git history here)", "created": "oldest first by the manifest's created time"}


def in_order(entries: list[archive.Evidence], code_dir: str | Path) -> tuple[list[archive.Evidence], str]:
    """The sealed ones, oldest first, and the ORDERS key saying by what: by `code_dir`'s git history where it
    holds every one's commit (then created_utc, then the id), else by created_utc, then the id."""
    sealed = [e for e in entries if e.sealed]
    position = {c[:7]: i for i, c in enumerate(commit_history(code_dir))}
    commits = [e.commit.removesuffix("+dirty") for e in sealed]
    if sealed and all(c in position for c in commits):
        at = dict(zip((e.id for e in sealed), commits))
        return sorted(sealed, key=lambda e: (position[at[e.id]], e.created, e.id)), "commit"
    return sorted(sealed, key=lambda e: (e.created, e.id)), "created"


def _values(cell: dict, metric: str) -> tuple[float | None, float | None, float | None]:
    """(value, band low, band high) of one cell; None where the cell does not hold it."""
    stats = cell.get("stats") if isinstance(cell.get("stats"), dict) else {}
    if metric == TPOT:
        value = diff.number((stats.get("tpot") or {}).get("p50") if isinstance(stats.get("tpot"), dict) else None)
        band = stats.get("repeat_tpot_p50")
        band = [diff.number(v) for v in band] if isinstance(band, list) else []
    elif metric == GOODPUT:
        value, band = diff.number(stats.get("goodput")), []
    else:
        value = diff.tok_s(cell)
        try:
            band = [diff.number(benchstats.round_tok_s(rep) if is_http(cell) else
                                benchstats.tok_s(int(cell["batch"]), rep["steady_ms"]))
                    for rep in cell.get("repeats") or []]
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            band = []
    if not band or any(v is None for v in band):
        return value, None, None
    return value, min(band), max(band)


def _claim(cell: dict, prev: dict | None) -> dict:
    if prev is None:
        return {**diff.no_claim("the first directory with this cell"), "claim": ""}
    return diff.cell_claim(cell, prev)


def baseline(cell: dict, before: list[tuple[str, dict]]) -> tuple[str, dict] | None:
    """The directory a cell is compared with, of those before it with the cell: the latest on a like machine
    (benchstats.alike), else the one whose machine probe was nearest the cell's, else (no probes) the latest. So one
    run on a loaded machine neither makes a change in the next run nor hides one."""
    def distance(b: tuple[str, dict]) -> float:
        try:
            if benchstats.alike(cell["stats"], b[1]["stats"]):
                return 0.0
            return abs(math.log(benchstats.probe_ratio(cell["stats"], b[1]["stats"])))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return 0.0  # a malformed cell: directional_claim says so
    return min(reversed(before), key=distance) if before else None  # min keeps the first, the latest, of equals


def history(entries: list[archive.Evidence], metric: str = TPOT, cells: list[str] | None = None,
            ordered_by: str = "created"):
    """The trend frame (COLUMNS), entries in the order given (`directories` gives them oldest first,
    `ordered_by` says by what: an ORDERS key, kept in `frame.attrs["ordered_by"]`).

    Each cell is compared with the previous directory that has it (a directory without the cell, or with a
    malformed one, is passed over). `cells` keeps only those cells; one that no directory has is an error.
    """
    import pandas as pd

    if metric not in METRICS:
        raise TrendError(f"unknown metric {metric!r}: one of {', '.join(METRICS)}")
    per_dir = [diff.bench_cells(e) for e in entries]
    if cells:
        known = sorted({c for d in per_dir for c in d}, key=label_key)
        unknown = [c for c in cells if c not in known]
        if unknown:
            raise TrendError(f"no cell {', '.join(map(repr, unknown))} in these directories "
                             f"(cells: {', '.join(known) or 'none'})")
    rows, prev = [], {}  # cell -> [(evidence id, cell)] of the directories before, oldest first
    for order, (ev, found) in enumerate(zip(entries, per_dir), start=1):
        base = {"campaign": ev.campaign, "order": order, "evidence": ev.id, "commit": ev.commit,
                "created_utc": ev.created, **{f"gate_{g.name}": ev.gates.get(g.name, "") for g in GATES}}
        names = sorted((c for c in found if (not cells or c in cells) and (metric != GOODPUT or has_goodput(found[c]))),
                       key=label_key)
        if not names:
            rows.append({**base, "metric": metric, "regression": False})
        for name in names:
            files = found[name]
            _, cell = files[0]
            value, lo, hi = _values(cell, metric)
            last, against = baseline(cell, prev.get(name, [])), ""
            if len(files) > 1:
                claim = diff.no_claim(f"{len(files)} files for this cell ({', '.join(f for f, _ in files)})")
            elif value is None:
                done = (cell.get("stats") or {}).get("completed") if is_rate(cell) else None
                claim = diff.no_claim(f"no {metric}: " + ("no request completed" if done == 0 else "malformed cell"))
            else:
                claim = _claim(cell, last[1] if last else None)
                against = last[0] if last else ""
                prev.setdefault(name, []).append((ev.id, cell))
            stats = cell.get("stats") if isinstance(cell.get("stats"), dict) else {}
            try:
                what = diff.identity(cell)
            except (KeyError, TypeError, ValueError):
                what = {}
            rows.append({**base, "cell": name, **what,
                         "metric": metric, "value": value, "band_lo": lo, "band_hi": hi,
                         "spread": diff.number(stats.get("spread")),
                         "noisy": bool(stats.get("noisy", True)) if "noisy" in stats else None,
                         "probe_ms": diff.number(stats.get("probe_ms")), "baseline": against,
                         **claim, "regression": claim["claim"] == REGRESSION})
    frame = pd.DataFrame(rows, columns=COLUMNS).astype({"regression": bool})
    frame.attrs["ordered_by"] = ordered_by
    return frame


def has_goodput(files: list[tuple[str, dict]]) -> bool:
    """Whether a cell's files are a rate cell's with a goodput (an SLO was given): the cells `--metric goodput` shows."""
    return any(is_rate(c) and isinstance(c.get("stats"), dict) and c["stats"].get("goodput") is not None
               for _, c in files)


def regressions(frame) -> list[dict]:
    return [r for r in frame.to_dict("records") if r["regression"]]


# --- writing ---------------------------------------------------------------------------------

def stem(campaign: str, metric: str = TPOT, cells: list[str] | None = None) -> str:
    """`<campaign>` for the whole campaign's TPOT trend (what the archive's trends page shows); another metric
    or a --cell filter adds to the name, so that a filtered view never replaces the archive's."""
    return campaign + ("" if metric == TPOT else f"-{metric}") + ("" if not cells else "-" + "+".join(cells))


def _text(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def unsteady(row: dict) -> bool:
    """Whether a point is noise: its cell is noisy, or its comparison was refused as noise (a noisy baseline cell,
    the machine probe differing between the runs)."""
    noisy, reason = row.get("noisy"), _text(row.get("reason"))
    return (noisy is not None and noisy == noisy and bool(noisy)) or "noisy" in reason or benchstats.MACHINE in reason


def mark(row: dict) -> str:
    """The terminal's and the page's one-character reading of a point's claim."""
    claim, reason = _text(row.get("claim")), _text(row.get("reason"))
    if claim == REGRESSION:
        return "▲"
    if claim == "faster":
        return "▼"
    if unsteady(row):
        return "~"
    if claim and "within noise" not in reason and diff.ONE_RUN not in reason:
        return "≠"  # not comparable: contract, versions or model differ, or a malformed cell
    return ""


LEGEND = ("▲ slower beyond the noise (a regression), ▼ faster beyond the noise, ~ noise: a noisy cell, or the machine "
          "differed between the runs (its probe; no claim), "
          "≠ not comparable (contract, versions or model differ), — no cell; each against the previous directory "
          "with the cell on a like machine (by its probe; else the nearest), by the rule of evident diff; a rate cell "
          "(-r<R>, R requests a second) runs once: no band, never a claim")


def write(frame, out: str | Path, name: str, title: str) -> tuple[Path, Path]:
    """`<out>/<name>.png` and `<out>/<name>.csv`."""
    out = Path(out)
    csv = write_text(out / f"{name}.csv", frame.to_csv(index=False))
    metric = str(frame["metric"].iloc[0]) if len(frame) else TPOT
    return plot(frame, out / f"{name}.png", title, METRICS[metric], unsteady), csv


def title(campaign: str, n: int, metric: str = TPOT, ordered_by: str = "created") -> str:
    what = WHAT[metric]
    return (f"{campaign}: {what} per bench cell over {n} sealed director{'y' if n == 1 else 'ies'}, "
            f"{ORDERS[ordered_by]}\n"
            f"band: {BANDS[metric].replace('min-max', 'min–max')}\n"
            "red × slower beyond the noise; ringed: noise, no claim")


# --- the terminal ----------------------------------------------------------------------------

def value_text(v, metric: str = TPOT) -> str:
    """A cell's value as the terminal and the trends page show it."""
    v = diff.number(v)
    return "—" if v is None else (f"{v:.3f}" if metric == TPOT else f"{v:.2f}" if metric == GOODPUT else f"{v:.1f}")


def report(frame, metric: str = TPOT) -> str:
    """What `evident trend` prints for one campaign: the cells table, the gates table, the regressions."""
    dirs = frame.drop_duplicates("order").sort_values("order").to_dict("records")
    campaign = dirs[0]["campaign"]
    fixed_header = ["#", "commit", "created (UTC)"]
    fixed = [[str(d["order"]), d["commit"], _text(d["created_utc"]).replace("T", " ")[:16] or "—"] for d in dirs]
    cells = sorted((c for c in frame["cell"].dropna().unique() if c), key=label_key)
    lines = [f"{campaign}: {len(dirs)} sealed director{'y' if len(dirs) == 1 else 'ies'}, "
             f"{ORDERS[frame.attrs.get('ordered_by', 'created')]}, {len(cells)} bench cell{'' if len(cells) == 1 else 's'}"]
    if len(dirs) < 2:
        lines.append("only one sealed directory: nothing to compare yet")
    if cells:
        by = {(r["order"], r["cell"]): r for r in frame.to_dict("records") if _text(r["cell"])}
        columns = [[(value_text(by[(d["order"], c)]["value"], metric) + " " + mark(by[(d["order"], c)])).strip()
                    if (d["order"], c) in by else "—" for d in dirs] for c in cells]
        lines += ["", f"{METRICS[metric]} per cell:"]
        lines += [t + "\n" for t in split_table(fixed_header, fixed, cells, columns)]
        lines.append(wrap(LEGEND))
    else:
        lines += ["", "no bench cells in these directories"]
    gates = [g.name for g in GATES if any(_text(d[f"gate_{g.name}"]) for d in dirs)]
    lines += ["", "Gate verdicts (— not run):"]
    if gates:
        lines += split_table(fixed_header[:2], [r[:2] for r in fixed], gates,
                             [[_text(d[f"gate_{g}"]) or "—" for d in dirs] for g in gates])
    else:
        lines.append("  no gate verdicts recorded")
    bad = regressions(frame)
    order = {d["evidence"]: d["order"] for d in dirs}
    lines += ["", f"Regressions (TPOT p50 slower beyond the noise, against the previous directory with the cell): "
              f"{len(bad) or 'none'}"]
    if bad:
        lines.append(table(["cell", "directory", "against", "TPOT p50", "tok/s", "spread", "probe"],
                           [[r["cell"], f"#{r['order']} {r['commit']}", f"#{order.get(r['baseline'], '?')}",
                             pct(r["tpot_p50_change_pct"]), pct(r["tok_s_change_pct"]),
                             f"{diff.number(r['spread']) * 100:.1f}%" if diff.number(r["spread"]) is not None else "—",
                             f"x{r['probe_ratio']:.2f}" if diff.number(r["probe_ratio"]) is not None else "—"]
                            for r in bad]))
    return "\n".join(lines)


# --- the command -----------------------------------------------------------------------------

def add_parser(sub) -> argparse.ArgumentParser:
    """`evident trend`, on an argparse subparsers object (the top-level parser gives `--root`)."""
    p = sub.add_parser(
        "trend", help="each bench cell and gate over a campaign's sealed directories, regressions flagged",
        description="Each bench cell's steady TPOT p50 (or decode tok/s) with its band (the min-max of its "
        "per-repeat values) and each gate's verdict, over a campaign's sealed evidence directories, oldest first "
        "by the manifest's created time (which follows the commits when each is run in turn). A cell slower than "
        "the previous directory's same cell beyond the noise (evident diff's rule) is flagged. Prints a table and "
        "writes a PNG and a CSV per campaign to --out. One sealed directory is drawn as one point; none is an "
        "error.")
    p.add_argument("--campaign", action="append", metavar="C", help="this campaign (repeatable; default: all)")
    p.add_argument("--cell", action="append", metavar="CELL",
                   help="only this cell, as evidence names it: <run name>-b<B>, e.g. single-graph-b8 (repeatable)")
    p.add_argument("--metric", choices=list(METRICS), default=TPOT, help="what is drawn and printed (default: "
                   f"{TPOT}; {GOODPUT}: the rate cells under an SLO only); the regression flag is always on TPOT p50")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help=f"where <campaign>.png and .csv go (default: <root>/{OUT}/; another metric or --cell adds "
                   "to the name: <campaign>-tok_s-single-b8.png)")
    p.set_defaults(func=cmd_trend)
    return p


def cmd_trend(args) -> int:
    root = Path(getattr(args, "root", None) or archive.ROOT)
    try:
        names = args.campaign or campaigns(root)
        if not names:
            raise TrendError(f"no campaigns under {root.as_posix()}/")
        done = []
        for camp in dict.fromkeys(names):
            entries, ordered_by = directories(root, camp)
            frame = history(entries, args.metric, args.cell, ordered_by)
            png, csv = write(frame, args.out or root / OUT, stem(camp, args.metric, args.cell),
                             title(camp, len(entries), args.metric, ordered_by))
            done.append((camp, frame, png, csv))
    except TrendError as e:
        print(f"evident: {e}", file=sys.stderr)
        return ERROR
    for i, (camp, frame, png, csv) in enumerate(done):
        print(("\n" if i else "") + report(frame, args.metric))
        print(f"\nwrote {png.as_posix()}\nwrote {csv.as_posix()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m evident.workflow.archive.trend [--root R] trend [options]`: the subcommand as `evident` parses it, on its own."""
    ap = argparse.ArgumentParser(prog="evident")
    ap.add_argument("--root", type=Path, default=archive.ROOT, help="the evidence archive (default: evidence/)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
