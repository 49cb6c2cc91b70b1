"""MLflow mapping: experiment = campaign, parent run = evidence directory, child run = stage.

The evidence directory is the source of truth; this module only replays it into MLflow, finding
runs by tag so that logging twice never creates a duplicate.

The parent run carries the headline, so that runs compare in the MLflow UI's runs table and compare view
without opening a child (all read from the stage records, bench cells and env.json; `headline`):

- times: start = the first stage's `started_utc`, end = the manifest's `sealed_utc` (set by `finish`);
  the records keep whole seconds, so the times are whole seconds too.
- tags: `evident.id`, `evident.kind` = parent, `commit` (the id's 7 characters), `dirty` (`true`/`false`, from
  the id) and `dirty.diff` (the id's 8-character diff hash, when dirty), `device` (the campaign's), `gpu` (the
  distinct names of env.json's `gpus`) and `gpu.count` (CUDA only), `verdict` (the parity verdict, as on every
  run) and `<gate>.verdict` for every gate whose stage ran (`workflow/core/gates.py`).
- metrics, named `<section>.<subject>.<quantity>` (MLflow names allow letters, digits, `_ - . / : space`;
  any other character of a subject becomes `_`):
  `bench.<backend><path>-b<B>.tpot_p50_ms` and `.tok_s` per bench cell, named as `runs.label` names a run
  (`bench.single-b1`, `bench.single-graph-b8`, `bench.hf-b8`: the path suffix is empty for torch; a distinct-prompts
  cell `bench.single-graph-distinct-b8`), from
  the cell's steady TPOT p50 and decode tok/s; `bench.http-<target>-c<C>.tpot_p50_ms`, `.ttft_p50_ms` and `.tok_s`
  per cell of the benchmark over HTTP (runs.http_cell; its output tok/s), from the serve_bench records;
  `parity.cells`, `parity.cells_exact` (the compare record);
  `quality.<target>.accuracy` (the quality record); `overlap.<envelope>.b_over_a` (the overlap record's B/A
  median ratio per timing envelope, `warm` and `scrubbed`, of the built-in screen; `overlap.<screen>.<envelope>.
  b_over_a` of each of the campaign's `screens`). Only records with status ok count.
- tags, per noisy bench cell: `bench.<cell>.noisy` = `true` (the cell's `stats.noisy`, workflow/bench/benchstats.py), so
  that a TPOT in the runs table is never read without its noise flag.
- artifacts: SUMMARY.md, DETAILS.md (`evidence.DETAILS`, where the directory has one), config.yaml, env.json,
  checkpoint.json, MANIFEST.json and `plots/*.png` under `plots/`, the path the markdown's image links name.
  MLflow 3.17.2's markdown view does not show those links: its image component prints an address without a
  scheme as `[alt](plots/x.png)` text, and its URL filter (react-markdown's default) empties any scheme but
  http(s), mailto, irc(s) and xmpp, so a data: URI becomes `<img src="">` (seen in Chromium). So each markdown
  file with plot links also gets `<name>-with-plots.md` (`plot_view`): the same text with each link as
  `http:get-artifact?path=plots/x.png&run_uuid=<parent>`. The scheme satisfies both checks; a browser resolves an
  address of the page's own scheme with no host against the page, so it names the server's own artifact endpoint
  (under any `--static-prefix`). `https:` where the store is an https server; tests/test_mlflow_browser.py loads
  the plots in Chromium.

The experiment is created with the tag `mlflow.experimentKind` = `custom_model_development` (set too on an
experiment that lacks it), which MLflow 3 UIs without the workflow-type switch read to open on the runs table.
MLflow 3.17.2's UI ignores the tag (its switch is compiled on): it opens an experiment on the GenAI overview
unless the URL says `?workflowType=machine_learning` or the sidebar's "Model training" was picked once in that
browser (local storage). Its experiment list links plain `#/experiments/<id>`, so only links written here
(`runs_url`) open on the runs.

The runs table's columns: MLflow keeps them in the browser, except a shared view, an experiment tag
`mlflow.sharedViewState.<key>` that a URL of the runs route with `viewStateShareKey=<key>` loads (with a banner
"You're viewing a shared view"). The experiment carries one, `mlflow.sharedViewState.evident` (`VIEW_KEY`): the
headline tags and metrics of every parent logged into it (`shared_view`), so `runs_url` opens the runs table with
them as columns.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import tempfile
import urllib.parse
from pathlib import Path

from evident.workflow.core import gates, layout
from evident.workflow.core.evidence import flatten, read_config, read_json, stage_records
from evident.workflow.core.layout import DETAILS, MANIFEST, SUMMARY
from evident.workflow.core.locks import flocked
from evident.workflow.plan import runs

PARENT_FILES = (layout.CONFIG, layout.ENV, layout.CHECKPOINT)  # and the markdown files (`markdown_files`)
PLOTS = f"{layout.PLOTS}/*.png"  # beside the markdown files, at the relative path their image links name
MAX_PARAM_CHARS = 6000
BENCH_STAGES = ("bench-", "serve_bench-")  # the stage records of bench cells (session.engine_stage names them)
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # "Machine learning": the runs view
PLOT_LINK = re.compile(r"!\[([^\]]*)\]\((plots/[^)\s]+\.png)\)")
VIEW_KEY = "evident"
SHARED_VIEW = f"mlflow.sharedViewState.{VIEW_KEY}"


def runs_url(ui: str, experiment_id: str) -> str:
    """An experiment's runs table on the MLflow UI at `ui`, with the headline as columns (the module docstring says
    why each part: the key is read only on the runs route, and the bare experiment route drops it)."""
    return f"{ui}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def client(uri: str | None = None):
    # Fail fast when a server is down: MLflow's default is minutes of retries per request.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or None)  # None: MLFLOW_TRACKING_URI, else MLflow's default


def _sqlite_path(uri: str | None) -> Path | None:
    if not uri:
        from mlflow.tracking import get_tracking_uri  # MLflow's own default, as client() resolves it

        uri = get_tracking_uri()
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def store_lock(uri: str | None = None):
    """Serialise writers of one SQLite store (`<db>.lock`, an flock; a server store needs none).

    Measured (tests/reliability, docs/reliability.md): 8 processes logging at once into a fresh SQLite
    store, 7 failed (concurrent schema migrations: `duplicate column name`, alembic version races); with
    this lock all 8 logged. Parallel jobs (`snakemake -j N`, several campaigns in one working directory)
    therefore write one at a time; a server (`MLFLOW_TRACKING_URI=http://...`) takes concurrent writers.
    """
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with flocked(f"{db}.lock"):  # exclusive, waiting for the writer before
        yield


def _experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is None:
        return c.create_experiment(name, tags=EXPERIMENT_TAGS)
    for k, v in EXPERIMENT_TAGS.items():
        if k not in exp.tags:  # an experiment made before the tag: never overrides a kind someone chose
            c.set_experiment_tag(exp.experiment_id, k, v)
    return exp.experiment_id


def ms(utc: str | None) -> int | None:
    """An evidence time (`2026-01-01T00:00:00Z`, workflow.evidence.utc_now) as MLflow's ms since the epoch."""
    if not utc:
        return None
    t = _dt.datetime.fromisoformat(utc.replace("Z", "+00:00"))
    return int((t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)).timestamp() * 1000)


