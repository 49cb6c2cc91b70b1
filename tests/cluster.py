"""A real one-node Slurm cluster, PostgreSQL and an MLflow tracking server on it, all on loopback, for
tests/test_cluster.py (docs/gpu-and-cluster.md "Running on a cluster").

Debian's packages (slurmctld, slurmd, slurm-client, munge, postgresql) are installed when missing (as root,
through apt-get); each daemon runs in the foreground as a child of the test, and `stop()` ends them and removes
/etc/slurm/slurm.conf (a slurm.conf without its controller makes every `snakemake` start wait ~9 s once the
Slurm executor plugin is installed: docs/gpu-and-cluster.md "Cluster notes"). Whatever cannot be set up raises `Unavailable`
with the reason, and the test skips saying it.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from evident.workflow.plan.targets import (  # free_port: below the OS's ephemeral range, each port once
    free_port,
    port_free,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "postgresql"]
SLURM_CONF = Path("/etc/slurm/slurm.conf")
MARK = "# written by evident's tests/cluster.py: removed when the test ends"
PARTITION = "main"


_LOCAL_RUN: dict = {}
# The tests that read or change the default run's working directory (test_pipeline, test_archive, test_cluster): one
# pytest-xdist group, so one worker runs them one after another, as a serial session does.
DEFAULT_RUN = "default-run"
shares_default_run = pytest.mark.xdist_group(DEFAULT_RUN)
# A module whose fixture waits for the default run (trained_checkpoint) from another worker: tests/conftest.py orders
# it after the other end-to-end units, by when that run has ended, rather than idle on its lock.
waits_for_default_run = pytest.mark.waits_for_default_run


def session_dir(tmp_path_factory) -> Path:
    """The test session's temporary directory: under pytest-xdist each worker has its own basetemp in it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def default_local_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, float]:
    """The default campaign (config/config.yaml) run locally as a user runs it (`snakemake -c2`, tracking in the
    working directory's mlflow.db), once per test session: (working directory, the run, its seconds). Tests that
    compare against a local run share it rather than pay for another (a full run is minutes on two cores).

    Once per session across pytest-xdist workers too: the first to ask runs it under a file lock in the session's
    directory and records it there; a worker that asks meanwhile waits for that run. Its working directory is
    changed only by tests in shares_default_run; other workers use the trained checkpoint's copy alone."""
    if not _LOCAL_RUN:
        root = session_dir(tmp_path_factory)
        record = root / "default-run.json"
        with open(root / "default-run.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not record.exists():
                wd = root / "default"
                wd.mkdir()
                env = {k: v for k, v in os.environ.items()
                       if k != "MLFLOW_TRACKING_URI" and not k.startswith("SLURM_")}
                t0 = time.perf_counter()
                r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(wd),
                                    "-c2"], capture_output=True, text=True, env=env, timeout=900)
                seconds = time.perf_counter() - t0
                # a copy of its trained checkpoint, before any test removes that working directory's .evident, and
                # of its quality stage's results (tests/test_quality_mutants.py replays them rather than run them again)
                ckpt = [str(shutil.copytree(src, root / "trained" / src.name))
                        for src in (wd / ".evident/checkpoints").glob("trained-*/")]
                quality = [str(shutil.copytree(src, root / "default-quality"))
                           for src in (wd / "evidence/tiny").glob("*/quality/")]
                record.write_text(json.dumps({"wd": str(wd), "args": r.args, "returncode": r.returncode,
                                              "stdout": r.stdout, "stderr": r.stderr, "seconds": seconds,
                                              "checkpoint": ckpt[-1] if ckpt else None,
                                              "quality": quality[0] if len(quality) == 1 else None}))
        run = json.loads(record.read_text())
        _LOCAL_RUN["run"] = (Path(run["wd"]), subprocess.CompletedProcess(run["args"], run["returncode"],
                                                                         run["stdout"], run["stderr"]),
                             run["seconds"])
        if run["checkpoint"]:
            _LOCAL_RUN["checkpoint"] = Path(run["checkpoint"])
        if run["quality"]:
            _LOCAL_RUN["quality"] = Path(run["quality"])
    return _LOCAL_RUN["run"]


def trained_checkpoint(tmp_path_factory) -> Path:
    """The default campaign's trained checkpoint, from the shared local run (training it is over a minute)."""
    wd, r, _ = default_local_run(tmp_path_factory)
    if "checkpoint" not in _LOCAL_RUN:
        raise AssertionError(f"the default run left no trained checkpoint: {r.stdout[-3000:]}{r.stderr[-3000:]}")
    return _LOCAL_RUN["checkpoint"]


