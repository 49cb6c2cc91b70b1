"""workflow/tracking.py against a real MLflow store (SQLite in a temporary directory).

The evidence directory is built by hand with workflow.evidence (config, summary, env, checkpoint,
two stage records and their outputs, then the manifest), the way seal.py lays it out.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import yaml

from workflow import tracking
from workflow.evidence import Stage, write_json, write_manifest, write_text

EID = "abc1234-c0123abcd-r1"
STAGES = ("compare", "oracle")  # stage records sort by name
PARENT_FILES = {"SUMMARY.md", "config.yaml", "env.json", "checkpoint.json"}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    # Every call below names its store; an ambient MLFLOW_TRACKING_URI must not leak in.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its schema migrated once; each test gets a copy (saves ~2 s each)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def uri(tmp_path, empty_store) -> str:
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture
def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.fixture
def ev(tmp_path) -> Path:
    root = tmp_path / "evidence" / EID
    root.mkdir(parents=True)
    write_text(root / "config.yaml", yaml.safe_dump({
        "campaign": "t1", "device": "cpu", "dtype": "float32", "tracking": {"enabled": True, "uri": None},
    }))
    write_text(root / "SUMMARY.md", "# t1\n\nverdict: all_token_text_exact\n")
    write_json(root / "env.json", {"python": "3.12", "torch": "2.x"})
    write_json(root / "checkpoint.json", {"kind": "synthetic", "files": {}})
    with Stage(root, "oracle", params={"cases": 2, "model": {"layers": 2, "vocab": 512}}) as st:
        st.write_json("oracle/hf.json", {"cases": [{"name": "a", "generated_ids": [1, 2, 3]}]})
        st.metrics["cases"] = 2
    with Stage(root, "compare", params={"near_tie_margin": 1e-4}) as st:
        st.write_json("parity/comparison.json", {"verdict": "all_token_text_exact", "cells": []})
        st.tags["parity.verdict"] = "all_token_text_exact"
        st.metrics["cells"] = 4
        st.metrics["cells_exact"] = 4
    return root


def seal(ev: Path, uri: str) -> dict:
    """What seal.py does: log, write the manifest, then attach it and finish the parent."""
    ids = tracking.log_evidence(ev, uri=uri)
    if not (ev / "MANIFEST.json").exists():
        write_manifest(ev, {"evidence_id": ev.name, "tracking": {"status": "logged", **ids}})
    tracking.finish(ev, ids, uri=uri)
    return ids


def all_runs(client, exp_id: str, view: str = "ALL"):
    from mlflow.entities import ViewType

    return client.search_runs([exp_id], run_view_type=getattr(ViewType, view), max_results=1000)


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    """Every artifact file of a run, recursively, as paths relative to the run's artifact root."""
    out = set()
    for a in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, a.path) if a.is_dir else {a.path}
    return out