def _name(part) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(part))


def id_tags(eid: str) -> dict:
    """commit and dirty from an evidence id `<commit7>[-dirty<diff8>]-c<config8>-r<N>`."""
    parts = eid.split("-")
    diff = parts[1].removeprefix("dirty") if len(parts) > 1 and parts[1].startswith("dirty") else None
    return {"commit": parts[0], "dirty": "true" if diff else "false", **({"dirty.diff": diff} if diff else {})}


def gpu_tags(root: Path) -> dict:
    env = read_json(root / layout.ENV) if (root / layout.ENV).is_file() else {}
    gpus = env.get("gpus") or []
    return {"gpu": ", ".join(dict.fromkeys(map(str, gpus))), "gpu.count": str(len(gpus))} if gpus else {}


def headline(root: Path, records: list[dict], config: dict) -> tuple[dict, dict]:
    """(metrics, tags) the parent run adds to the common tags: the module docstring names them."""
    tags = {gates.BY_NAME[g].tag: v for g, v in gates.verdicts(records).items()}
    metrics = {}
    ok = {r["name"]: r for r in records if r.get("status") == "ok"}
    kernels = (config.get("bench") or {}).get("kernels") or "torch"
    for rec in ok.values():
        if not rec["name"].startswith(BENCH_STAGES):
            continue
        for f in rec.get("files", []):
            if not (f.startswith(layout.BENCH + "/") and f.endswith(".json") and (root / f).is_file()):
                continue
            cell = read_json(root / f)
            if not (isinstance(cell, dict) and isinstance(cell.get("stats"), dict)
                    and (runs.is_http(cell) or {"backend", "batch"} <= cell.keys())):
                continue  # not a cell (a stage may write others beside), or an HTTP cell without a figure
            name = f"bench.{_name(runs.cell_label(cell, kernels))}"
            if runs.is_http(cell):
                metrics[f"{name}.ttft_p50_ms"] = (cell["stats"].get("ttft") or {}).get("p50")
            metrics[f"{name}.tpot_p50_ms"] = (cell["stats"].get("tpot") or {}).get("p50")
            metrics[f"{name}.tok_s"] = cell["stats"].get("decode_tok_s", cell["stats"].get("output_tok_s"))
            if cell["stats"].get("noisy"):
                tags[f"{name}.noisy"] = "true"
    m = ok.get("compare", {}).get("metrics", {})
    metrics.update({f"parity.{k}": m[k] for k in ("cells", "cells_exact") if k in m})
    m = ok.get("quality", {}).get("metrics", {})
    metrics.update({f"quality.{_name(k.removesuffix('_accuracy'))}.accuracy": v
                    for k, v in m.items() if k.endswith("_accuracy")})
    m = ok.get("overlap", {}).get("metrics", {})
    metrics.update({f"overlap.{_name(k.removesuffix('_b_over_a'))}.b_over_a": v
                    for k, v in m.items() if k.endswith("_b_over_a")})
    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return numeric, tags