def default_quality(tmp_path_factory) -> Path:
    """A copy of the default run's quality/ folder (its GSM8K results and rows of hf and the engine, and the gate)."""
    wd, r, _ = default_local_run(tmp_path_factory)
    if "quality" not in _LOCAL_RUN:
        raise AssertionError(f"the default run left no quality results: {r.stdout[-3000:]}{r.stderr[-3000:]}")
    return _LOCAL_RUN["quality"]


def seed_checkpoint_cache(wd: Path, tmp_path_factory) -> None:
    """Put the default campaign's trained checkpoint in wd's cache, so that a run of the default campaign there
    finds it as a second run of a user finds theirs."""
    src = trained_checkpoint(tmp_path_factory)
    shutil.copytree(src, wd / ".evident/checkpoints" / src.name)


# `mlflow server` without its job runner (MLflow 3's GenAI jobs and trace rollups, which evident never asks for): seven
# huey consumer processes fewer, each importing mlflow at the server's start and then polling on the test's two cores.
# The tracking API the tests use is the same. tests/reliability/test_faults.py starts its servers so too.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

# Snakemake run with the Slurm executor plugin's wait between status checks capped at POLL_CAP_S. The plugin waits
# --slurm-init-seconds-before-status-checks after a check that saw a job end, else 10 s longer than the last wait
# (1, 11, 21, 31 ... s: not configurable in 2.8.0), so a job that takes 15 s is seen ended 18 s late, and each late
# end delays the jobs that need its outputs. Capped, an end is seen within POLL_CAP_S; what is submitted, how and
# how its status is read (squeue) are the plugin's own. Where the plugin's internals are not as expected the cap is
# left out (a slower run, the same run).
POLL_CAP_S = 2
SNAKEMAKE_POLL_CAPPED = f"""import sys
try:
    import snakemake_executor_plugin_slurm as slurm
    from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

    _wait = RemoteExecutor.next_seconds_between_status_checks
    if isinstance(_wait, property) and "next_seconds_between_status_checks" not in vars(slurm.Executor):
        slurm.Executor.next_seconds_between_status_checks = property(
            _wait.fget, lambda self, s: _wait.fset(self, s if s is None else min(s, {POLL_CAP_S})))
except ImportError:
    pass
from snakemake.cli import main

main(sys.argv[1:])
"""


