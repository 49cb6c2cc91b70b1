"""`evident run` (workflow/cli.py): the arguments it hands snakemake, and why `--rerun-incomplete` is among them: a run
stopped by Ctrl-C goes on with it, where a plain rerun is refused (a tiny Snakefile of its own, not the campaign)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from evident.workflow import cli

SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def test_run_adds_rerun_incomplete_unless_the_user_chose(monkeypatch):
    assert cli.snakemake_argv(["-c2", "--configfile", "a.yaml", "b.yaml"]) == [
        "--rerun-incomplete", "-c2", "--configfile", "a.yaml", "b.yaml"]  # first: no option takes it as a value
    for own in ("--rerun-incomplete", "--ri", "--ignore-incomplete", "--ii"):
        assert cli.snakemake_argv(["-c1", own]) == ["-c1", own]
    execs = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: execs.append((exe, argv)))
    mask = os.umask(0o022)
    try:
        cli.main(["run", "-n", "--cores", "1"])
    finally:
        os.umask(mask)
    assert execs == [(SNAKEMAKE, [str(SNAKEMAKE), "--rerun-incomplete", "-n", "--cores", "1"])]


SNAKEFILE = """
rule all:
    input: "out.txt"

rule slow:
    output: "out.txt"
    # the first run writes part of its output, then waits to be stopped; a rerun writes it whole
    shell: "echo part > {output}; if [ ! -e started ]; then touch started; sleep 60; fi; echo whole >> {output}"
"""


def test_a_run_stopped_by_ctrl_c_goes_on_with_rerun_incomplete(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)

    def snakemake(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(SNAKEMAKE), "-c1", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    first = subprocess.Popen([str(SNAKEMAKE), "-c1"], cwd=tmp_path, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the job's `sleep` started, so that Ctrl-C meets the job itself, as a user's would
        for _ in range(5):  # Ctrl-C: the terminal signals the whole foreground group; pressed again if unheard
            os.killpg(first.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                first.wait(timeout=10)
                break
        assert first.wait(timeout=60) != 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    plain = snakemake()
    assert plain.returncode != 0 and "IncompleteFilesException" in plain.stderr
    again = snakemake(*cli.snakemake_argv([]))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "out.txt").read_text() == "part\nwhole\n"
