"""`evident ui`: MLflow's web UI on this working directory's store, bound to loopback.

The UI needs the full mlflow package (the project's `ui` extra; a plain install has mlflow-skinny, which logs but
does not serve). The first call installs the extra's requirements into this environment from the package registry.
While the UI runs, the static archive (evidence/index.html) links each evidence directory to its MLflow runs on it;
when it stops, the archive is written again without those links, so none points at a server that is gone.

The server is quiet: its output (no access log) goes to `.evident/ui.log`, shown only if it fails. It runs in its
own process group, which Ctrl-C, SIGTERM and SIGHUP to `evident ui` stop whole (`mlflow ui` leaves its uvicorn
workers and job runner serving the port when only its own process is signalled).
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement

from evident.workflow.core.evidence import interrupt

HOST = "127.0.0.1"  # never another interface: the store has no authentication
DEFAULT_STORE = "sqlite:///mlflow.db"  # MLflow's default tracking URI, which the pipeline logs to
LOG = Path(".evident/ui.log")
# One user on loopback: one uvicorn worker and no job runner (its 7 huey consumers serve GenAI scorers and trace
# archival, not runs), 2 processes in all instead of 15, which also start faster.
ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def store(uri: str | None) -> str:
    """The store to serve: the given URI, else MLFLOW_TRACKING_URI, else the working directory's mlflow.db."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_STORE


def ui_requirements() -> list[str]:
    """The `ui` extra's requirements, as this installed project declares them (pyproject.toml)."""
    reqs = [Requirement(r) for r in importlib.metadata.requires("evident") or []]
    # a requirement of the extra holds with extra "ui" and not without it (a platform marker holds with either)
    return [str(r).split(";")[0].strip() for r in reqs
            if r.marker is not None and r.marker.evaluate({"extra": "ui"}) and not r.marker.evaluate({"extra": ""})]


def has_server() -> bool:
    """The full mlflow distribution (not only mlflow-skinny) is installed."""
    try:
        importlib.metadata.distribution("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install() -> int:
    reqs = ui_requirements()
    print(f"evident ui: installing the MLflow UI ({', '.join(reqs)}) into {Path(sys.prefix).as_posix()}", flush=True)
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *reqs])


def command(uri: str, port: int) -> list[str]:
    return [sys.executable, "-m", "mlflow", "ui", "--host", HOST, "--port", str(port), "--backend-store-uri", uri,
            "--workers", "1", "--uvicorn-opts", "--no-access-log"]


def serve(cmd: list[str]) -> int:
    """Run the server in its own process group until it exits or this process is interrupted or terminated; then
    stop the whole group (TERM, then KILL after 20 s). Its exit status, 0 when stopped here."""
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **ENV})
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, interrupt) for s in signals}  # SIGTERM and SIGHUP stop it as Ctrl-C does
    try:
        rc = proc.wait()
        if rc:
            print(f"evident ui: mlflow ui exited with {rc}; its log ({LOG}):\n{LOG.read_text()[-3000:]}",
                  file=sys.stderr)
        return rc
    except KeyboardInterrupt:
        return 0
    finally:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop short
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            deadline = time.monotonic() + grace
            try:
                os.killpg(proc.pid, sig)
                while time.monotonic() < deadline:  # until the group is gone: its workers outlive `mlflow ui`
                    proc.poll()  # reaps the leader, so that it stops counting
                    os.killpg(proc.pid, 0)
                    time.sleep(0.1)
            except ProcessLookupError:
                break
        for s, handler in old.items():
            signal.signal(s, handler)


def cmd_ui(args) -> int:
    from evident.workflow.archive import pages

    uri = store(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"evident ui: the store is a tracking server, whose UI is already there: {uri}")
        return 0
    if not has_server() and install() != 0:
        print("evident ui: could not install the MLflow UI; try: pip install " + shlex.join(ui_requirements()),
              file=sys.stderr)
        return 1
    url = f"http://{HOST}:{args.port}"
    index = Path(args.root) / "index.html"
    if index.parent.is_dir():
        pages.write_archive(args.root, url)
    links = f"; {index.as_posix()} links each directory's runs" if index.parent.is_dir() else ""
    print(f"evident ui: {url} serves {uri}{links} (Ctrl-C stops it)", flush=True)
    try:
        return serve(command(uri, args.port))
    finally:
        if index.parent.is_dir():
            pages.write_archive(args.root)


def add_parser(sub) -> None:
    p = sub.add_parser("ui", help="MLflow's web UI on this directory's store, on 127.0.0.1 (installs it on first use)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else mlflow.db here")
    p.set_defaults(func=cmd_ui)
