"""`python -m workflow.stages.sync EVIDENCE_DIR...`: replay sealed evidence into MLflow.

Idempotent (runs are found by tag, never duplicated): it fills in what a tracking outage left
pending. The sealed directory is not touched; the outcome goes to .evident/tracking/<id>.json.
The same code as `evident sync` (workflow/archive.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow import archive


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("evidence", nargs="+", type=Path, help="sealed evidence directories")
    ap.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else MLflow's default store")
    args = ap.parse_args(argv)
    failed = 0
    for root in args.evidence:
        try:
            ids = archive.sync(root, args.tracking_uri)
        except archive.NotFound as e:
            print(f"[sync] {e}", file=sys.stderr)
            failed += 1
            continue
        except Exception as e:
            print(f"[sync] {root.name}: tracking still unreachable: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"[sync] {root.name}: parent run {ids['parent_run_id']}, {len(ids['child_run_ids'])} stage runs", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
