"""Reading the evidence archive: list, resolve abbreviated ids, load, verify, sync (diff: workflow/archive/diff.py;
prune: workflow/archive/prune.py).

Plain data in and out; printing is the CLI's business and HTML the archive stage's. This module sits
beside tracking (it imports only it, the gate table, the evidence core and the lock names), so that stages may
use it too (bench_report resolves its baseline here) without a stage importing another stage.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import yaml

from evident.workflow import tracking
from evident.workflow.core import layout
from evident.workflow.core.evidence import (
    DIGEST,
    FAILED,
    INTERRUPTED,
    SKIPPED,
    file_table,
    manifest_digest,
    read_config,
    read_json,
    stage_records,
    utc_now,
    write_json,
)
from evident.workflow.core.gates import GATES, PARITY, document
from evident.workflow.core.layout import MANIFEST
from evident.workflow.core.locks import LOCKS, held

ROOT = Path("evidence")
TRACKING_RECORDS = Path(".evident/tracking")
"""Where sync records what it logged: a sealed directory is never rewritten, so a manifest that says
`pending` stays so; the record beside it says the outage has been filled since."""



SEALED, RUNNING = "sealed", "running"
"""A directory's status: sealed, running (a live snakemake writes it), or, unsealed with no run left, `failed` (a
stage failed) or `interrupted` (stopped: Ctrl-C, a kill, a lost machine): evidence.FAILED and INTERRUPTED."""


class NotFound(FileNotFoundError):
    """An id that matches no evidence directory or several, or one that is not sealed."""


# --- finding directories ---------------------------------------------------------------------

def evidence_dirs(root: str | Path = ROOT, campaign: str | None = None) -> list[Path]:
    """Every `<root>/<campaign>/<id>/` directory (sealed or not), sorted by campaign then id.

    A campaign name starts with a letter or digit: `_pages/` (the HTML archive) and hidden entries
    are not evidence.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    camps = [root / campaign] if campaign else sorted(p for p in root.iterdir() if p.is_dir() and p.name[0].isalnum())
    return sorted(d for c in camps if c.is_dir() for d in c.iterdir() if d.is_dir() and d.name[0].isalnum())


def label(path: Path) -> str:
    """`campaign/id`: how the archive names a directory to people."""
    return f"{path.parent.name}/{path.name}"


LATEST = re.compile(r"(?P<campaign>[^/@]*)@latest(?:~(?P<back>\d*))?")
"""`CAMPAIGN@latest`, `CAMPAIGN@latest~N` (N sealed directories before it; `~` alone is `~1`); no campaign: all."""

MAX_CANDIDATES = 20
"""An ambiguous reference names at most this many of its candidates."""


def _created_utc(path: Path) -> str:
    """The manifest's creation time ('' when unsealed or unreadable): what orders `@latest`."""
    return (_manifest(_json(path / MANIFEST)) or {}).get("created_utc") or ""


def _ls_hint(campaign: str | None) -> str:
    return f"`evident ls{f' --campaign {campaign}' if campaign else ''}` lists them"


def _ambiguous(ref: str, where: str, matches: list[Path]) -> NotFound:
    """Every candidate, newest first, one a line: campaign, id, creation time (or unsealed)."""
    rows = sorted(((m.parent.name, m.name, (load(m).created or "—").replace("T", " "),
                    "" if (m / MANIFEST).is_file() else "unsealed") for m in matches),
                  key=lambda r: (r[2], r[1]), reverse=True)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + (f"  {r[3]}" if r[3] else "")
             for r in rows[:MAX_CANDIDATES]]
    if len(rows) > MAX_CANDIDATES:
        lines.append(f"  ... and {len(rows) - MAX_CANDIDATES} more")
    return NotFound(f"{ref!r} matches {len(matches)} directories under {where}; give more of one id "
                    f"(or CAMPAIGN/ID):\n" + "\n".join(lines))


