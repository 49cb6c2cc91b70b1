"""MLflow mapping: experiment = campaign, parent run = evidence directory, child run = stage.

The evidence directory is the source of truth; this module only replays it into MLflow, finding
runs by tag so that logging twice never creates a duplicate.
"""

from __future__ import annotations

import os
from pathlib import Path

from workflow.evidence import read_config, stage_records, verdict_of

PARENT_FILES = ("SUMMARY.md", "config.yaml", "env.json", "checkpoint.json")
MAX_PARAM_CHARS = 6000


def client(uri: str | None = None):
    # Fail fast when a server is down: MLflow's default is minutes of retries per request.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or os.environ.get("MLFLOW_TRACKING_URI") or None)


def _experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp else c.create_experiment(name)


def _find(c, exp_id: str, filters: list[str]):
    runs = c.search_runs([exp_id], filter_string=" and ".join(filters), max_results=2)
    return runs[0] if runs else None


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = str(v)[:MAX_PARAM_CHARS]
    return out


def _log_run(c, run_id: str, params: dict, metrics: dict, tags: dict, files: list[Path], root: Path) -> None:
    from mlflow.entities import Metric, Param, RunTag

    c.log_batch(
        run_id,
        metrics=[Metric(k, float(v), 0, 0) for k, v in sorted(metrics.items())],
        params=[Param(k, v) for k, v in sorted(_flat(params).items())],
        tags=[RunTag(k, str(v)) for k, v in sorted(tags.items())],
    )
    for f in files:
        rel = f.relative_to(root).parent.as_posix()
        c.log_artifact(run_id, str(f), artifact_path=None if rel == "." else rel)


def log_evidence(evidence_dir: str | Path, uri: str | None = None) -> dict:
    """Log (or complete) the parent and child runs of one evidence directory. Idempotent.

    Returns {"experiment_id", "parent_run_id", "child_run_ids": {stage: id}}. Raises whatever
    MLflow raises when the store is unreachable; the caller records tracking as pending.
    """
    root = Path(evidence_dir)
    config = read_config(root / "config.yaml")
    eid = root.name
    records = stage_records(root)
    verdict = verdict_of(records) or ""
    common = {"evident.id": eid, "commit": eid.split("-")[0], "device": config.get("device", ""), "verdict": verdict}

    c = client(uri)
    exp_id = _experiment_id(c, config["campaign"])
    parent = _find(c, exp_id, [f"tags.`evident.id` = '{eid}'", "tags.`evident.kind` = 'parent'"])
    if parent is None:
        parent = c.create_run(exp_id, run_name=eid, tags={**common, "evident.kind": "parent"})
    pid = parent.info.run_id

    children = {}
    for rec in records:
        name = rec["name"]
        child = _find(c, exp_id, [f"tags.`mlflow.parentRunId` = '{pid}'", f"tags.`evident.stage` = '{name}'"])
        if child is not None and child.info.status not in ("FINISHED", "FAILED"):
            c.delete_run(child.info.run_id)  # left half-logged by an earlier crash: log it again whole
            child = None
        if child is None:
            tags = {**common, **rec.get("tags", {}), "evident.kind": "stage", "evident.stage": name,
                    "evident.status": rec["status"], "mlflow.parentRunId": pid}
            child = c.create_run(exp_id, run_name=name, tags=tags)
            files = [root / f for f in rec["files"]] + [root / "stages" / f"{name}.json"]
            metrics = {**rec.get("metrics", {}), "seconds": rec["seconds"]}
            _log_run(c, child.info.run_id, rec.get("params", {}), metrics, {}, files, root)
            c.set_terminated(child.info.run_id, "FAILED" if rec["status"] == "failed" else "FINISHED")  # skipped: tag evident.status
        children[name] = child.info.run_id

    if parent.info.status != "FINISHED":
        files = [root / f for f in PARENT_FILES if (root / f).is_file()]
        params = {"campaign": config["campaign"], "device": config.get("device"), "dtype": config.get("dtype")}
        _log_run(c, pid, params, {}, {"verdict": verdict}, files, root)
    return {"experiment_id": exp_id, "parent_run_id": pid, "child_run_ids": children}


def finish(evidence_dir: str | Path, ids: dict, uri: str | None = None) -> None:
    """Attach MANIFEST.json to the parent run and mark it finished (after sealing)."""
    root = Path(evidence_dir)
    c = client(uri)
    run = c.get_run(ids["parent_run_id"])
    if run.info.status != "FINISHED":
        c.log_artifact(ids["parent_run_id"], str(root / "MANIFEST.json"))
        c.set_terminated(ids["parent_run_id"], "FINISHED")