def test_parent_and_one_child_per_stage(ev, uri, client):
    ids = seal(ev, uri)

    exp = client.get_experiment_by_name("t1")
    assert exp is not None and ids["experiment_id"] == exp.experiment_id
    runs = all_runs(client, exp.experiment_id)
    assert len(runs) == 3 and all(r.info.lifecycle_stage == "active" for r in runs)

    parents = [r for r in runs if r.data.tags.get("evident.kind") == "parent"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_id == ids["parent_run_id"]
    assert parent.info.run_name == EID
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["evident.id"] == EID
    assert tags["commit"] == "abc1234" and tags["device"] == "cpu"
    assert tags["verdict"] == "all_token_text_exact"
    assert parent.data.params == {"campaign": "t1", "device": "cpu", "dtype": "float32"}
    assert artifact_paths(client, parent.info.run_id) == PARENT_FILES | {"MANIFEST.json"}

    children = {r.data.tags["evident.stage"]: r for r in runs if r.data.tags.get("evident.kind") == "stage"}
    assert sorted(children) == sorted(STAGES)
    assert ids["child_run_ids"] == {name: r.info.run_id for name, r in children.items()}
    for name, r in children.items():
        assert r.data.tags["mlflow.parentRunId"] == ids["parent_run_id"]
        assert r.data.tags["evident.id"] == EID and r.data.tags["evident.status"] == "ok"
        assert r.info.run_name == name and r.info.status == "FINISHED"
        assert r.data.metrics["seconds"] >= 0

    oracle = children["oracle"]
    assert oracle.data.params == {"cases": "2", "model.layers": "2", "model.vocab": "512"}
    assert oracle.data.metrics == {"cases": 2.0, "seconds": oracle.data.metrics["seconds"]}
    assert oracle.data.tags["verdict"] == "all_token_text_exact"  # the campaign's verdict is tagged on every run
    assert artifact_paths(client, oracle.info.run_id) == {"oracle/hf.json", "stages/oracle.json"}

    compare = children["compare"]
    assert compare.data.tags["verdict"] == "all_token_text_exact"
    assert compare.data.params == {"near_tie_margin": "0.0001"}
    assert compare.data.metrics["cells"] == 4.0 and compare.data.metrics["cells_exact"] == 4.0
    assert artifact_paths(client, compare.info.run_id) == {"parity/comparison.json", "stages/compare.json"}


def test_logging_twice_reuses_every_run(ev, uri, client):
    first = seal(ev, uri)
    runs_before = {r.info.run_id: r.info.status for r in all_runs(client, first["experiment_id"])}
    artifacts_before = artifact_paths(client, first["parent_run_id"])

    second = seal(ev, uri)  # sync.py replaying an already-logged directory
    assert second == first
    runs_after = {r.info.run_id: r.info.status for r in all_runs(client, first["experiment_id"])}
    assert runs_after == runs_before  # no run created, deleted or reopened
    assert len(runs_after) == 1 + len(STAGES)
    assert artifact_paths(client, first["parent_run_id"]) == artifacts_before
    assert [e.name for e in client.search_experiments()].count("t1") == 1


@pytest.mark.parametrize("how", ["created_by_hand", "reopened"])
def test_half_logged_child_is_replaced(ev, uri, client, how):
    if how == "created_by_hand":
        # A crash right after create_run: parent and one child exist, the child RUNNING and empty.
        exp_id = client.create_experiment("t1")
        pid = client.create_run(exp_id, run_name=EID, tags={"evident.id": EID, "evident.kind": "parent"}).info.run_id
        stale = client.create_run(exp_id, run_name="oracle", tags={
            "evident.id": EID, "evident.kind": "stage", "evident.stage": "oracle", "mlflow.parentRunId": pid,
        }).info.run_id
    else:
        # A logged child whose status is RUNNING again (e.g. the process died before set_terminated).
        first = tracking.log_evidence(ev, uri=uri)
        exp_id, pid, stale = first["experiment_id"], first["parent_run_id"], first["child_run_ids"]["oracle"]
        client.set_terminated(stale, "RUNNING")
    assert client.get_run(stale).info.status == "RUNNING"

    ids = seal(ev, uri)
    assert ids["parent_run_id"] == pid
    assert ids["child_run_ids"]["oracle"] != stale
    assert client.get_run(stale).info.lifecycle_stage == "deleted"

    active = [r for r in all_runs(client, exp_id, "ACTIVE_ONLY") if r.data.tags.get("evident.stage") == "oracle"]
    assert [r.info.run_id for r in active] == [ids["child_run_ids"]["oracle"]]
    (child,) = active
    assert child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == pid
    assert child.data.metrics["cases"] == 2.0
    assert artifact_paths(client, child.info.run_id) == {"oracle/hf.json", "stages/oracle.json"}
    # The other stage was untouched or logged once; either way one active run per stage.
    stages = [r.data.tags.get("evident.stage") for r in all_runs(client, exp_id, "ACTIVE_ONLY")]
    assert sorted(s for s in stages if s) == sorted(STAGES)
    assert client.get_run(pid).info.status == "FINISHED"


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_unreachable_server_raises(ev, monkeypatch):
    # tracking.client() sets fail-fast retry/timeout defaults; make sure they are its own, not the caller's.
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    port = _closed_port()
    with pytest.raises(Exception, match=str(port)):  # MLflow's error names the store it failed to reach
        tracking.log_evidence(ev, uri=f"http://127.0.0.1:{port}")


def test_failed_stage_child_is_kept_on_replay(ev, uri, client):
    with pytest.raises(RuntimeError), Stage(ev, "parity") as st:
        st.write_json("parity/single-b1.json", {"partial": True})
        raise RuntimeError("engine crashed")
    first = seal(ev, uri)
    assert client.get_run(first["child_run_ids"]["parity"]).info.status == "FAILED"
    second = seal(ev, uri)
    assert second == first