def _latest(ref: str, root: Path, campaign: str | None, exclude: Path | None) -> Path:
    """`CAMPAIGN@latest~N`: the N-th newest sealed directory, by its manifest's `created_utc`."""
    m = LATEST.fullmatch(ref)
    if m is None:
        raise NotFound(f"{ref!r}: a reference with @ is CAMPAIGN@latest or CAMPAIGN@latest~N "
                       "(the newest sealed directory of CAMPAIGN, or the N-th before it)")
    camp = m["campaign"] or campaign
    back = 0 if m["back"] is None else int(m["back"] or 1)
    if camp and not (root / camp).is_dir():
        raise NotFound(f"{ref!r}: no campaign {camp!r} under {root.as_posix()}/; {_ls_hint(None)}")
    dirs = [d for d in evidence_dirs(root, camp) if (d / MANIFEST).is_file()
            and (exclude is None or d.resolve() != Path(exclude).resolve())]
    dirs.sort(key=lambda d: (_created_utc(d), d.name), reverse=True)
    if back >= len(dirs):
        what = f"campaign {camp}" if camp else "the archive"
        have = f"{len(dirs)} sealed director{'y' if len(dirs) == 1 else 'ies'}"
        have += " other than this one" if exclude else ""
        oldest = f" ({camp or ''}@latest~{len(dirs) - 1} is the oldest)" if len(dirs) > 1 else ""
        raise NotFound(f"{ref!r}: {what} has {have} under {root.as_posix()}/{oldest}")
    return dirs[back]


def resolve(ref: str, root: str | Path = ROOT, *, campaign: str | None = None, exclude: Path | None = None,
            sealed: bool = False) -> Path:
    """One evidence directory from a path, an id, `campaign/id`, any part of an id that matches one
    directory (`c526`: its config hash), or `CAMPAIGN@latest[~N]` (sealed directories only, newest first
    by their manifest's creation time; `@latest` alone: over every campaign, or over `campaign` when given).

    An exact id wins over longer ids that contain it; otherwise the part must match one directory, in
    `campaign` (or the one the reference names) when given, else across all campaigns. Raises NotFound
    naming what was searched, every candidate (campaign, id, date) when there are several, or the
    directory when `sealed` and it has no manifest (several matches of which one is sealed: that one).
    """
    root = Path(root)
    path = Path(ref)
    if "/" in ref and path.is_dir() and any((path / f).exists() for f in (MANIFEST, layout.STAGES, layout.CONFIG)):
        found = path
    elif "@" in ref:
        found = _latest(ref, root, campaign, exclude)
    else:
        camp, _, part = ref.rpartition("/")
        camp = camp or campaign
        if camp and not (root / camp).is_dir() and path.parent.is_dir():
            root, camp = path.parent.parent, path.parent.name  # a path prefix: evidence/tiny/7c0
        candidates = evidence_dirs(root, camp)
        where = f"{root.as_posix()}/" + (f"{camp}/" if camp else "")
        if exclude is not None:
            candidates = [d for d in candidates if d.resolve() != Path(exclude).resolve()]
        exact = [d for d in candidates if d.name == part]
        matches = exact or [d for d in candidates if part and part in d.name]
        if sealed and len(matches) > 1:
            matches = [d for d in matches if (d / MANIFEST).is_file()] or matches
        if not matches:
            raise NotFound(f"no evidence directory matches {ref!r} under {where}; {_ls_hint(camp)}")
        if len(matches) > 1:
            raise _ambiguous(ref, where, matches)
        found = matches[0]
    if sealed and not (found / MANIFEST).is_file():
        raise NotFound(f"{found.as_posix()} is not sealed (no {MANIFEST})")
    return found


def lock_of(path: Path) -> Path:
    """The lock of `<root>/<campaign>/<id>/` (workflow/core/locks.py), in the archive's working directory, beside root."""
    return path.parent.parent.parent / LOCKS / path.parent.name / f"{path.name}.lock"


