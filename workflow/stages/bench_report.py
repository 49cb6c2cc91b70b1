"""Stage `bench-report`: the benchmark table, plot and the comparison against a baseline.

Writes bench/summary.csv, plots/bench.png and bench/baseline.json. A baseline (`bench.baseline`:
an evidence directory, or an evidence id or unique prefix in this campaign) yields a directional
claim per cell only where contract, versions and model match and neither cell is noisy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow import benchstats
from workflow.evidence import MANIFEST, Stage, read_json, write_text


def resolve_baseline(ref: str, evidence: Path) -> Path:
    p = Path(ref)
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            raise FileNotFoundError(f"bench.baseline {p} is not sealed (no {MANIFEST})")
        return p
    matches = sorted(d for d in evidence.parent.iterdir() if d.name.startswith(ref) and d != evidence)
    if len(matches) != 1:
        found = "no evidence directory" if not matches else f"{len(matches)} directories ({', '.join(m.name for m in matches)})"
        raise FileNotFoundError(f"bench.baseline {ref!r}: {found} matches under {evidence.parent}; give a path or a longer id")
    if not (matches[0] / MANIFEST).is_file():
        raise FileNotFoundError(f"bench.baseline {matches[0]} is not sealed (no {MANIFEST})")
    return matches[0]


def compare_to(cells: list[dict], base_dir: Path) -> list[dict]:
    out = []
    for cell in cells:
        name = f"{cell['backend']}-b{cell['batch']}"
        base_file = base_dir / "bench" / f"{name}.json"
        if not base_file.is_file():
            claim = {"claim": "no directional claim", "tpot_p50_change_pct": None, "tok_s_change_pct": None,
                     "reason": f"the baseline has no {name} cell"}
        else:
            claim = benchstats.directional_claim(cell, read_json(base_file))
        out.append({"backend": cell["backend"], "batch": cell["batch"], **claim})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--baseline", default=None, help="bench.baseline: an evidence directory, id or unique id prefix")
    ap.add_argument("cells", nargs="+", type=Path, help="bench/<backend>-b<B>.json files")
    args = ap.parse_args(argv)
    try:
        with Stage(args.evidence, "bench-report") as st:
            cells = [read_json(p) for p in args.cells]
            frame = benchstats.summary_frame(cells)
            st.add_file(write_text(args.evidence / "bench/summary.csv", frame.to_csv(index=False)))
            benchstats.plot(frame, args.evidence / "plots/bench.png")
            st.add_file(args.evidence / "plots/bench.png")
            result = {"baseline": None, "cells": []}
            if args.baseline:
                base = resolve_baseline(args.baseline, args.evidence)
                result = {"baseline": base.name, "cells": compare_to(cells, base)}
            st.write_json("bench/baseline.json", result)
            print(frame.to_string(index=False), flush=True)
            for c in result["cells"]:
                print(f"[bench-report] vs {result['baseline']} {c['backend']}-b{c['batch']}: {c['claim']}"
                      + (f" ({c['reason']})" if c.get("reason") else ""), flush=True)
    except (FileNotFoundError, benchstats.BenchError) as e:
        sys.exit(f"[bench-report] error: {e}")


if __name__ == "__main__":
    main()
