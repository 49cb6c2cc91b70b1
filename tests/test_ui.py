"""`evident ui` (workflow/archive/ui.py): the MLflow UI on the working directory's store, on loopback, installed on
first use, with the static archive linking to it while it runs. The command itself serves the REST API test of
tests/test_tracking_server.py, which also stops it by SIGTERM, and the browser's, tests/test_mlflow_browser.py."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from evident.workflow.archive import ui

ROOT = Path(__file__).resolve().parents[1]


def args(tmp_path, **kw) -> argparse.Namespace:
    return argparse.Namespace(root=tmp_path / "evidence", port=5123, tracking_uri=None, **kw)


def test_the_ui_extra_is_the_projects():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ui"]
    assert ui.ui_requirements() == [str(Requirement(r)) for r in extra]


def test_store_and_command_bind_loopback(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert ui.store(None) == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///other.db")
    assert ui.store(None) == "sqlite:///other.db" and ui.store("sqlite:///given.db") == "sqlite:///given.db"
    cmd = ui.command("sqlite:///x.db", 5001)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5001"
    assert cmd[cmd.index("--backend-store-uri") + 1] == "sqlite:///x.db"
    assert cmd[cmd.index("--uvicorn-opts") + 1] == "--no-access-log"  # quiet: no line a request


def test_a_tracking_server_is_not_served_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ui, "serve", lambda *a, **k: pytest.fail("nothing to start"))
    given = argparse.Namespace(root=tmp_path / "evidence", port=5000, tracking_uri="http://10.0.0.1:5000")
    assert ui.cmd_ui(given) == 0
    assert "already there: http://10.0.0.1:5000" in capsys.readouterr().out


def test_first_use_installs_then_serves_and_the_archive_links_only_while_it_runs(tmp_path, monkeypatch):
    import handbuilt

    handbuilt.build(tmp_path / "evidence", tracking={"status": "logged", "experiment_id": "7", "parent_run_id": "p1"})
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(ui, "has_server", lambda: False)
    calls, linked = [], []

    def serve(cmd):  # while the UI runs, the index points at the runs on it
        calls.append(cmd)
        linked.append("http://127.0.0.1:5123/#/experiments/7/runs/p1" in (tmp_path / "evidence/index.html").read_text())
        return 0

    monkeypatch.setattr(ui.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(ui, "serve", serve)
    assert ui.cmd_ui(args(tmp_path)) == 0
    assert calls[0][-len(ui.ui_requirements()) - 3:-len(ui.ui_requirements())] == ["pip", "install", "-q"]
    assert calls[1] == ui.command("sqlite:///mlflow.db", 5123)
    assert linked == [True]
    assert "127.0.0.1:5123" not in (tmp_path / "evidence/index.html").read_text()  # written again without


def test_a_failed_install_says_how(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ui, "has_server", lambda: False)
    monkeypatch.setattr(ui.subprocess, "call", lambda cmd: 1)
    assert ui.cmd_ui(args(tmp_path)) == 1
    assert "pip install 'mlflow<" in capsys.readouterr().err  # quoted for the shell: a range has a '<' 


def test_a_server_that_fails_shows_its_log(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cmd = [sys.executable, "-c", "import sys; print('port in use'); sys.exit(3)"]
    assert ui.serve(cmd) == 3
    assert "exited with 3" in (err := capsys.readouterr().err) and "port in use" in err
