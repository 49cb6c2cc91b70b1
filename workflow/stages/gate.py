"""Stage `gate`: after sealing, fail the run when a gate of workflow/core/gates.py failed (its verdict is one of the
gate's failing verdicts, in the sealed file its stage wrote), or when the parity verdict is not exact under
`parity.require_exact`. A gate whose document is marked `advisory` (quality.advisory) is recorded, not failed on.
A gate whose stage the campaign did not run is recorded as not run.

The record (`--out`, `.evident/gates/<campaign>/<id>.json`) is written for every sealed run, passing or failing,
with the reasons it failed (`failed`); the marker `--passed` (the rule's output: Snakemake deletes a failed job's
outputs, never this record) only when nothing failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from evident.workflow.archive.summary import divergence
from evident.workflow.core import layout
from evident.workflow.core.evidence import read_config, read_json, stage_args, write_json, write_text
from evident.workflow.core.gates import GATES, PARITY, document, target_verdicts
from evident.workflow.core.layout import MANIFEST
from evident.workflow.plan.runs import STAGES


def failure(gate, doc: dict, path: str, config: dict) -> str | None:
    if not gate.fails(doc["verdict"], config) or doc.get("advisory"):
        return None
    if doc["verdict"] not in gate.failing:
        return f"parity.require_exact is set and the verdict is {doc['verdict']}"
    why = doc.get("first_divergence") or doc.get("reason")
    if isinstance(why, dict):  # a parity divergence, in SUMMARY.md's words (a prompt position, not a step -52)
        try:
            why = (f"{why['case']}: " if "case" in why else "") + divergence(why)
        except (KeyError, TypeError, ValueError):  # a shape SUMMARY.md does not know: as written
            why = json.dumps(why, sort_keys=True)
    return f"{gate.what} says {doc['verdict']}" + (f" ({why})" if why else "") + f"; see {path}"


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--out", required=True, type=Path, help="the gate record, written passing or failing")
    ap.add_argument("--passed", type=Path, default=None, help="a marker written only when the run passes the gates")
    args = ap.parse_args(argv)
    config = read_config(args.evidence / layout.CONFIG)
    manifest = read_json(args.evidence / MANIFEST)
    paths = {g.name: path for g in GATES if (path := document(g, manifest["files"]))}
    docs = {name: read_json(args.evidence / path) for name, path in paths.items()}
    failed = [why for g in GATES if g.name in docs and (why := failure(g, docs[g.name], paths[g.name], config))]
    verdicts = {g.name: docs[g.name]["verdict"] if g.name in docs else None for g in GATES}
    advisory = sorted(n for n, d in docs.items() if d.get("advisory") and d["verdict"] != "pass")
    engines = target_verdicts(docs.get(PARITY.name, {}))
    write_json(args.out, {"evidence": str(args.evidence), "passed": not failed, "failed": failed, "verdicts": verdicts,
                          "advisory": advisory,
                          "not_run": [g.name for g in GATES if g.stage not in config.get("stages", STAGES)],
                          "parity_targets": engines})
    print(f"[gate] {args.evidence}: " + ", ".join(f"{n} {v}" for n, v in verdicts.items() if v)
          + "".join(f"; parity target {n} {t['verdict']} ({t['level']} level)" for n, t in engines.items())
          + "".join(f" ({n} advisory: not failing the run)" for n in advisory), flush=True)
    if failed:
        sys.exit(f"[gate] {'; '.join(failed)}; the evidence is sealed in {args.evidence}; the gate record is {args.out}")
    if args.passed is not None:
        write_text(args.passed, f"passed: {args.out}\n")


if __name__ == "__main__":
    main()
