"""Pruning the evidence archive (`evident prune`): which directories go, removing one under its lock, and
marking its MLflow runs deleted. Plain data in and out; printing is the CLI's business."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
import shutil
import time
from pathlib import Path

from evident.workflow import tracking
from evident.workflow.archive.archive import ROOT, TRACKING_RECORDS, Evidence, evidence_dirs, label, load, lock_of
from evident.workflow.core.locks import Held, holding  # a running snakemake's, on the directory it writes

AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """`7d`, `12h`, `30m` (also `s` and `w`) in seconds; ValueError on anything else."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not an age: a number and a unit, like 7d, 12h or 30m (s, m, h, d, w)")
    return float(m[1]) * AGE_UNITS[m[2]]


def age_of(ev: Evidence, now: float) -> float:
    """Seconds since a directory was made: its manifest's `created_utc` when sealed (a sealed directory is
    never written again, and copying one resets its mtime), else the directory's mtime (its last change)."""
    created = (ev.manifest or {}).get("created_utc")
    if created:
        try:
            when = _dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
            if when.tzinfo is None:
                when = when.replace(tzinfo=_dt.timezone.utc)
            return now - when.timestamp()
        except ValueError:
            pass  # a damaged manifest: fall back to the file system
    return now - ev.path.stat().st_mtime


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@dataclasses.dataclass
class Prunable:
    """One directory `prune` selected: `remove`, `keep` (sealed, and sealed ones were not asked for) or
    `skip` (its lock is held); `reason` says why, in words."""
    evidence: Evidence
    action: str
    reason: str
    age_s: float
    size: int

    @property
    def path(self) -> Path:
        return self.evidence.path


def prune_plan(root: str | Path = ROOT, *, unsealed: bool = False, older_than: float | None = None,
               sealed: bool = False, campaign: str | None = None, now: float | None = None,
               records: Path = TRACKING_RECORDS) -> list[Prunable]:
    """What `prune` would do, oldest first; writes nothing.

    Selected: unsealed directories (`unsealed`) and/or directories older than `older_than` seconds (both
    given: unsealed ones that old). A selected sealed directory is removed only when `sealed`; one whose
    lock a running snakemake holds is skipped.
    """
    if not unsealed and older_than is None:
        raise ValueError("nothing selected: give unsealed, older_than or both")
    now = time.time() if now is None else now
    out = []
    for d in evidence_dirs(root, campaign):
        ev = load(d, records)
        age = age_of(ev, now)
        if (unsealed and ev.sealed) or (older_than is not None and age < older_than):
            continue
        action, reason = "remove", "sealed" if ev.sealed else "unsealed (no MANIFEST.json)"
        if ev.sealed and not sealed:
            action, reason = "keep", "sealed: sealed directories are removed only with --sealed"
        else:
            try:
                with holding(lock_of(d), create=False):
                    pass
            except Held as h:
                action, reason = "skip", f"being written by a running snakemake ({h})"
        out.append(Prunable(ev, action, reason, age, size_of(d)))
    return sorted(out, key=lambda p: (-p.age_s, label(p.path)))


def remove(path: Path, root: str | Path = ROOT, records: Path = TRACKING_RECORDS) -> None:
    """Remove one evidence directory, holding its lock (raises Held when a snakemake holds it), and its
    sync record unless a directory of the same id remains in another campaign (records are keyed by id)."""
    with holding(lock_of(path)):
        shutil.rmtree(path)
    record = Path(records) / f"{path.name}.json"
    if record.is_file() and not any(d.name == path.name for d in evidence_dirs(root)):
        record.unlink()


def recorded_runs(ev: Evidence) -> list[str]:
    """The MLflow run ids a directory records: its manifest's tracking section, or the sync record."""
    track = ev.tracking
    children = track.get("child_run_ids") if isinstance(track.get("child_run_ids"), dict) else {}
    ids = [track.get("parent_run_id"), *children.values()]
    return [i for i in dict.fromkeys(ids) if isinstance(i, str) and i]


def forget_runs(ev: Evidence, uri: str | None = None) -> dict | None:
    """Mark deleted in MLflow the runs of a (removed) directory: those it records and any others tagged
    with its id in its campaign's experiment (a seal killed before the manifest leaves runs unrecorded).
    Returns tracking.delete_runs' result, or None when tracking was disabled and nothing was recorded.
    Raises whatever MLflow raises when the store is unreachable."""
    ids = recorded_runs(ev)
    if ev.sealed and not ids and ev.tracking.get("status") == "disabled":
        return None
    return tracking.delete_runs(ev.campaign, ev.id, ids, uri)
