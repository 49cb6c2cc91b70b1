"""`python -m workflow.stages.sync EVIDENCE_DIR...`: replay sealed evidence into MLflow.

Idempotent (runs are found by tag, never duplicated): it fills in what a tracking outage left
pending. The sealed directory is not touched; the outcome goes to .evident/tracking/<id>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow import tracking
from workflow.evidence import MANIFEST, utc_now, write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("evidence", nargs="+", type=Path, help="sealed evidence directories")
    ap.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else MLflow's default store")
    args = ap.parse_args(argv)
    failed = 0
    for root in args.evidence:
        if not (root / MANIFEST).is_file():
            print(f"[sync] {root}: not sealed (no {MANIFEST}); nothing to sync", file=sys.stderr)
            failed += 1
            continue
        try:
            ids = tracking.log_evidence(root, args.tracking_uri)
            tracking.finish(root, ids, args.tracking_uri)
        except Exception as e:
            print(f"[sync] {root.name}: tracking still unreachable: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
            continue
        write_json(Path(".evident/tracking") / f"{root.name}.json", {"synced_utc": utc_now(), **ids})
        print(f"[sync] {root.name}: parent run {ids['parent_run_id']}, {len(ids['child_run_ids'])} stage runs", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
