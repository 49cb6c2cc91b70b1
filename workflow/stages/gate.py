"""Stage `gate`: after sealing, fail the run when a gate of workflow/gates.py failed (its verdict is one of the
gate's failing verdicts, in the sealed file its stage wrote), or when the parity verdict is not exact under
`parity.require_exact`. A gate whose document is marked `advisory` (quality.advisory) is recorded, not failed on.
A gate whose stage the campaign did not run is recorded as not run."""

from __future__ import annotations

import sys
from pathlib import Path

from evident.workflow.evidence import MANIFEST, read_config, read_json, stage_args, write_json
from evident.workflow.gates import GATES, PARITY, document
from evident.workflow.runs import STAGES


def failure(gate, doc: dict, path: str) -> str | None:
    if doc["verdict"] not in gate.failing or doc.get("advisory"):
        return None
    why = doc.get("first_divergence") or doc.get("reason")
    return f"{gate.what} says {doc['verdict']}" + (f" ({why})" if why else "") + f"; see {path}"


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    manifest = read_json(args.evidence / MANIFEST)
    paths = {g.name: path for g in GATES if (path := document(g, manifest["files"]))}
    docs = {name: read_json(args.evidence / path) for name, path in paths.items()}
    sealed = f"the evidence is sealed in {args.evidence}"
    for g in GATES:
        if g.name in docs and (why := failure(g, docs[g.name], paths[g.name])):
            sys.exit(f"[gate] {why}; {sealed}")
    parity = docs.get(PARITY.name, {}).get("verdict")
    if config["parity"]["require_exact"] and parity is not None and parity != "all_token_text_exact":
        sys.exit(f"[gate] parity.require_exact is set and the verdict is {parity}; {sealed}")
    verdicts = {g.name: docs[g.name]["verdict"] if g.name in docs else None for g in GATES}
    advisory = sorted(n for n, d in docs.items() if d.get("advisory") and d["verdict"] != "pass")
    engines = {n: {"verdict": t["verdict"], "level": t["level"]}
               for n, t in (docs.get(PARITY.name, {}).get("targets") or {}).items()}
    write_json(args.out, {"evidence": str(args.evidence), "verdicts": verdicts, "advisory": advisory,
                          "not_run": [g.name for g in GATES if g.stage not in config.get("stages", STAGES)],
                          "parity_targets": engines})
    print(f"[gate] {args.evidence}: " + ", ".join(f"{n} {v}" for n, v in verdicts.items() if v)
          + "".join(f"; parity target {n} {t['verdict']} ({t['level']} level)" for n, t in engines.items())
          + "".join(f" ({n} advisory: not failing the run)" for n in advisory), flush=True)


if __name__ == "__main__":
    main()
