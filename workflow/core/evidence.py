"""The evidence core: content-derived ids, hashing, atomic writes, stage records, the manifest.

Everything here is plain files; nothing imports the engine or MLflow. The id's code part follows the
source files only (SOURCE_GLOBS); what the helpers write is world-readable (0644 files, 0755 directories).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import yaml

from evident.workflow.core.layout import MANIFEST, STAGES, stage_record

SCHEMA_VERSION = 1


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_sha256(ids: list[int]) -> str:
    """sha256 of token ids as little-endian u32 (the evidence contract's token hash)."""
    return sha256_bytes(b"".join(int(i).to_bytes(4, "little") for i in ids))


def text_sha256(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_hash(config: dict) -> str:
    return sha256_bytes(canonical_json(config))


# --- atomic writes: temp file in the same directory, fsync, rename ---------------------------
# Evidence and the HTML archive are meant to be read by anyone ("serve evidence/ with any static server"):
# every file these helpers write is 0644 and every directory they create 0755, whatever the umask
# (a temp file from mkstemp is 0600 and mkdir follows the umask, so both are set explicitly). Directories
# that already exist are left as they are.

FILE_MODE = 0o644
DIR_MODE = 0o755


def make_dirs(path: str | Path) -> Path:
    """`mkdir -p`: each directory it creates is DIR_MODE (0755) whatever the umask; existing ones are untouched."""
    path = Path(path)
    missing = []
    d = path
    while not d.is_dir():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made meanwhile by another writer: theirs, not ours to chmod
        os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask
    return path


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write atomically (temp file in the same directory, fsync, rename): FILE_MODE (0644), parents made 0755."""
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(tmp, FILE_MODE)  # mkstemp makes it 0600; set before the rename, so the file never lands private
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: str | Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_config(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


# --- ids -----------------------------------------------------------------------------------

def _git(code_dir: Path, *args: str) -> bytes | None:
    try:
        return subprocess.run(["git", "-C", str(code_dir), *args], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def commit_history(code_dir: str | Path) -> list[str]:
    """The commits of HEAD's history in code_dir, oldest first, parents before children; [] without git."""
    return (_git(Path(code_dir), "rev-list", "--topo-order", "--reverse", "HEAD") or b"").decode().split()


# What can change results, and so what the evidence id's code part covers: the project's code, rules, schema,
# packaging and the embedded default campaign (config/config.yaml is code: it is what runs without
# --configfile). NOT covered: campaign files under config/campaigns/ (what a campaign resolves to is the
# id's config hash), docs (*.md, also those beside the code), tests/, tools/ notes, Snakemake report captions
# (workflow/report/*.rst: report.html only), evidence/ and .evident/. One definition for both paths: the git
# pathspecs of `git_state` and the globs of `source_hash` (git's `:(glob)` and pathlib's glob agree on these
# patterns: `*` stays within a directory, `**/` is zero or more directories). A new kind of source file
# must be added here, or editing it will not change the id.
SOURCE_GLOBS = (
    "Snakefile", "pyproject.toml", "requirements.lock", "Makefile",
    "config/schema.yaml", "config/config.yaml",
    "engine/**/*.py", "kernels/**/*.py",
    "workflow/**/*.py", "workflow/**/*.smk", "workflow/**/*.yaml",  # *.yaml there: the Snakemake profiles
    "tools/**/*.py", "tools/**/*.sh",
)
SOURCE_PATHSPECS = tuple(f":(glob){g}" for g in SOURCE_GLOBS)


def git_state(code_dir: str | Path) -> dict:
    """Commit, and a hash of the uncommitted changes to the source (SOURCE_GLOBS) or None when it has none.

    The hash covers `git diff HEAD` (staged and unstaged) of the source files plus each untracked,
    non-ignored source file's name and content; nothing else: a campaign file, a note, a doc or a test
    can change without changing the id. A tree exported without .git (a copy sent to a GPU machine or a
    cluster) names its commit in EVIDENT_GIT_COMMIT (and EVIDENT_GIT_DIRTY, if any) instead; with neither,
    `source_hash` over the same files names it.
    """
    code_dir = Path(code_dir)
    commit = _git(code_dir, "rev-parse", "HEAD")
    if commit is None:
        if os.environ.get("EVIDENT_GIT_COMMIT"):
            return {"commit": os.environ["EVIDENT_GIT_COMMIT"], "dirty": os.environ.get("EVIDENT_GIT_DIRTY") or None}
        return {"commit": None, "dirty": source_hash(code_dir)}  # no git at all: the code itself names it
    h = hashlib.sha256()
    # no external diff or textconv driver from someone's git config: the bytes hashed are git's own patch
    diff = _git(code_dir, "diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color",
                "--", *SOURCE_PATHSPECS) or b""
    h.update(diff)
    hashed = bool(diff)
    untracked = (_git(code_dir, "ls-files", "--others", "--exclude-standard", "-z", "--", *SOURCE_PATHSPECS)
                 or b"").split(b"\0")
    for name in sorted(n for n in untracked if n):
        p = code_dir / os.fsdecode(name)
        if p.is_file():
            h.update(name + b"\0" + sha256_file(p).encode())
            hashed = True
    return {"commit": commit.decode().strip(), "dirty": h.hexdigest() if hashed else None}


def source_files(code_dir: str | Path) -> list[str]:
    """The source files (SOURCE_GLOBS) of a tree, relative posix paths, sorted."""
    code_dir = Path(code_dir)
    return sorted({p.relative_to(code_dir).as_posix() for g in SOURCE_GLOBS for p in code_dir.glob(g) if p.is_file()})


def source_hash(code_dir: str | Path) -> str:
    """sha256 over the source files (SOURCE_GLOBS: the files `git_state` covers), for a tree with no git history."""
    code_dir = Path(code_dir)
    h = hashlib.sha256()
    for rel in source_files(code_dir):
        h.update(rel.encode() + b"\0" + sha256_file(code_dir / rel).encode())
    return h.hexdigest()


def evidence_id(git: dict, config: dict, repeat: int) -> str:
    """`<commit7>[-dirty<diff8>]-c<config8>-r<N>`: same code + same config -> same directory.

    `-dirty` is there only when a source file (SOURCE_GLOBS) differs from the commit; `c<config8>` hashes
    the resolved campaign, so a campaign file's comments and layout do not count.
    """
    commit = (git.get("commit") or "0" * 7)[:7]
    dirty = f"-dirty{git['dirty'][:8]}" if git.get("dirty") else ""
    return f"{commit}{dirty}-c{config_hash(config)[:8]}-r{repeat}"


# --- stage records -------------------------------------------------------------------------

OK, SKIPPED, FAILED, INTERRUPTED = "ok", "skipped", "failed", "interrupted"
"""A stage record's `status`. `interrupted`: the stage was stopped (Ctrl-C, SIGTERM), not wrong; a rerun redoes it."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM inside a stage, raised as a Ctrl-C is, so that the stage unwinds (servers stop, `finally` runs)
    and records `interrupted`; Python's default SIGTERM ends the process at once, with no record."""


def interrupt(signum, frame):
    """A signal handler that raises Interrupted, naming the signal (SIGTERM, SIGHUP), as Ctrl-C raises."""
    raise Interrupted(signal.Signals(signum).name)


class Stage:
    """Context manager that records a stage's outcome in `stages/<name>.json`.

    On success the record carries params, metrics, tags and the stage's files (MLflow logs them
    later); on an exception it records `failed` with the error and re-raises, so a failed stage is
    visible in the directory without any output that looks complete. A KeyboardInterrupt, or SIGTERM
    while inside, is recorded `interrupted` with the signal as its reason: stopped, not a defect.
    """

    def __init__(self, evidence_dir: str | Path, name: str, params: dict | None = None, primary: bool = True):
        self.primary = primary  # False on EP ranks other than 0: they compute but write nothing
        self.dir = Path(evidence_dir)
        self.name = name
        self.params = dict(params or {})
        self.metrics: dict[str, float] = {}
        self.tags: dict[str, str] = {}
        self.files: list[str] = []
        self.skipped: str | None = None

    def skip(self, reason: str) -> None:
        """Record the stage as skipped, with the reason (a GPU-only stage without a GPU): never as ok."""
        self.skipped = reason

    def add_file(self, path: str | Path) -> None:
        self.files.append(Path(path).resolve().relative_to(self.dir.resolve()).as_posix())

    def write_json(self, relpath: str, obj) -> Path:
        p = self.dir / relpath
        if self.primary:
            write_json(p, obj)
            self.add_file(p)
        return p

    def __enter__(self) -> "Stage":
        self.started = utc_now()
        self._t0 = time.perf_counter()
        try:
            self._sigterm = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main thread: signals are the main thread's, its handler stays
            self._sigterm = False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._sigterm is not False:  # None: a handler set outside Python, so the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._sigterm is None else self._sigterm)
        if not self.primary:
            return False
        stopped = isinstance(exc, KeyboardInterrupt)
        status = (INTERRUPTED if stopped else FAILED) if exc is not None else (SKIPPED if self.skipped else OK)
        record = {
            "name": self.name,
            "status": status,
            "started_utc": self.started,
            "finished_utc": utc_now(),
            "seconds": round(time.perf_counter() - self._t0, 3),
            "params": self.params,
            "metrics": self.metrics,
            "tags": self.tags,
            "files": sorted(set(self.files)),
        }
        if status == SKIPPED:
            record["reason"] = self.skipped
        elif status == INTERRUPTED:
            record["reason"] = str(exc) or exc_type.__name__  # SIGTERM, or KeyboardInterrupt (Ctrl-C)
        elif status == FAILED:
            record["error"] = "".join(traceback.format_exception_only(exc_type, exc)).strip()
        write_json(self.dir / stage_record(self.name), record)
        return False


def stage_args(doc: str, checkpoint: bool = False) -> argparse.ArgumentParser:
    """A stage's command line: `--evidence DIR`, and `--checkpoint DIR` when it reads the model."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if checkpoint:
        ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--evidence", required=True, type=Path)
    return ap


def stage_records(evidence_dir: str | Path) -> list[dict]:
    return [read_json(p) for p in sorted((Path(evidence_dir) / STAGES).glob("*.json"))]


def list_files(evidence_dir: str | Path) -> list[str]:
    root = Path(evidence_dir)
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


def file_table(evidence_dir: str | Path) -> dict[str, dict]:
    root = Path(evidence_dir)
    return {rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size} for rel in list_files(root)}


DIGEST = "manifest_sha256"


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of every manifest field but the digest itself (the file list, the
    verdict, the stages): an edited manifest no longer matches. A checksum, not a signature: it catches
    damage and hand edits, not someone who recomputes it."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != DIGEST}))


def write_manifest(evidence_dir: str | Path, fields: dict) -> Path:
    """Seal the directory: the manifest is written last, atomically, over every other file."""
    manifest = {"schema_version": SCHEMA_VERSION, **fields, "sealed_utc": utc_now(), "files": file_table(evidence_dir)}
    manifest[DIGEST] = manifest_digest(manifest)
    return write_json(Path(evidence_dir) / MANIFEST, manifest)