def running(path: Path) -> bool:
    """Whether a live snakemake writes this directory. It holds the directory's flock for its whole life and the
    kernel drops a flock when its process ends, however it ends (Ctrl-C, SIGKILL, a crash): a dead run never looks
    live, as a pid in a file or Snakemake's own lock files (a killed run leaves them) could. The probe is shared
    and held for an instant, as `locks.live_runs` holds it (`locks.held`; no lock file: no run has it)."""
    return held(lock_of(path))


# --- loading ---------------------------------------------------------------------------------

def _json(path: Path):
    """A file's JSON, or None when it is missing or damaged: listing must survive a broken directory."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class Evidence:
    path: Path
    manifest: dict | None
    config: dict
    env: dict
    records: list[dict]
    sync_record: dict | None = None

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def campaign(self) -> str:
        return (self.manifest or {}).get("campaign") or self.config.get("campaign") or self.path.parent.name

    @property
    def label(self) -> str:
        return label(self.path)

    @property
    def sealed(self) -> bool:
        return self.manifest is not None

    @property
    def created(self) -> str:
        starts = [r["started_utc"] for r in self.records if r.get("started_utc")]
        return (self.manifest or {}).get("created_utc") or (min(starts) if starts else "")

    @property
    def commit(self) -> str:
        git = (self.manifest or {}).get("git") or {}
        commit = (git.get("commit") or self.id.split("-")[0])[:7]
        return commit + ("+dirty" if git.get("dirty") or "-dirty" in self.id else "")

    @property
    def device(self) -> str:
        dev = self.env.get("device") or self.config.get("device") or "?"
        gpus = self.env.get("gpus") or []
        return f"{dev} ({len(gpus)}x {gpus[0]})" if gpus else dev

    def with_status(self, status: str) -> list[str]:
        return [r["name"] for r in self.records if r.get("status") == status]

    @functools.cached_property
    def status(self) -> str:
        """SEALED, RUNNING, FAILED or INTERRUPTED: one word, for `evident ls`."""
        if self.sealed:
            return SEALED
        if running(self.path):
            return RUNNING
        return FAILED if self.with_status(FAILED) else INTERRUPTED

    @property
    def state(self) -> str:
        """The status, naming failed, interrupted and skipped stages (a skipped stage is not a pass)."""
        parts = [self.status]
        parts += [f"{s}: {', '.join(names)}" for s in (FAILED, INTERRUPTED, SKIPPED) if (names := self.with_status(s))]
        return "; ".join(parts)

    @functools.cached_property
    def gates(self) -> dict[str, str]:
        """Each gate's verdict (workflow/core/gates.py), parity first, from the file its stage wrote; the manifest's
        parity verdict for a directory sealed before stages listed their files."""
        files = {f for r in self.records for f in r.get("files", [])}
        found = {}
        for g in GATES:
            doc = self.read(f) if (f := document(g, files)) else None
            if isinstance(doc, dict) and isinstance(doc.get("verdict"), str):
                found[g.name] = doc["verdict"]
        if not found and (self.manifest or {}).get("verdict"):
            found[PARITY.name] = self.manifest["verdict"]
        return found

    @property
    def tracking(self) -> dict:
        """The manifest's tracking record, or `synced` with the ids when a later sync filled it."""
        if not self.sealed:
            return {"status": "unsealed"}
        track = dict(self.manifest.get("tracking") or {"status": "unknown"})
        if track.get("status") != "logged" and self.sync_record:
            track = {"status": "synced", **{k: v for k, v in self.sync_record.items() if k != "synced_utc"}}
        return track

    def read(self, rel: str):
        return _json(self.path / rel)


def load(path: str | Path, records: Path = TRACKING_RECORDS) -> Evidence:
    path = Path(path)
    try:
        config = read_config(path / layout.CONFIG) or {}
    except (OSError, ValueError, yaml.YAMLError):
        config = {}
    try:
        recs = stage_records(path)
    except (OSError, ValueError):
        recs = []
    return Evidence(path=path, manifest=_manifest(_json(path / MANIFEST)), config=as_dict(config),
                    env=_typed(_json(path / layout.ENV), {"packages": dict, "gpus": list}) or {},
                    records=[_record(r) for r in recs if isinstance(r, dict) and isinstance(r.get("name"), str)],
                    sync_record=_typed(_json(records / f"{path.name}.json"), {}))


