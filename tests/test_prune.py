"""`evident prune` (workflow/archive/prune.py, workflow/cli.py) on directories built by hand (tests/handbuilt.py).

Ages are relative to now: a sealed directory's from its manifest's created_utc, an unsealed one's from
the directory's mtime. A running snakemake is played by a process holding the evidence lock the way
workflow/core/locks.py's `hold` does (for workflow/rules/common.smk).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import handbuilt
import pytest

from evident.workflow import cli, tracking
from evident.workflow.archive import archive, prune
from evident.workflow.core.evidence import write_manifest
from evident.workflow.core.layout import MANIFEST

pytestmark = pytest.mark.timeout(120)

DAY = 86400
OLD = "aaaaaaa-dirty1234abcd-c0000000a-r1"          # tiny, sealed, 40 days old
NEW = "aaaaaaa-dirty1234abcd-c0000000b-r1"          # tiny, sealed, 1 day old
FAILED_OLD = "bbbbbbb-dirty1234abcd-c0000000c-r1"   # tiny, unsealed, last written 45 days ago
FAILED_NEW = "bbbbbbb-dirty1234abcd-c0000000d-r1"   # tiny, unsealed, just now
GPU_OLD = "ccccccc-c0000000e-r1"                    # gpu, sealed, 50 days old
SIZE = r"[\d.]+ (KB|B|MB)"


def ago(days: float) -> str:
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")


def evident(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def left(root: Path) -> set[str]:
    return {archive.label(d) for d in archive.evidence_dirs(root)}


def snapshot(base: Path) -> dict:
    """Every file and folder under the working directory, with its size and mtime: a dry run changes none."""
    return {p.relative_to(base).as_posix(): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(base.rglob("*"))}


@pytest.fixture
def arch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = Path("evidence")
    handbuilt.build(root, "tiny", OLD, created=ago(40), plot=False)
    handbuilt.build(root, "tiny", NEW, created=ago(1), plot=False)
    for eid, days in ((FAILED_OLD, 45), (FAILED_NEW, 0)):
        d = handbuilt.build(root, "tiny", eid, plot=False, seal=False)
        os.utime(d, (time.time() - days * DAY,) * 2)
    handbuilt.build(root, "gpu", GPU_OLD, created=ago(50), plot=False)
    return root


ALL = {f"tiny/{OLD}", f"tiny/{NEW}", f"tiny/{FAILED_OLD}", f"tiny/{FAILED_NEW}", f"gpu/{GPU_OLD}"}


@contextlib.contextmanager
def running_snakemake(lock: Path):
    """A process that holds `lock` as the pipeline does (exclusive flock, `pid N` written in it) until told to end."""
    code = ("import fcntl, os, sys\n"
            "f = open(sys.argv[1], 'a+')\n"
            "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "f.seek(0); f.truncate(); f.write(f'pid {os.getpid()}\\n'); f.flush()\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n")
    lock.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline() == "held\n"
        yield p.pid
    finally:
        p.stdin.close()
        p.wait(10)


# --- what is selected ------------------------------------------------------------------------

def test_parse_age():
    assert prune.parse_age("7d") == 7 * DAY
    assert prune.parse_age("12h") == 12 * 3600
    assert prune.parse_age("30m") == 1800
    assert prune.parse_age("1.5d") == 1.5 * DAY
    for bad in ("7", "d", "7 days", "-1d", "7y"):
        with pytest.raises(ValueError, match="is not an age: a number and a unit, like 7d, 12h or 30m"):
            prune.parse_age(bad)


def test_prune_refuses_what_it_cannot_do_and_removes_nothing(arch, capsys, tmp_path):
    before = snapshot(tmp_path)
    for args, message in (
            ((), "say what to prune: --unsealed, --older-than D, or both"),
            (("--sealed",), "--sealed goes with --older-than D (and not --unsealed): sealed directories are removed "
                            "only by age"),
            (("--sealed", "--unsealed", "--older-than", "1d"), "--sealed goes with --older-than D"),
            (("--unsealed", "--campaign", "nope"), "no campaign 'nope' under evidence/")):
        code, out, err = evident(capsys, "prune", *args)
        assert (code, out) == (2, ""), args
        assert err.startswith(f"evident: {message}"), (args, err)
    with pytest.raises(SystemExit) as e:
        cli.main(["prune", "--older-than", "7 days"])
    assert e.value.code == 2
    assert "argument --older-than: '7 days' is not an age" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_prune_unsealed_removes_failed_runs_only(arch, capsys):
    code, out, err = evident(capsys, "prune", "--unsealed")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 3
    assert re.fullmatch(rf"removed       tiny/{FAILED_OLD}: unsealed \(no MANIFEST.json\), 45.0d old, {SIZE}; "
                        r"mlflow: no runs", lines[0]), lines[0]
    assert re.fullmatch(rf"removed       tiny/{FAILED_NEW}: unsealed \(no MANIFEST.json\), \d+s old, {SIZE}; "
                        r"mlflow: no runs", lines[1]), lines[1]
    assert re.fullmatch(rf"total: removed 2 directories \({SIZE}\)", lines[2]), lines[2]
    assert left(arch) == ALL - {f"tiny/{FAILED_OLD}", f"tiny/{FAILED_NEW}"}
    assert not Path("mlflow.db").exists()  # no store was there to mark runs in: none is created
    assert evident(capsys, "prune", "--unsealed")[:2] == (0, "nothing to prune under evidence/\n")


def test_older_than_lists_sealed_matches_as_kept_without_sealed(arch, capsys):
    code, out, _ = evident(capsys, "prune", "--older-than", "30d")
    assert code == 0
    lines = out.splitlines()
    kept = "sealed: sealed directories are removed only with --sealed"
    assert lines[0] == f"kept          gpu/{GPU_OLD}: {kept} (50.0d old)"
    assert re.fullmatch(rf"removed       tiny/{FAILED_OLD}: unsealed \(no MANIFEST.json\), 45.0d old, {SIZE}; "
                        r"mlflow: no runs", lines[1]), lines[1]
    assert lines[2] == f"kept          tiny/{OLD}: {kept} (40.0d old)"
    assert re.fullmatch(rf"total: removed 1 directory \({SIZE}\); kept 2 sealed", lines[3]), lines[3]
    assert len(lines) == 4  # the new ones are not old enough to be mentioned
    assert left(arch) == ALL - {f"tiny/{FAILED_OLD}"}
    # unsealed and older than: the young failed run stays
    code, out, _ = evident(capsys, "prune", "--unsealed", "--older-than", "1h")
    assert (code, out) == (0, "nothing to prune under evidence/\n")
    assert f"tiny/{FAILED_NEW}" in left(arch)


def test_sealed_with_older_than_removes_old_sealed_ones_only(arch, capsys):
    code, out, _ = evident(capsys, "prune", "--older-than", "30d", "--sealed", "--campaign", "tiny")
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["removed", f"tiny/{FAILED_OLD}:"], ["removed", f"tiny/{OLD}:"]]
    assert re.fullmatch(rf"removed       tiny/{OLD}: sealed, 40.0d old, {SIZE}; mlflow: no runs", lines[1]), lines[1]
    assert re.fullmatch(rf"total: removed 2 directories \({SIZE}\)", lines[2])
    assert left(arch) == {f"tiny/{NEW}", f"tiny/{FAILED_NEW}", f"gpu/{GPU_OLD}"}  # young ones; another campaign


def test_dry_run_removes_nothing(arch, capsys, tmp_path):
    code, out, _ = evident(capsys, "html")
    assert code == 0
    before = snapshot(tmp_path)
    code, out, _ = evident(capsys, "prune", "--older-than", "30d", "--sealed", "--dry-run")
    assert code == 0
    lines = out.splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == ["would remove"] * 3
    assert [line.split()[2] for line in lines[:3]] == [f"gpu/{GPU_OLD}:", f"tiny/{FAILED_OLD}:", f"tiny/{OLD}:"]
    assert "mlflow" not in out and "index.html" not in out
    assert re.fullmatch(rf"total: would remove 3 directories \({SIZE}\); nothing removed \(--dry-run\)", lines[3])
    assert snapshot(tmp_path) == before  # not a file, lock, page or store written, nothing removed
    assert left(arch) == ALL


def test_prune_rewrites_the_html_index(arch, capsys):
    assert evident(capsys, "html")[0] == 0
    page = arch / "_pages/tiny" / f"{FAILED_OLD}.html"
    assert page.is_file() and FAILED_OLD in (arch / "index.html").read_text()
    code, out, _ = evident(capsys, "prune", "--unsealed", "--older-than", "7d")
    assert code == 0 and out.endswith("evidence/index.html: rewritten, 4 evidence pages\n")
    assert not page.exists() and FAILED_OLD not in (arch / "index.html").read_text()
    assert NEW in (arch / "index.html").read_text()


# --- a running snakemake ---------------------------------------------------------------------

def test_a_directory_whose_lock_is_held_is_skipped(arch, capsys, tmp_path):
    lock = Path(".evident/locks/tiny") / f"{FAILED_NEW}.lock"
    files = snapshot(arch / "tiny" / FAILED_NEW)
    with running_snakemake(lock) as pid:
        code, out, _ = evident(capsys, "prune", "--unsealed", "--dry-run")
        assert code == 0
        lines = out.splitlines()
        assert lines[0].startswith(f"would remove  tiny/{FAILED_OLD}: unsealed")
        assert lines[1] == f"skipped       tiny/{FAILED_NEW}: being written by a running snakemake (pid {pid})"
        assert re.fullmatch(rf"total: would remove 1 directory \({SIZE}\); nothing removed \(--dry-run\); "
                            r"skipped 1 held by a running snakemake", lines[2]), lines[2]

        code, out, _ = evident(capsys, "prune", "--unsealed")
        assert code == 0
        lines = out.splitlines()
        assert lines[0].startswith(f"removed       tiny/{FAILED_OLD}: unsealed")
        assert lines[1] == f"skipped       tiny/{FAILED_NEW}: being written by a running snakemake (pid {pid})"
        assert re.fullmatch(rf"total: removed 1 directory \({SIZE}\); skipped 1 held by a running snakemake", lines[2])
        assert snapshot(arch / "tiny" / FAILED_NEW) == files  # untouched, every file

        # taken between the plan and the removal: remove() holds the lock itself, so it refuses too
        with pytest.raises(prune.Held, match=f"pid {pid}"):
            prune.remove(arch / "tiny" / FAILED_NEW, arch)
        assert snapshot(arch / "tiny" / FAILED_NEW) == files
    code, out, _ = evident(capsys, "prune", "--unsealed")  # the run ended: its lock went with it
    assert code == 0 and out.startswith(f"removed       tiny/{FAILED_NEW}: unsealed")
    assert left(arch) == ALL - {f"tiny/{FAILED_OLD}", f"tiny/{FAILED_NEW}"}


# --- MLflow ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its schema migrated once; tests copy it (saves seconds each)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def lifecycle(uri: str, campaign: str) -> dict[str, dict[str, str]]:
    """evident.id -> {run id: lifecycle stage} for every run (deleted ones too) of the campaign's experiment."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(campaign)
    out: dict[str, dict[str, str]] = {}
    for r in c.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=1000):
        out.setdefault(r.data.tags["evident.id"], {})[r.info.run_id] = r.info.lifecycle_stage
    return out


