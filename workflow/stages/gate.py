"""Stage `gate`: after sealing, fail the run when `parity.require_exact` and the verdict is not exact."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow.evidence import MANIFEST, read_config, read_json, write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    verdict = read_json(args.evidence / MANIFEST)["verdict"]
    if config["parity"]["require_exact"] and verdict != "all_token_text_exact":
        sys.exit(f"[gate] parity.require_exact is set and the verdict is {verdict}; the evidence is sealed in {args.evidence}")
    write_json(args.out, {"evidence": str(args.evidence), "verdict": verdict})
    print(f"[gate] {args.evidence}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