def markdown_files(root: Path) -> list[Path]:
    return [root / f for f in (SUMMARY, DETAILS) if (root / f).is_file()]


def view_name(md: Path) -> str:
    return f"{md.stem}-with-plots.md"


def plot_view(text: str, run_id: str, scheme: str = "http") -> str | None:
    """The markdown with each `plots/x.png` link as the run's own artifact on the server that shows it (the module
    docstring says why); None without a plot link."""
    def link(m: re.Match) -> str:
        query = urllib.parse.urlencode({"path": m.group(2), "run_uuid": run_id})
        return f"![{m.group(1)}]({scheme}:get-artifact?{query})"

    view = PLOT_LINK.sub(link, text)
    return view if view != text else None


def shared_view(old: str | None, metrics: dict, tags: dict) -> str:
    """The experiment's shared view (`SHARED_VIEW`): the runs table's columns, the headline tags then the metrics,
    kept from the parents logged before (a campaign's cells change over its history)."""
    cols = set(json.loads(old).get("selectedColumns", [])) if old else set()
    cols |= {f"tags.`{k}`" for k in tags} | {f"metrics.`{k}`" for k in metrics}
    cols = sorted(cols, key=lambda c: (not c.startswith("tags."), c))
    return json.dumps({"selectedColumns": cols, "columnOrder": cols})  # without the order, the metrics come first


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
    config = read_config(root / layout.CONFIG)
    eid = root.name
    records = stage_records(root)
    verdict = gates.verdicts(records).get(gates.PARITY.name, "")
    common = {"evident.id": eid, **id_tags(eid), "device": config.get("device", ""), **gpu_tags(root),
              "verdict": verdict}

    c = client(uri)
    exp_id = _experiment_id(c, config["campaign"])
    parents = c.search_runs([exp_id], filter_string=f"tags.`evident.id` = '{eid}' and tags.`evident.kind` = 'parent'",
                            order_by=["attributes.start_time ASC"], max_results=50)
    parent = parents[0] if parents else None
    for extra in parents[1:]:  # a second parent of one id (two seals raced): never left RUNNING as an orphan
        if extra.info.status == "RUNNING":
            c.set_terminated(extra.info.run_id, "FAILED")
    if parent is None:
        start = ms(min((r["started_utc"] for r in records if r.get("started_utc")), default=None))
        parent = c.create_run(exp_id, start_time=start, run_name=eid, tags={**common, "evident.kind": "parent"})
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

    metrics, tags = headline(root, records, config)
    old = c.get_experiment(exp_id).tags.get(SHARED_VIEW)
    if (view := shared_view(old, metrics, tags)) != old:  # also for a sealed directory
        c.set_experiment_tag(exp_id, SHARED_VIEW, view)
    if parent.info.status != "FINISHED":
        mds = markdown_files(root)
        files = mds + [root / f for f in PARENT_FILES if (root / f).is_file()] + sorted(root.glob(PLOTS))
        params = {"campaign": config["campaign"], "device": config.get("device"), "dtype": config.get("dtype")}
        logged = parent.data.metrics  # a RUNNING parent reused after a crash: each value once
        metrics = {k: v for k, v in metrics.items() if logged.get(k) != float(v)}
        _log_run(c, pid, params, metrics, {**common, **tags}, files, root)
        scheme = "https" if (uri or os.environ.get("MLFLOW_TRACKING_URI", "")).startswith("https:") else "http"
        with tempfile.TemporaryDirectory() as tmp:
            for md in mds:
                if (text := plot_view(md.read_text(), pid, scheme)) is not None:
                    (Path(tmp) / view_name(md)).write_text(text)
                    c.log_artifact(pid, str(Path(tmp) / view_name(md)))
    return {"experiment_id": exp_id, "parent_run_id": pid, "child_run_ids": children}


def finish(evidence_dir: str | Path, ids: dict, uri: str | None = None) -> None:
    """Attach MANIFEST.json to the parent run and mark it finished (after sealing), ending it when the
    directory was sealed (the manifest's `sealed_utc`)."""
    root = Path(evidence_dir)
    with store_lock(uri):
        c = client(uri)
        run = c.get_run(ids["parent_run_id"])
        if run.info.status != "FINISHED":
            c.log_artifact(ids["parent_run_id"], str(root / MANIFEST))
            end = ms(read_json(root / MANIFEST).get("sealed_utc"))
            c.set_terminated(ids["parent_run_id"], "FINISHED", end_time=end)


def delete_runs(campaign: str, evidence_id: str, run_ids: list[str], uri: str | None = None) -> dict:
    """Mark deleted (MLflow's own soft delete, `MlflowClient.delete_run`) the given runs and every active
    run tagged `evident.id` = evidence_id in the campaign's experiment: the runs of a pruned directory.

    Returns {"deleted": [ids], "missing": [given ids this store does not have]}. A SQLite store that does
    not exist is not created: with no ids given there is nothing to find, else FileNotFoundError. Raises
    whatever MLflow raises when the store is unreachable.
    """
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(uri)
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
