"""Stage `bench_report`: the benchmark table, plot and the comparison against a baseline.

Writes bench/summary.csv, plots/bench.png and bench/baseline.json. A baseline (`bench.baseline`:
an evidence directory, or an evidence id, any unique part of one, or @latest, in this campaign) yields a directional
claim per cell only where contract, versions and model match and neither cell is noisy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow import archive, benchstats
from workflow.evidence import Stage, read_json, write_text
from workflow.runs import bench_cell, cell_prompts


def resolve_baseline(ref: str, evidence: Path) -> Path:
    """A sealed directory of this campaign other than the current one (the archive's id rules)."""
    try:
        return archive.resolve(ref, evidence.parent.parent, campaign=evidence.parent.name, exclude=evidence,
                               sealed=True)
    except archive.NotFound as e:
        raise archive.NotFound(f"bench.baseline: {e}") from None


def compare_to(cells: list[dict], base_dir: Path) -> list[dict]:
    """Each cell against the baseline's cell of the same file name: backend, prompt contract and batch."""
    out = []
    for cell in cells:
        prompts = cell_prompts(cell)
        name = bench_cell(cell["backend"], cell["batch"], prompts)
        base_file = base_dir / "bench" / f"{name}.json"
        if not base_file.is_file():
            claim = {"claim": "no directional claim", "tpot_p50_change_pct": None, "tok_s_change_pct": None,
                     "reason": f"the baseline has no {name} cell"}
        else:
            claim = benchstats.directional_claim(cell, read_json(base_file))
        out.append({"backend": cell["backend"], "prompts": prompts, "batch": cell["batch"], **claim})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--baseline", default=None, help="bench.baseline: an evidence directory, id, any unique part of an id, or @latest")
    ap.add_argument("cells", nargs="+", type=Path, help="bench/<backend>-b<B>.json files")
    args = ap.parse_args(argv)
    try:
        with Stage(args.evidence, "bench_report") as st:
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
                print(f"[bench_report] vs {result['baseline']} {bench_cell(c['backend'], c['batch'], c['prompts'])}: "
                      f"{c['claim']}"
                      + (f" ({c['reason']})" if c.get("reason") else ""), flush=True)
    except (FileNotFoundError, benchstats.BenchError) as e:
        sys.exit(f"[bench_report] error: {e}")


if __name__ == "__main__":
    main()
