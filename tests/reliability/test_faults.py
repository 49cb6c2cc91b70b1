"""Faults injected into real pipeline runs (slow): a SIGKILL mid-stage and mid-seal, a tracking outage with a
real `mlflow server` on loopback, parallel jobs and concurrent invocations, concurrent writers of one SQLite
store. Two pipeline runs in all, shared by the tests of this module."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import cluster
import handbuilt
import pytest
import tinyev
import yaml

from evident.workflow.archive import archive
from evident.workflow.core.evidence import read_json
from evident.workflow.core.layout import MANIFEST
from evident.workflow.plan.targets import free_port  # below the OS's ephemeral range, each port once

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

# Several independent stages (oracle, parity, bench, overlap, kernel audit) and two cases, run with -j 4: what the
# faults hit is the orchestration (locks, incomplete outputs, the seal, tracking), which the other stages (each with
# its own end-to-end tests) would only make slower.
CAMPAIGN = {"campaign": "faults", "device": "cpu", "checkpoint": tinyev.synthetic(),
            "stages": ["oracle", "parity", "bench", "overlap", "kernel_audit"],
            "cases": [{"name": "greeting", "prompt": "Hello, evident!", "max_new_tokens": 6},
                      {"name": "code", "prompt": "def fibonacci(n):", "max_new_tokens": 4}],
            "parity": {"batch_sizes": [1, 2], "backends": ["single"]},
            "bench": {"backends": ["single"], "batch_sizes": [1], "new_tokens": 4, "repeats": 1, "warmup": 0},
            "overlap": {"inputs": 4}}
# Files whose content depends on the clock: stage records (start, finish, seconds), logs, bench timings and
# what is drawn or written from them. Everything else must be byte-identical between two runs.
TIME_VARYING = ("MANIFEST.json", "SUMMARY.md", "DETAILS.md", "stages/", "logs/", "bench/", "plots/bench.png")


SLOW_HOOK = "EVIDENT_TEST_SLOW_STAGE"
# tests/slowhook/sitecustomize.py makes the stage named in SLOW_HOOK pause where a kill hurts most
SLOWHOOK_PATH = str(Path(__file__).resolve().parents[1] / "slowhook")


def smk(wd: Path, *args: str, env: dict | None = None, popen: bool = False):
    e = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", SLOW_HOOK)}
    e.update(env or {})
    if SLOW_HOOK in e:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [SLOWHOOK_PATH, os.environ.get("PYTHONPATH")]))
    (wd / "campaign.yaml").write_text(yaml.safe_dump(CAMPAIGN))
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-j4", "--configfile",
           str(wd / "campaign.yaml"), *args]
    if popen:  # its own process group: the test kills the whole group, Snakemake and its jobs
        return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)


def evidence_of(wd: Path) -> Path:
    dirs = [p for p in (wd / "evidence/faults").iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def wait_for(pred, what: str, timeout: float = 300, proc=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def kill_group(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


# --- a real MLflow server on loopback ----------------------------------------------------------

HAVE_SERVER = importlib.util.find_spec("flask") is not None and (BIN / "mlflow").is_file()
NO_SERVER = ("`mlflow server` needs the full mlflow package (flask): pip install -e '.[test]' installs it; "
             "the skinny client cannot serve")


class Server:
    def __init__(self, home: Path):
        self.home, self.port, self.proc = home, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.home / 'store.db'}", "--artifacts-destination",
             str(self.home / "artifacts"), "--workers", "1"],
            stdout=open(self.home / "server.log", "a"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **cluster.SERVER_ENV})  # without MLflow's job runner (tests/cluster.py says why)

        def up():
            try:
                return urllib.request.urlopen(f"{self.uri}/health", timeout=2).status == 200
            except OSError:
                return False

        wait_for(up, "the mlflow server", timeout=120, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.proc = None


# --- run 1: the tracking server is down during the whole campaign --------------------------------

@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    wd = tmp_path_factory.mktemp("outage")
    server = Server(wd / "server")
    if HAVE_SERVER:
        server.start()  # a real server, stopped before the campaign starts: the outage
        server.stop()
    t0 = time.perf_counter()
    r = smk(wd, env={"MLFLOW_TRACKING_URI": server.uri})
    print(f"campaign with the tracking server down: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    yield wd, server
    server.stop()


def test_outage_seals_full_evidence_as_pending(outage):
    wd, _ = outage
    ev = evidence_of(wd)
    m = read_json(ev / MANIFEST)
    assert m["tracking"]["status"] == "pending"
    assert set(m["stages"].values()) <= {"ok", "skipped"} and m["verdict"] == "all_token_text_exact"
    assert archive.intact(archive.verify(ev))


@pytest.mark.skipif(not HAVE_SERVER, reason=NO_SERVER)
def test_sync_after_the_outage_uploads_everything_once(outage):
    wd, server = outage
    ev = evidence_of(wd)
    server.start()
    try:
        _sync_uploads_everything_once(wd, ev, server)
    finally:
        server.stop()  # no later test needs it: not left serving beside the next runs (the fixture stops it too)


def _sync_uploads_everything_once(wd: Path, ev: Path, server: Server) -> None:
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri}

    def sync():
        r = subprocess.run([str(BIN / "evident"), "sync", "--all"], cwd=wd, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def snapshot():
        c = MlflowClient(server.uri)
        runs = c.search_runs([c.get_experiment_by_name("faults").experiment_id], max_results=1000)
        out = {}
        for run in runs:
            history = {k: len(c.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
            arts = sorted(a.path for a in c.list_artifacts(run.info.run_id))
            out[run.info.run_id] = (run.info.status, run.data.tags.get("evident.stage", "parent"),
                                    dict(run.data.params), history, arts)
        return out

    assert "ok    faults/" in sync()
    first = snapshot()
    records = {r["name"]: r for r in archive.load(ev).records}
    stages = sorted(v[1] for v in first.values() if v[1] != "parent")
    assert stages == sorted(records) and len(first) == len(records) + 1  # one parent, one run per stage
    assert {v[0] for v in first.values()} == {"FINISHED"}
    for status, stage, params, history, arts in first.values():
        if stage != "parent":  # every metric of the stage record, each logged exactly once
            assert history == {k: 1 for k in [*records[stage]["metrics"], "seconds"]}, stage
    assert (wd / archive.TRACKING_RECORDS / f"{ev.name}.json").is_file()
    sync()
    assert snapshot() == first  # a second sync adds nothing
    r = subprocess.run([str(BIN / "evident"), "ls"], cwd=wd, capture_output=True, text=True, timeout=120)
    assert "synced" in r.stdout


# --- run 2: SIGKILL mid-stage, a second invocation meanwhile, SIGKILL mid-seal, then the rerun --------

@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    wd = tmp_path_factory.mktemp("killed")
    notes = {}
    first = smk(wd, env={SLOW_HOOK: "compare:300"}, popen=True)
    log = lambda: next(iter(wd.glob("evidence/faults/*/logs/compare.log")), None)  # noqa: E731
    wait_for(lambda: log() is not None and "pausing" in log().read_text(), "the compare stage to pause", proc=first)
    ev = evidence_of(wd)
    notes["second"] = smk(wd)  # a second invocation on the same evidence directory, meanwhile
    kill_group(first)
    notes["after_kill"] = sorted(p.relative_to(ev).as_posix() for p in ev.rglob("*") if p.is_file())
    notes["plain_rerun"] = smk(wd)  # Snakemake asks for --rerun-incomplete; the stale lock is gone by itself
    seal = smk(wd, "--rerun-incomplete", env={SLOW_HOOK: "seal:300"}, popen=True)
    seal_log = lambda: next(iter(wd.glob(".evident/logs/faults/*/seal.log")), None)  # noqa: E731
    wait_for(lambda: seal_log() is not None and "pausing" in seal_log().read_text(), "the seal to pause", proc=seal)
    kill_group(seal)
    notes["manifest_after_seal_kill"] = (ev / MANIFEST).exists()
    notes["rerun"] = smk(wd, "--rerun-incomplete")
    return wd, ev, notes


def test_second_invocation_is_refused_clearly(killed):
    _, _, notes = killed
    r = notes["second"]
    assert r.returncode != 0 and "is being written by another snakemake run (pid " in r.stdout + r.stderr
    # refused while parsing the Snakefile, before any job: nothing corrupted (the rerun below verifies and is
    # identical to an uninterrupted run)


def test_a_killed_stage_leaves_nothing_that_looks_complete(killed):
    _, _, notes = killed
    files = notes["after_kill"]
    assert MANIFEST not in files and "SUMMARY.md" not in files
    assert "stages/compare.json" not in files  # the stage's record: written last, so never for a killed stage
    r = notes["plain_rerun"]  # Snakemake knows the killed job's outputs are incomplete and says so
    assert r.returncode != 0 and "--rerun-incomplete" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    # the killed run's Snakemake lock files were cleared (no live run held the working directory), so no
    # `--unlock` was asked for; the rerun after the killed seal cleared them again
    for r in (notes["plain_rerun"], notes["rerun"]):
        assert "removed 2 stale Snakemake lock file(s)" in r.stderr and "--unlock" not in r.stdout + r.stderr
    assert not notes["manifest_after_seal_kill"]


def test_the_rerun_completes_identical_evidence(killed, outage):
    wd, ev, notes = killed
    r = notes["rerun"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert archive.intact(archive.verify(ev))
    clean = evidence_of(outage[0])  # the same campaign, never interrupted
    a, b = read_json(ev / MANIFEST)["files"], read_json(clean / MANIFEST)["files"]
    assert sorted(a) == sorted(b)
    stable = [rel for rel in a if not rel.startswith(TIME_VARYING)]
    assert len(stable) >= 8, stable
    assert [rel for rel in stable if a[rel]["sha256"] != b[rel]["sha256"]] == []
    for rel in a:  # stage records agree on all but the clock and timings
        if rel.startswith("stages/"):
            x, y = read_json(ev / rel), read_json(clean / rel)
            for k in ("started_utc", "finished_utc", "seconds", "metrics"):
                x.pop(k), y.pop(k)
            assert x == y, rel


def test_no_orphan_running_run_in_mlflow(killed):
    from mlflow.tracking import MlflowClient

    wd, ev, _ = killed
    c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("faults").experiment_id], max_results=1000)
    assert {r.info.status for r in runs} == {"FINISHED"}
    parents = [r for r in runs if r.data.tags.get("evident.kind") == "parent"]
    assert len(parents) == 1 and parents[0].data.tags["evident.id"] == ev.name
    m = read_json(ev / MANIFEST)
    assert m["tracking"]["status"] == "logged" and m["tracking"]["parent_run_id"] == parents[0].info.run_id
    assert sorted(r.data.tags["evident.stage"] for r in runs if r.data.tags.get("evident.kind") == "stage") \
        == sorted(m["stages"])


# --- one SQLite store, several writers at once -------------------------------------------------------

def test_concurrent_writers_of_one_sqlite_store(tmp_path):
    """Measured without the lock (workflow/tracking.store_lock): 7 of 8 writers failed on a fresh store."""
    n = 4
    dirs = [handbuilt.build(tmp_path / "evidence", "stress", f"aaaaaaa-c{i:08d}-r1", plot=False) for i in range(n)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("import sys; from evident.workflow import tracking; ids = tracking.log_evidence(sys.argv[1], sys.argv[2]); "
            "tracking.finish(sys.argv[1], ids, sys.argv[2])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(d), uri], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for d in dirs]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [o[-1500:] for o in outs]
    assert not any("database is locked" in o for o in outs)
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    runs = c.search_runs([c.get_experiment_by_name("stress").experiment_id], max_results=1000)
    assert len(runs) == n * 4 and {r.info.status for r in runs} == {"FINISHED"}  # a parent and 3 stages each
    for r in runs:
        assert all(len(c.get_metric_history(r.info.run_id, k)) == 1 for k in r.data.metrics)
