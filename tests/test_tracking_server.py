"""The parent run's headline as the MLflow UI reads it: `evident ui` itself (`mlflow ui` on loopback, SQLite
backend, proxied artifacts), the evidence logged over HTTP by workflow/tracking.py, then the server's REST API, the
one the UI calls: runs/get (metrics, tags, times), artifacts/list, get-artifact, experiments/get-by-name. Last,
SIGTERM to `evident ui`: one line printed in all, every process it started gone, the port closed.

Needs the full mlflow package (flask); skips without it.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_tracking import CAMPAIGN_START, HEADLINE_ARTIFACTS, HEADLINE_METRICS, HEADLINE_TAGS, build_headline, seal

from evident.workflow import tracking
from evident.workflow.archive import ui
from evident.workflow.core.evidence import read_json
from evident.workflow.plan.targets import free_port  # below the OS's ephemeral range, each port once

MLFLOW = Path(sys.executable).parent / "mlflow"
pytestmark = [
    pytest.mark.slow,  # ~15 s to start the server, ~15 s to log over HTTP on 2 busy cores (under 10 s idle)
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("flask") is None or not MLFLOW.is_file(),
                       reason="`mlflow server` needs the full mlflow package (flask)"),
]


def get(uri: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{uri}/{endpoint}?{urllib.parse.urlencode(query)}", timeout=10) as r:
        body = r.read()
    return body if endpoint == "get-artifact" else json.loads(body)


def start_ui(home: Path) -> tuple[str, subprocess.Popen]:
    """`evident ui` as a user runs it, on home/store.db and a free port, once its server answers: (URL, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "evident.workflow.cli", "ui", "--port", str(port),
                             "--tracking-uri", f"sqlite:///{home / 'store.db'}"],
                            cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    while True:
        log = home / ui.LOG
        assert proc.poll() is None, f"evident ui exited: {proc.stdout.read()} {log.read_text()[-2000:]}"
        try:
            if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                return uri, proc
        except OSError:
            pass
        assert time.monotonic() < deadline, f"mlflow ui not up: {log.read_text()[-2000:] if log.is_file() else ''}"
        time.sleep(0.2)


def stop_ui(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # evident ui stops its server's process group (test_sigterm_stops_everything_it_started)
        proc.wait(timeout=60)


def descendants(pid: int) -> set[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        out |= set(kids)
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie serves nothing
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-server")
    uri, proc = start_ui(home)
    try:
        yield uri, proc
    finally:
        stop_ui(proc)


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_parent_run_over_the_rest_api(server, tmp_path):
    server, _ = server
    ev = build_headline(tmp_path / "evidence")
    ids = seal(ev, server)  # log_evidence + manifest + finish, over HTTP
    assert seal(ev, server) == ids  # a replay changes nothing (checked below: each metric once)

    run = get(server, "api/2.0/mlflow/runs/get", run_id=ids["parent_run_id"])["run"]
    info, data = run["info"], run["data"]
    assert info["status"] == "FINISHED" and info["run_name"] == ev.name
    assert int(info["start_time"]) == tracking.ms(CAMPAIGN_START)
    assert int(info["end_time"]) == tracking.ms(read_json(ev / "MANIFEST.json")["sealed_utc"])
    metrics = {m["key"]: m["value"] for m in data["metrics"]}
    assert metrics == pytest.approx(HEADLINE_METRICS)
    assert len(data["metrics"]) == len(HEADLINE_METRICS)
    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert {k: v for k, v in tags.items() if not k.startswith("mlflow.")} == HEADLINE_TAGS
    for key in HEADLINE_METRICS:  # the history the UI charts: one point each
        history = get(server, "api/2.0/mlflow/metrics/get-history", run_id=ids["parent_run_id"], metric_key=key)
        assert len(history["metrics"]) == 1, key

    top = get(server, "api/2.0/mlflow/artifacts/list", run_id=ids["parent_run_id"])
    plots = get(server, "api/2.0/mlflow/artifacts/list", run_id=ids["parent_run_id"], path="plots")
    listed = {f["path"] for f in top["files"] if not f["is_dir"]} | {f["path"] for f in plots["files"]}
    assert {f["path"] for f in top["files"] if f["is_dir"]} == {"plots"}
    assert listed == HEADLINE_ARTIFACTS
    # what the UI's image view fetches: the plot beside SUMMARY.md, at the path its link names
    assert "](plots/bench.png)" in (ev / "SUMMARY.md").read_text()
    png = get(server, "get-artifact", path="plots/bench.png", run_uuid=ids["parent_run_id"])
    assert png == (ev / "plots/bench.png").read_bytes()

    exp = get(server, "api/2.0/mlflow/experiments/get-by-name", experiment_name="head")["experiment"]
    assert exp["experiment_id"] == ids["experiment_id"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"


def test_sigterm_stops_everything_it_started(server):
    """Run last: it stops the module's server. `mlflow ui` alone on SIGTERM leaves its workers serving the port."""
    uri, proc = server
    started = descendants(proc.pid)
    assert len(started) >= 2  # mlflow ui and its uvicorn
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = out.decode().splitlines()  # quiet: the URL and how to stop, no access log
    assert len(lines) == 1 and lines[0].startswith(f"evident ui: {uri} serves ") and "Ctrl-C" in lines[0], lines
    assert not [pid for pid in started if alive(pid)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(uri.rsplit(":", 1)[1])), timeout=2).close()
