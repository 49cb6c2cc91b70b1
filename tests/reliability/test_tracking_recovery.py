"""MLflow after a killed seal: no orphan RUNNING run of an evidence id is left once it is logged again."""

from __future__ import annotations

import time

import handbuilt
from evident.workflow import tracking


def test_stale_running_parents_are_reused_or_marked_failed(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ev = handbuilt.build(tmp_path / "evidence", "tiny", "aaaaaaa-c11111111-r1", plot=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("tiny")
    tags = {"evident.id": ev.name, "evident.kind": "parent"}
    first = c.create_run(exp, run_name=ev.name, tags=tags)  # a seal killed after creating its parent ...
    time.sleep(0.01)
    second = c.create_run(exp, run_name=ev.name, tags=tags)  # ... and a racing one
    ids = tracking.log_evidence(ev, uri)
    tracking.finish(ev, ids, uri)
    assert ids["parent_run_id"] == first.info.run_id
    assert c.get_run(first.info.run_id).info.status == "FINISHED"
    assert c.get_run(second.info.run_id).info.status == "FAILED"
    assert {r.info.status for r in c.search_runs([exp])} <= {"FINISHED", "FAILED"}
    again = tracking.log_evidence(ev, uri)  # idempotent: nothing new
    assert again == ids and len(c.search_runs([exp])) == 2 + len(ids["child_run_ids"])
