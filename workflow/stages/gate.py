"""Stage `gate`: after sealing, fail the run when `parity.require_exact` and the verdict is not exact, or when
the overlap A/B screen (overlap/screen.json, if sealed in the directory) found outputs of A and B that differ,
or the kernel resource audit (kernels/audit.json) found a kernel that spills registers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow.evidence import MANIFEST, read_config, read_json, write_json

OVERLAP = "overlap/screen.json"
AUDIT = "kernels/audit.json"


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
    if config["parity"]["require_exact"] and verdict != "all_token_text_exact":
        sys.exit(f"[gate] parity.require_exact is set and the verdict is {verdict}; the evidence is sealed in {args.evidence}")
    if overlap == "bitwise_mismatch":
        sys.exit(f"[gate] the overlap A/B screen found outputs of A and B that differ (see {OVERLAP}); "
                 f"the evidence is sealed in {args.evidence}")
    if audit == "spills":
        sys.exit(f"[gate] the kernel resource audit found register spills (see {AUDIT}); "
                 f"the evidence is sealed in {args.evidence}")
    write_json(args.out, {"evidence": str(args.evidence), "verdict": verdict, "overlap": overlap, "audit": audit})
    print(f"[gate] {args.evidence}: {verdict}" + (f", overlap {overlap}" if overlap else "")
          + (f", kernel audit {audit}" if audit else ""), flush=True)


if __name__ == "__main__":
    main()
