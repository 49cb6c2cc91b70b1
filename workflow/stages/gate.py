"""Stage `gate`: after sealing, fail the run when the parity verdict names a defect (workflow/verdicts.py:
an accuracy gap, a precision regression, a transport regression, rows of a batch that differ), or is not exact
under `parity.require_exact`, or when
the overlap A/B screen (overlap/screen.json, if sealed in the directory) found outputs of A and B that differ,
or the kernel resource audit (kernels/audit.json) found a kernel that spills registers, or the GSM8K quality gate
(quality/gsm8k64-gate.json) did not pass (`no_claim` included) and the campaign did not mark it advisory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow.evidence import MANIFEST, read_config, read_json, write_json
from workflow.verdicts import DEFECTS

OVERLAP = "overlap/screen.json"
AUDIT = "kernels/audit.json"
QUALITY = "quality/gsm8k64-gate.json"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    manifest = read_json(args.evidence / MANIFEST)
    verdict = manifest["verdict"]
    overlap = read_json(args.evidence / OVERLAP)["verdict"] if OVERLAP in manifest["files"] else None
    audit = read_json(args.evidence / AUDIT)["verdict"] if AUDIT in manifest["files"] else None
    quality = read_json(args.evidence / QUALITY) if QUALITY in manifest["files"] else None
    if verdict in DEFECTS:
        first = read_json(args.evidence / "parity/comparison.json")["first_divergence"]
        sys.exit(f"[gate] the parity verdict is {verdict} (first: {first}; see parity/comparison.json); "
                 f"the evidence is sealed in {args.evidence}")
    if config["parity"]["require_exact"] and verdict != "all_token_text_exact":
        sys.exit(f"[gate] parity.require_exact is set and the verdict is {verdict}; the evidence is sealed in {args.evidence}")
    if overlap == "bitwise_mismatch":
        sys.exit(f"[gate] the overlap A/B screen found outputs of A and B that differ (see {OVERLAP}); "
                 f"the evidence is sealed in {args.evidence}")
    if audit == "spills":
        sys.exit(f"[gate] the kernel resource audit found register spills (see {AUDIT}); "
                 f"the evidence is sealed in {args.evidence}")
    if quality is not None and quality["verdict"] != "pass" and not quality.get("advisory"):
        sys.exit(f"[gate] the GSM8K quality gate says {quality['verdict']}: {quality['reason']} (see {QUALITY}); "
                 f"the evidence is sealed in {args.evidence}")
    advisory = bool(quality and quality.get("advisory"))
    quality = quality["verdict"] if quality else None
    write_json(args.out, {"evidence": str(args.evidence), "verdict": verdict, "overlap": overlap, "audit": audit,
                          "quality": quality, "quality_advisory": advisory})
    print(f"[gate] {args.evidence}: {verdict}" + (f", overlap {overlap}" if overlap else "")
          + (f", kernel audit {audit}" if audit else "")
          + (f", quality {quality}" + (" (advisory: not failing the run)" if advisory and quality != "pass" else "")
             if quality else ""), flush=True)


if __name__ == "__main__":
    main()
