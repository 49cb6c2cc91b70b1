"""Stage `seal`: SUMMARY.md and DETAILS.md, MLflow logging, then MANIFEST.json written last, atomically.

Tracking never decides the evidence: if MLflow cannot be reached the directory is still sealed
and the manifest records tracking as pending; `evident sync` replays it later.
"""

from __future__ import annotations

import sys
from pathlib import Path

from evident.workflow import tracking
from evident.workflow.archive.summary import render, render_details
from evident.workflow.core import gates, layout, privacy
from evident.workflow.core.evidence import (
    config_hash,
    read_config,
    read_json,
    stage_args,
    stage_records,
    write_manifest,
    write_text,
)
from evident.workflow.core.layout import DETAILS, SUMMARY


def _reason(exc: Exception) -> str:
    # The evidence gets the kind of failure only: messages carry URLs, host names or credentials.
    # The whole message goes to the seal log, which lives outside the evidence directory.
    return f"{type(exc).__name__}: the tracking store could not be reached or written (details in the seal log)"


def scrub_logs(root: Path) -> None:
    """Stage logs are raw tool output: the home directory, user and host names out of them (privacy.scrub)."""
    for log in sorted((root / layout.LOGS).glob("*.log")):
        original = log.read_text(errors="replace")
        if (text := privacy.scrub(original)) != original:
            write_text(log, text)


def remove_stale_temps(root: Path) -> None:
    """A stage killed inside an atomic write leaves its hidden temp file (`.<name>.*.tmp`): never evidence."""
    for tmp in root.rglob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink()


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--commit", default="")
    ap.add_argument("--dirty", default="")
    ap.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else MLflow's default store")
    ap.add_argument("--no-tracking", action="store_true")
    args = ap.parse_args(argv)
    root = args.evidence
    config = read_config(root / layout.CONFIG)
    git = {"commit": args.commit or None, "dirty": args.dirty or None}
    scrub_logs(root)
    remove_stale_temps(root)
    write_text(root / SUMMARY, render(root, git))
    write_text(root / DETAILS, render_details(root))
    # Scrub what is expected (paths in logs), then scan everything, before anything reaches MLflow: its
    # params, tags and artifacts all come from these files (stage records, config.yaml, the stages' files).
    findings = privacy.scan_dir(root)
    if findings:
        sys.exit(f"[seal] refusing to seal {root}: {len(findings)} secret or private value(s) found "
                 f"(nothing was logged to MLflow, no manifest written):\n" + "\n".join(f"  {f}" for f in findings))
    records = stage_records(root)
    verdicts = gates.verdicts(records)
    verdict = verdicts.get(gates.PARITY.name)
    comparison = root / gates.PARITY.file
    engines = gates.target_verdicts(read_json(comparison) if comparison.is_file() else {})

    ids, track = None, {"status": "disabled"}
    if not args.no_tracking:
        try:
            ids = tracking.log_evidence(root, args.tracking_uri)
            track = {"status": "logged", **ids}
            print(f"[seal] MLflow: experiment {ids['experiment_id']}, parent run {ids['parent_run_id']}", flush=True)
        except Exception as e:  # any tracking failure leaves the evidence complete
            track = {"status": "pending", "reason": _reason(e)}
            print(f"[seal] MLflow unreachable, tracking pending: {type(e).__name__}: {e}", flush=True)

    write_manifest(root, {
        "evidence_id": root.name,
        "campaign": config["campaign"],
        "created_utc": min(r["started_utc"] for r in records),
        "git": git,
        "config_sha256": config_hash(config),
        "stages": {r["name"]: r["status"] for r in records},
        "verdict": verdict,
        "quality": verdicts.get("quality"),
        "gates": verdicts,
        "parity_targets": engines,  # each engine target's, beside parity's (the worst of them)
        "tracking": track,
    })
    if ids:
        try:
            tracking.finish(root, ids, args.tracking_uri)
        except Exception as e:
            print(f"[seal] MLflow: could not attach the manifest ({type(e).__name__}: {e}); "
                  f"run `evident sync {root}` later", flush=True)
    print(f"[seal] sealed {root} (verdict {verdict})", flush=True)


if __name__ == "__main__":
    main()
