"""Stage `bench_report`: the benchmark table, plot and the comparison against a baseline.

Writes bench/summary.csv, plots/bench.png and bench/baseline.json. A baseline (`bench.baseline`:
an evidence directory, or an evidence id, any unique part of one, or @latest, in this campaign) yields a directional
claim per cell by benchstats.directional_claim: only where contract, versions and model match, neither cell is noisy,
the machine probes agree and the change passes the minimum effect. The plot rings noisy cells.
The cells of the benchmark over HTTP (stage serve_bench) follow the in-process rows of summary.csv (`transport`
http): the builtin engine's HTTP cell at concurrency C beside its in-process cell of the single backend at batch C,
on the same decode path and prompt contract (benchstats.side_by_side: the HTTP / in-process ratios and a
directional claim by the noise rule). The plot is the in-process cells'.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from evident.workflow.archive import archive
from evident.workflow.bench import benchstats
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_json, stage_args, write_text
from evident.workflow.plan.runs import bench_cell, cell_label, cell_prompts, is_http, label
from evident.workflow.plan.targets import ENGINE

SERVED = "single"  # the engine's backend engine.serve serves: the in-process cells its HTTP cells stand beside


def resolve_baseline(ref: str, evidence: Path) -> Path:
    """A sealed directory of this campaign other than the current one (the archive's id rules)."""
    try:
        return archive.resolve(ref, evidence.parent.parent, campaign=evidence.parent.name, exclude=evidence,
                               sealed=True)
    except archive.NotFound as e:
        raise archive.NotFound(f"bench.baseline: {e}") from None


def file_name(cell: dict) -> str:
    """A cell's file under bench/, without .json."""
    return cell_label(cell) if is_http(cell) else bench_cell(cell["backend"], cell["batch"], cell_prompts(cell))


def compare_to(cells: list[dict], base_dir: Path) -> list[dict]:
    """Each cell against the baseline's cell of the same file name: backend, prompt contract and batch (an HTTP
    cell: target, prompt contract and concurrency)."""
    out = []
    for cell in cells:
        prompts = cell_prompts(cell)
        name = file_name(cell)
        base_file = base_dir / "bench" / f"{name}.json"
        if not base_file.is_file():
            claim = benchstats.no_claim(f"the baseline has no {name} cell")
        else:
            claim = benchstats.directional_claim(cell, read_json(base_file))
        out.append({"cell": name, "prompts": prompts,
                    **({"target": cell["target"], "concurrency": cell["concurrency"]} if is_http(cell)
                       else {"backend": cell["backend"], "batch": cell["batch"]}), **claim})
    return out


def beside(http_cells: list[dict], cells: list[dict]) -> dict[str, tuple[str | None, dict]]:
    """Each builtin engine HTTP cell's in-process cell (the served backend, batch = concurrency, same decode path and
    prompt contract) and benchstats.side_by_side of the two, by the HTTP cell's label."""
    out = {}
    for h in http_cells:
        if h["target"] != ENGINE:
            continue
        key = (SERVED, h.get("kernels", "torch"), h["concurrency"], cell_prompts(h))
        match = [c for c in cells if (c["backend"], c.get("kernels", "torch"), c["batch"], cell_prompts(c)) == key]
        name = label(*key)  # `single-b4`, `single-graph-distinct-b4`
        side = benchstats.side_by_side(h, match[0]) if match else {
            "claim": "no directional claim", "reason": f"no in-process {name} cell"}
        out[cell_label(h)] = (name if match else None, side)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--baseline", default=None, help="bench.baseline: an evidence directory, id, any unique part of an id, or @latest")
    ap.add_argument("cells", nargs="+", type=Path, help=f"the cells' files, {layout.BENCH_CELLS}")
    args = ap.parse_args(argv)
    try:
        with Stage(args.evidence, "bench_report") as st:
            every = [read_json(p) for p in args.cells]
            cells, http = [c for c in every if not is_http(c)], [c for c in every if is_http(c)]
            frame = benchstats.summary_frame(cells)
            pairs = beside(http, cells)
            table = frame.assign(transport=benchstats.IN_PROCESS)[["transport", *frame.columns]]
            if http:
                table = pd.concat([table, benchstats.http_frame(http, pairs)], ignore_index=True)
            st.add_file(write_text(args.evidence / layout.BENCH_TABLE, table.to_csv(index=False)))
            for name, (inproc, side) in pairs.items():
                st.metrics.update({f"{name}.http_over_inprocess.{k}": v for k, v in side.items()
                                   if k.endswith(("_ratio", "_over_tpot_p50")) and v is not None})
                print(f"[bench_report] {name} beside {inproc or 'no in-process cell'}: {side['claim']}"
                      + (f", TPOT p50 x{side['tpot_p50_ratio']:.3f}" if side.get("tpot_p50_ratio") else "")
                      + (f" ({side['reason']})" if side.get("reason") else ""), flush=True)
            benchstats.plot(frame, args.evidence / layout.BENCH_PLOT)
            st.add_file(args.evidence / layout.BENCH_PLOT)
            result = {"baseline": None, "cells": []}
            if args.baseline:
                base = resolve_baseline(args.baseline, args.evidence)
                result = {"baseline": base.name, "cells": compare_to(every, base)}
            st.write_json(layout.BASELINE, result)
            print(frame.to_string(index=False), flush=True)
            for c in result["cells"]:
                print(f"[bench_report] vs {result['baseline']} {c['cell']}: {c['claim']}"
                      + (f" ({c['reason']})" if c.get("reason") else ""), flush=True)
    except (FileNotFoundError, benchstats.BenchError) as e:
        sys.exit(f"[bench_report] error: {e}")


if __name__ == "__main__":
    main()