class Unavailable(Exception):
    """This machine cannot run the daemon: the test skips with this reason."""


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def wait_for(pred, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise Unavailable(f"{what} exited ({proc.returncode}) before it was ready: {tail}")
        time.sleep(0.3)
    raise Unavailable(f"{what} was not ready within {timeout:.0f}s")


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


def missing() -> list[str]:
    need = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
    out = [pkg for exe, pkg in need.items() if not shutil.which(exe) and not Path(f"/usr/sbin/{exe}").exists()]
    return out + ([] if postgres_bin() else ["postgresql"])


def install() -> float:
    """Install what is missing (Debian, as root). Returns the seconds it took (0 when nothing was missing)."""
    todo = missing()
    if not todo:
        return 0.0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable(f"missing {', '.join(todo)} and cannot install them here (needs root and apt-get: "
                          f"apt-get install {' '.join(PACKAGES)})")
    t0 = time.perf_counter()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        r = run(cmd, timeout=600, env=env)
        if r.returncode != 0:
            raise Unavailable(f"`{' '.join(cmd)}` failed: {(r.stdout + r.stderr)[-1500:]}")
    if missing():
        raise Unavailable(f"still missing after apt-get install: {', '.join(missing())}")
    return time.perf_counter() - t0


class Daemons:
    """munged, slurmctld, slurmd, postgres and `mlflow server`, started in that order, stopped in reverse."""

    def __init__(self, root: Path, shared: Path):
        self.root, self.shared = root, shared  # root: daemon state; shared: the "shared file system"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.wrote_conf = False
        self.pg_port = self.mlflow_port = None
        self.pg_dir = None

    # --- start ---------------------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=None if env is None else {**os.environ, **env})
        self.procs.append((name, proc))
        return proc

    def munge(self) -> None:
        if run(["sh", "-c", "munge -n | unmunge"], timeout=30).returncode == 0:
            return  # a munged already runs here: use it
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        if not Path("/etc/munge/munge.key").exists():
            r = run(["runuser", "-u", "munge", "--", "mungekey", "--create"], timeout=60)
            if r.returncode != 0:
                raise Unavailable(f"cannot create a munge key: {r.stderr[-500:]}")
        log = self.root / "munged.log"
        proc = self._spawn("munged", ["runuser", "-u", "munge", "--", "munged", "--foreground"], log)
        wait_for(lambda: run(["sh", "-c", "munge -n | unmunge"], timeout=30).returncode == 0, "munged", 30, proc, log)

    def slurm(self) -> None:
        if SLURM_CONF.exists() and MARK not in SLURM_CONF.read_text():
            raise Unavailable(f"{SLURM_CONF} exists and was not written by this test: a real Slurm configuration "
                              "is not overwritten")
        for port in (6817, 6818):
            if not port_free(port):
                raise Unavailable(f"port {port} (Slurm's default) is in use on loopback")
        state = self.root / "slurm"
        for d in ("state", "spool", "log"):
            (state / d).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text(f"""{MARK}
# One node on loopback: no cgroups (proctrack/linuxproc, task/none), no accounting database.
ClusterName=evident
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={state}/state
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# finished jobs stay visible to squeue, the plugin's status command without accounting
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={int(mem_mb * 0.8)} State=UNKNOWN
PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        self.wrote_conf = True
        ctld = self._spawn("slurmctld", ["slurmctld", "-D"], self.root / "slurmctld.out")
        wait_for(lambda: run(["scontrol", "ping"], timeout=10).stdout.count("UP") > 0, "slurmctld", 60, ctld,
                 self.root / "slurmctld.out")
        d = self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost"], self.root / "slurmd.out")
        wait_for(lambda: run(["sinfo", "-h", "-o", "%T"], timeout=10).stdout.strip() == "idle", "slurmd", 60, d,
                 self.root / "slurmd.out")
        r = run(["srun", "-n1", "-t", "1", "true"], timeout=60)
        if r.returncode != 0:
            raise Unavailable(f"the one-node cluster does not run a job: {r.stderr[-800:]}")

    def _as_postgres(self, cmd: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd

    def postgres(self) -> str:
        """A fresh cluster on a free loopback port (trust auth: the test's own), with database `mlflow`."""
        pg = postgres_bin()
        # under /tmp, not pytest's 0700 tmp directory: the server runs as user postgres
        self.pg_dir = Path(tempfile.mkdtemp(prefix="evident-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.pg_dir, "postgres", "postgres")
        data = self.pg_dir / "data"
        r = run(self._as_postgres([str(pg / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                                   "--no-sync"]), timeout=180)
        if r.returncode != 0:
            raise Unavailable(f"initdb failed: {(r.stdout + r.stderr)[-800:]}")
        self.pg_port = free_port()
        log = self.pg_dir / "postgres.log"
        proc = self._spawn("postgres", self._as_postgres(
            [str(pg / "postgres"), "-D", str(data), "-p", str(self.pg_port), "-k", str(self.pg_dir),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]), log)
        ready = [str(pg / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.pg_port)]
        wait_for(lambda: run(ready, timeout=10).returncode == 0, "postgres", 60, proc, log)
        r = run([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(self.pg_port), "-U", "postgres", "mlflow"])
        if r.returncode != 0:
            raise Unavailable(f"createdb failed: {r.stderr[-500:]}")
        return self.pg_uri

    @property
    def pg_uri(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/mlflow"

    def mlflow(self) -> None:
        """`mlflow server` on PostgreSQL, artifacts written by the jobs straight to the shared file system.

        Started, not waited for (its first start migrates the database: ~20 s): `mlflow_ready()` waits."""
        mlflow = Path(sys.executable).with_name("mlflow")
        self.mlflow_port = free_port()
        (self.shared / "mlflow-artifacts").mkdir(parents=True, exist_ok=True)
        self.mlflow_log = self.root / "mlflow-server.log"
        self.mlflow_proc = self._spawn(
            "mlflow", [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port),
                       "--backend-store-uri", self.pg_uri,
                       "--default-artifact-root", str(self.shared / "mlflow-artifacts"), "--no-serve-artifacts",
                       "--workers", "1"], self.mlflow_log, env=SERVER_ENV)

    def mlflow_ready(self) -> str:
        def up():
            try:
                return urllib.request.urlopen(f"{self.mlflow_uri}/health", timeout=2).status == 200
            except OSError:
                return False

        wait_for(up, "mlflow server", 180, self.mlflow_proc, self.mlflow_log)
        return self.mlflow_uri

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    # --- stop ----------------------------------------------------------------------------------------------

    def stop(self) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                except ProcessLookupError:
                    pass
        self.procs.clear()
        if self.wrote_conf and SLURM_CONF.exists() and MARK in SLURM_CONF.read_text():
            SLURM_CONF.unlink()
        self.wrote_conf = False
        if self.pg_dir is not None:
            shutil.rmtree(self.pg_dir, ignore_errors=True)
            self.pg_dir = None