# A damaged file must not crash a listing (tests/reliability/test_fuzz.py): every field the archive reads is
# coerced to the type it expects, or dropped.
def as_dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _typed(doc, fields: dict[str, type]) -> dict | None:
    if not isinstance(doc, dict):
        return None
    return {k: v for k, v in doc.items() if k not in fields or isinstance(v, fields[k])}


def _manifest(doc) -> dict | None:
    doc = _typed(doc, {"git": dict, "tracking": dict, "files": dict})
    if doc is not None:
        for k in ("created_utc", "sealed_utc", "campaign", "verdict"):
            if k in doc and not isinstance(doc[k], str):
                doc[k] = str(doc[k])
        git = doc.get("git") or {}
        doc["git"] = {k: v for k, v in git.items() if v is None or isinstance(v, str)}
    return doc


def _record(rec: dict) -> dict:
    rec = _typed(rec, {"metrics": dict, "tags": dict, "params": dict, "files": list})
    rec["files"] = [f for f in rec.get("files", []) if isinstance(f, str)]
    for k in ("status", "started_utc", "error", "reason"):
        if k in rec and not isinstance(rec[k], str):
            rec[k] = str(rec[k])
    return rec


def listing(root: str | Path = ROOT, campaign: str | None = None, records: Path = TRACKING_RECORDS) -> list[Evidence]:
    """Every directory, newest first (by the time its first stage started)."""
    found = [load(d, records) for d in evidence_dirs(root, campaign)]
    return sorted(found, key=lambda e: (e.created, e.id), reverse=True)


# --- verify ----------------------------------------------------------------------------------

def verify(path: str | Path) -> dict:
    """Re-hash every file against MANIFEST.json (with the manifest's own hashing and file list).

    Returns {"missing", "extra", "changed", "problems"}; all empty means the directory is intact.
    """
    path = Path(path)
    manifest = _json(path / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {"missing": [], "extra": [], "changed": [], "problems": [f"{MANIFEST} is missing or unreadable"]}
    sealed, now = manifest["files"], file_table(path)
    changed = [rel for rel in sorted(set(sealed) & set(now))
               if not isinstance(sealed[rel], dict)
               or (sealed[rel].get("sha256"), sealed[rel].get("size")) != (now[rel]["sha256"], now[rel]["size"])]
    problems = []
    # Manifests sealed before the digest existed have none: their files are still checked, the manifest is not.
    if DIGEST in manifest and manifest[DIGEST] != manifest_digest(manifest):
        problems.append(f"{MANIFEST} edited after sealing: its {DIGEST} does not match its content")
    if manifest.get("evidence_id") not in (None, path.name):
        problems.append(f"directory renamed: the manifest names it {manifest['evidence_id']}")
    return {"missing": sorted(set(sealed) - set(now)), "extra": sorted(set(now) - set(sealed)),
            "changed": changed, "problems": problems}


def intact(result: dict) -> bool:
    return not any(result.values())


# --- sync ------------------------------------------------------------------------------------

def sync(path: str | Path, uri: str | None = None, records: Path = TRACKING_RECORDS) -> dict:
    """Replay one sealed directory into MLflow (idempotent: runs are found by tag) and record it.

    Raises NotFound when unsealed and whatever MLflow raises when the store is unreachable.
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise NotFound(f"{path.as_posix()} is not sealed (no {MANIFEST}); nothing to sync")
    ids = tracking.log_evidence(path, uri)
    tracking.finish(path, ids, uri)
    write_json(Path(records) / f"{path.name}.json", {"synced_utc": utc_now(), **ids})
    return ids
