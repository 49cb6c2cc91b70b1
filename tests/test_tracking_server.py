"""The parent run's headline as the MLflow UI reads it: the real server `evident ui` starts (`mlflow ui` on
loopback, SQLite backend, proxied artifacts), the evidence logged over HTTP by workflow/tracking.py, then the
server's REST API, the one the UI calls: runs/get (metrics, tags, times), artifacts/list, get-artifact,
experiments/get-by-name.

Needs the full mlflow package (flask); skips without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from test_tracking import (CAMPAIGN_START, HEADLINE_ARTIFACTS, HEADLINE_METRICS, HEADLINE_TAGS, build_headline,
                           seal)
from evident.workflow import tracking, ui
from evident.workflow.evidence import read_json
from evident.workflow.targets import free_port  # below the OS's ephemeral range, each port once

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-server")
    uri = f"http://127.0.0.1:{free_port()}"
    log = open(home / "server.log", "wb")
    # the server `evident ui` starts (workflow/ui.py), its artifacts served from ./mlartifacts (MLflow's default)
    proc = subprocess.Popen(ui.command(f"sqlite:///{home / 'store.db'}", int(uri.rsplit(":", 1)[1])),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=home)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"mlflow server exited: {(home / 'server.log').read_text()[-2000:]}"
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mlflow server not up: {(home / 'server.log').read_text()[-2000:]}"
            time.sleep(0.2)
        yield uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its workers
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_parent_run_over_the_rest_api(server, tmp_path):
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
