"""MLflow mapping: experiment = campaign, parent run = evidence directory, child run = stage.

The evidence directory is the source of truth; this module only replays it into MLflow, finding
runs by tag so that logging twice never creates a duplicate.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from workflow import gates
from workflow.evidence import flatten, read_config, stage_records

PARENT_FILES = ("SUMMARY.md", "config.yaml", "env.json", "checkpoint.json")
MAX_PARAM_CHARS = 6000


def client(uri: str | None = None):
    # Fail fast when a server is down: MLflow's default is minutes of retries per request.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or os.environ.get("MLFLOW_TRACKING_URI") or None)


def _sqlite_path(uri: str | None) -> Path | None:
    if uri is None:
        from mlflow.tracking import get_tracking_uri  # MLflow's own default, as client() resolves it

        uri = get_tracking_uri()
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def store_lock(uri: str | None = None):
    """Serialise writers of one SQLite store (`<db>.lock`, an flock; a server store needs none).

    Measured (tests/reliability, README "Reliability"): 8 processes logging at once into a fresh SQLite
    store, 7 failed (concurrent schema migrations: `duplicate column name`, alembic version races); with
    this lock all 8 logged. Parallel jobs (`snakemake -j N`, several campaigns in one working directory)
    therefore write one at a time; a server (`MLFLOW_TRACKING_URI=http://...`) takes concurrent writers.
    """
    db = _sqlite_path(uri or os.environ.get("MLFLOW_TRACKING_URI") or None)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp else c.create_experiment(name)


def _find(c, exp_id: str, filters: list[str]):
    runs = c.search_runs([exp_id], filter_string=" and ".join(filters), max_results=2)
    return runs[0] if runs else None


def _log_run(c, run_id: str, params: dict, metrics: dict, tags: dict, files: list[Path], root: Path) -> None:
    from mlflow.entities import Metric, Param, RunTag

    c.log_batch(
        run_id,
        metrics=[Metric(k, float(v), 0, 0) for k, v in sorted(metrics.items())],
        params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(flatten(params).items())],
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
    with store_lock(uri):
        return _log_evidence(evidence_dir, uri)


def _log_evidence(evidence_dir: str | Path, uri: str | None = None) -> dict:
    root = Path(evidence_dir)
    config = read_config(root / "config.yaml")
    eid = root.name
    records = stage_records(root)
    verdict = gates.verdicts(records).get(gates.PARITY.name, "")
    common = {"evident.id": eid, "commit": eid.split("-")[0], "device": config.get("device", ""), "verdict": verdict}

    c = client(uri)
    exp_id = _experiment_id(c, config["campaign"])
    parents = c.search_runs([exp_id], filter_string=f"tags.`evident.id` = '{eid}' and tags.`evident.kind` = 'parent'",
                            order_by=["attributes.start_time ASC"], max_results=50)
    parent = parents[0] if parents else None
    for extra in parents[1:]:  # a second parent of one id (two seals raced): never left RUNNING as an orphan
        if extra.info.status == "RUNNING":
            c.set_terminated(extra.info.run_id, "FAILED")
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
    with store_lock(uri):
        c = client(uri)
        run = c.get_run(ids["parent_run_id"])
        if run.info.status != "FINISHED":
            c.log_artifact(ids["parent_run_id"], str(root / "MANIFEST.json"))
            c.set_terminated(ids["parent_run_id"], "FINISHED")


def delete_runs(campaign: str, evidence_id: str, run_ids: list[str], uri: str | None = None) -> dict:
    """Mark deleted (MLflow's own soft delete, `MlflowClient.delete_run`) the given runs and every active
    run tagged `evident.id` = evidence_id in the campaign's experiment: the runs of a pruned directory.

    Returns {"deleted": [ids], "missing": [given ids this store does not have]}. A SQLite store that does
    not exist is not created: with no ids given there is nothing to find, else FileNotFoundError. Raises
    whatever MLflow raises when the store is unreachable.
    """
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(uri or os.environ.get("MLFLOW_TRACKING_URI") or None)
    if db is not None and not db.is_file():
        if not run_ids:
            return {"deleted": [], "missing": []}
        raise FileNotFoundError(f"no MLflow store at {db}")
    with store_lock(uri):
        c = client(uri)
        ids = list(dict.fromkeys(run_ids))
        exp = c.get_experiment_by_name(campaign)
        if exp is not None:
            tagged = c.search_runs([exp.experiment_id], filter_string=f"tags.`evident.id` = '{evidence_id}'",
                                   max_results=5000)
            ids += [r.info.run_id for r in tagged if r.info.run_id not in ids]
        deleted, missing = [], []
        for run_id in ids:
            try:
                run = c.get_run(run_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                missing.append(run_id)
                continue
            if run.info.lifecycle_stage != "deleted":
                c.delete_run(run_id)
                deleted.append(run_id)
        return {"deleted": deleted, "missing": missing}