def test_mlflow_runs_of_removed_directories_are_marked_deleted(arch, capsys, empty_store, monkeypatch):
    shutil.copyfile(empty_store, "mlflow.db")
    uri = f"sqlite:///{Path.cwd() / 'mlflow.db'}"  # absolute: MLflow caches a store by its URI, across tests
    synced = archive.sync(arch / "tiny" / OLD, uri)  # pending at seal, synced since: the sync record has the ids
    archive.sync(arch / "tiny" / NEW, uri)
    # a seal killed after logging, before the manifest: runs that only their `evident.id` tag ties to the directory
    orphan = tracking.log_evidence(arch / "tiny" / FAILED_OLD, uri)
    assert Path(f".evident/tracking/{OLD}.json").is_file()
    runs = lifecycle(uri, "tiny")
    assert {k: len(v) for k, v in runs.items()} == {OLD: 4, NEW: 4, FAILED_OLD: 4}
    assert synced["parent_run_id"] in runs[OLD] and orphan["parent_run_id"] in runs[FAILED_OLD]

    code, out, _ = evident(capsys, "prune", "--older-than", "30d", "--sealed", "--campaign", "tiny",
                           "--tracking-uri", uri)
    assert code == 0
    lines = out.splitlines()
    for line, eid in zip(lines, (FAILED_OLD, OLD)):
        assert line.startswith(f"removed       tiny/{eid}: ") and line.endswith("; mlflow: 4 runs marked deleted"), line
    runs = lifecycle(uri, "tiny")
    assert set(runs[OLD].values()) == {"deleted"} and set(runs[FAILED_OLD].values()) == {"deleted"}
    assert set(runs[NEW].values()) == {"active"}  # the young directory's runs are left alone
    assert not Path(f".evident/tracking/{OLD}.json").exists()  # its sync record went with it
    assert Path(f".evident/tracking/{NEW}.json").is_file()

    # a manifest that records its runs (logged at seal; no sync record), the store from MLFLOW_TRACKING_URI
    new = arch / "tiny" / NEW
    ids = tracking.log_evidence(new, uri)  # the runs the sync logged (idempotent)
    Path(f".evident/tracking/{NEW}.json").unlink()
    manifest = json.loads((new / MANIFEST).read_text())
    logged = {"status": "logged", **ids, "child_run_ids": {**ids["child_run_ids"], "gone": "0" * 32}}
    write_manifest(new, {k: v for k, v in manifest.items() if k not in ("schema_version", "sealed_utc", "files")}
                   | {"tracking": logged})
    assert archive.load(new).tracking["status"] == "logged"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, out, _ = evident(capsys, "prune", "--older-than", "0s", "--sealed", "--campaign", "tiny")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"removed       tiny/{NEW}: sealed, 1.0d old") and lines[0].endswith(
        "; mlflow: 4 runs marked deleted (1 recorded run(s) not in this store: left)")
    assert lines[1].startswith(f"removed       tiny/{FAILED_NEW}: unsealed") and lines[1].endswith("; mlflow: no runs")
    runs = lifecycle(uri, "tiny")
    assert set(runs[NEW]) == {ids["parent_run_id"], *ids["child_run_ids"].values()}
    assert set(runs[NEW].values()) == {"deleted"}
    assert left(arch) == {f"gpu/{GPU_OLD}"}


