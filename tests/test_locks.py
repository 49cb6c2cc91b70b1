"""The pipeline's locks (workflow/core/locks.py) as a user meets them: a refused run leaves no lock file behind, and a
second campaign started while a run is live is told which run holds the working directory and that `--unlock` is
only for a run that was killed; the live run goes on unharmed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tinyev
import yaml

from evident.workflow.core import locks
from evident.workflow.core.layout import MANIFEST

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
RELEASE = "EVIDENT_TEST_RELEASE"
# a run held live: its oracle stage, once its files are written, waits for the file named in RELEASE
HOOK = f"""
import os, time
if os.environ.get("{RELEASE}"):
    import evident.workflow.core.evidence as ev
    _exit = ev.Stage.__exit__

    def _held(self, *exc):
        if self.primary and self.name == "oracle" and exc[0] is None:
            print("[oracle] held", flush=True)
            while not os.path.exists(os.environ["{RELEASE}"]):
                time.sleep(0.2)
        return _exit(self, *exc)

    ev.Stage.__exit__ = _held
"""
# a process that holds a lock as a run does (locks.hold) until its stdin closes
HOLDER = ("import sys\nfrom pathlib import Path\nfrom evident.workflow.core import locks\n"
          "locks.hold(Path(sys.argv[1]), locks.describe('tiny', 'X', ['c.yaml']))\n"
          "print('held', flush=True)\nsys.stdin.read()\n")
SINCE = r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+"


def lock_files(wd: Path) -> list[str]:
    return sorted(p.relative_to(wd).as_posix() for p in (wd / ".evident/locks").rglob("*"))


def holder(wd: Path, lock: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, lock], cwd=wd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "held\n"
    return p


# --- the locks ---------------------------------------------------------------------------------------------------

def test_a_lock_names_its_holder_and_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock = Path(".evident/locks/tiny/X.lock")
    p = holder(tmp_path, str(lock))
    who = rf"pid {p.pid}, {SINCE}: campaign tiny, evidence X, config c.yaml"
    with pytest.raises(locks.Held, match=f"^{who}$"):
        locks.take(lock)
    [live] = locks.live_runs()
    assert re.fullmatch(who, live)
    text = locks.refusal()
    assert f"\n  {live}\n" in text and "Do not run --unlock: it is only for the locks of a run that was killed" in text
    p.stdin.close()
    assert p.wait(10) == 0
    assert lock_files(tmp_path) == [] and not Path(".evident/locks").exists()  # its file and folders went with it
    assert locks.live_runs() == []


def test_a_killed_run_s_lock_file_goes_with_the_next_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = holder(tmp_path, ".evident/locks/other/Y.lock")
    p.kill()
    p.wait(10)
    assert lock_files(tmp_path) == [".evident/locks/other", ".evident/locks/other/Y.lock"]  # SIGKILL: no exit hook
    alone = "from evident.workflow.core import locks\nprint(locks.share_workdir()[1])\n"
    r = subprocess.run([sys.executable, "-c", alone], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.stdout == "0\n", r.stderr  # alone: no Snakemake lock to remove, the killed run's lock file taken and gone
    assert lock_files(tmp_path) == []


# --- as a user meets them ----------------------------------------------------------------------------------------

def smk(wd: Path, campaign: str, *args: str, env: dict | None = None, log: Path | None = None):
    """Snakemake on a campaign file beside `wd` (the synthetic tiny model, the oracle alone); with `log`, started in
    the background, in its own process group (to stop it whole should the test fail), its output in `log`."""
    cfg = wd.parent / f"{campaign}.yaml"
    cfg.write_text(yaml.safe_dump({"campaign": campaign, "device": "cpu", "checkpoint": tinyev.synthetic(),
                                   "stages": ["oracle"], "cases": [{"name": "hi", "prompt": "Hello, evident!",
                                                                    "max_new_tokens": 4}]}))
    e = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", RELEASE)} | (env or {})
    cmd = [str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-c1", *args, "--configfile", str(cfg)]
    if log is not None:
        return subprocess.Popen(cmd, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)


def test_a_run_refused_after_the_snakefile_is_read_leaves_no_lock_file(tmp_path):
    wd = tmp_path / "wd"
    r = smk(wd, "mini", "no-such-target")
    assert r.returncode != 0 and "No rule to produce no-such-target" in r.stdout + r.stderr, r.stderr[-3000:]
    assert not (wd / ".evident/locks").exists()  # it held its evidence directory's lock until it was refused


@pytest.mark.slow
def test_a_second_campaign_is_told_which_run_is_live_and_not_to_unlock(tmp_path):
    wd, release, log = tmp_path / "wd", tmp_path / "release", tmp_path / "first.log"
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook/sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(tmp_path / "hook"), os.environ.get("PYTHONPATH")]))
    first = smk(wd, "first", env={RELEASE: str(release), "PYTHONPATH": path}, log=log)
    try:
        stage = lambda: next(iter(wd.glob("evidence/first/*/logs/oracle.log")), None)  # noqa: E731
        deadline = time.monotonic() + 300
        while not (stage() and "[oracle] held" in stage().read_text()):
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        held = lock_files(wd), sorted(p.name for p in (wd / ".snakemake/locks").iterdir())
        [eid] = [p.name for p in (wd / "evidence/first").iterdir()]

        second = smk(wd, "second")
        out = second.stdout + second.stderr
        assert second.returncode != 0, out[-3000:]
        assert (f"Error: Directory cannot be locked: another run is live in this working directory ({wd}) and has "
                "locked files that this one would write too (every campaign's run rewrites evidence/index.html):\n"
                ) in out, out[-3000:]
        config = re.escape(f"{tmp_path}/first.yaml")
        who = rf"pid {first.pid}, {SINCE}: campaign first, evidence {eid}, config {config}"
        assert re.search(rf"\n  {who}\n"
                         r"Wait for it to end \(or stop it\), then run again\. Do not run --unlock: it is only for the "
                         "locks of a run that was killed", out), out[-3000:]
        assert "It can be removed with the --unlock argument" not in out  # Snakemake's own advice
        # the refused run left nothing behind, and the live run's locks are as they were
        assert (lock_files(wd), sorted(p.name for p in (wd / ".snakemake/locks").iterdir())) == held
        assert held == ([".evident/locks/first", f".evident/locks/first/{eid}.lock", ".evident/locks/workdir.lock"],
                        ["0.input.lock", "0.output.lock"])

        release.touch()  # the live run goes on to its seal
        assert first.wait(600) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(60)
    assert (wd / "evidence/first" / eid / MANIFEST).is_file()
    assert lock_files(wd) == [] and not list((wd / ".snakemake/locks").glob("*"))


# --- the flock primitives (workflow/core/locks.py; used by gpus, tracking and archive) --------------------------------

def test_the_flock_primitives_see_each_other(tmp_path):
    """`held`/`holder` see an exclusive holder and make no file; `try_flock` never waits; `flocked` waits its turn.
    flocks belong to an open file, so two opens in one process refuse each other as two processes would."""
    import threading

    path = tmp_path / "x.lock"
    assert not locks.held(path) and locks.holder(path) is None and not path.exists()  # probing makes no file
    with locks.flocked(path) as f:
        f.write("pid 1\n")
        f.flush()
        assert locks.held(path) and locks.holder(path) == "pid 1"
        assert locks.try_flock(path) is None and locks.try_flock(path, shared=True) is None
        entered = threading.Event()

        def wait_for_it():
            with locks.flocked(path):
                entered.set()

        t = threading.Thread(target=wait_for_it)
        t.start()
        assert not entered.wait(0.3)  # blocking: it waits while the lock is held
    t.join(10)
    assert entered.is_set() and not locks.held(path) and locks.holder(path) is None and path.exists()
    with locks.flocked(path, shared=True):
        assert not locks.held(path)  # the probe is shared: a shared holder is not "held"
        other = locks.try_flock(path, shared=True)
        assert other is not None and locks.try_flock(path) is None
        other.close()
    mine = locks.try_flock(path)
    assert mine is not None and locks.held(path)
    mine.close()  # closing lets go
    assert not locks.held(path)