def test_an_unreachable_store_leaves_the_runs_and_still_removes(arch, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logged = {"status": "logged", "experiment_id": "1", "parent_run_id": "f" * 32,
              "child_run_ids": {"compare": "e" * 32, "bench-single": "d" * 32}}
    handbuilt.build(arch, "tiny", "ddddddd-c0000000f-r1", created=ago(60), plot=False, tracking=logged)
    code, out, _ = evident(capsys, "prune", "--older-than", "30d", "--sealed", "--campaign", "tiny",
                           "--tracking-uri", f"http://127.0.0.1:{port}")
    assert code == 0  # tracking never fails a prune
    lines = out.splitlines()
    assert lines[0].startswith("removed       tiny/ddddddd-c0000000f-r1: sealed, 60.0d old")
    assert re.search(r"; mlflow unreachable \(MlflowException: .+\): runs left \(3 recorded, parent f{32}\)$", lines[0])
    # asked once, not once a directory
    assert lines[1].startswith(f"removed       tiny/{FAILED_OLD}: ") and lines[1].endswith(
        "; mlflow unreachable (above): any runs left")
    assert lines[2].startswith(f"removed       tiny/{OLD}: ") and lines[2].endswith(
        "; mlflow unreachable (above): any runs left")
    assert re.fullmatch(rf"total: removed 3 directories \({SIZE}\)", lines[3])
    assert left(arch) == {f"tiny/{NEW}", f"tiny/{FAILED_NEW}", f"gpu/{GPU_OLD}"}


def test_a_missing_sqlite_store_is_not_created(arch, capsys):
    logged = {"status": "logged", "experiment_id": "1", "parent_run_id": "f" * 32, "child_run_ids": {}}
    handbuilt.build(arch, "tiny", "ddddddd-c0000000f-r1", created=ago(60), plot=False, tracking=logged)
    db = Path.cwd() / "mlflow.db"
    code, out, _ = evident(capsys, "prune", "--older-than", "55d", "--sealed", "--tracking-uri", f"sqlite:///{db}")
    assert code == 0
    assert out.splitlines()[0].endswith(f"; mlflow unreachable (FileNotFoundError: no MLflow store at {db}): "
                                        f"runs left (1 recorded, parent {'f' * 32})")
    assert not Path("mlflow.db").exists() and left(arch) == ALL
