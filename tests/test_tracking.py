"""workflow/tracking.py against a real MLflow store (SQLite in a temporary directory).

The evidence directory is built by hand with workflow.evidence (config, summary, env, checkpoint,
two stage records and their outputs, then the manifest), the way seal.py lays it out. The parent run's
headline is checked on a fuller one (`headline_ev`: tests/handbuilt.py plus bench cells of three runs,
quality, overlap and audit records, a GPU env), which tests/test_tracking_server.py logs to a real server.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import handbuilt
import pytest
import yaml

from evident.workflow import tracking
from evident.workflow.core.evidence import Stage, read_json, write_json, write_manifest, write_text

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
    assert tags["commit"] == "abc1234" and tags["device"] == "cpu" and tags["dirty"] == "false"
    assert "dirty.diff" not in tags and "gpu" not in tags  # a clean id, a CPU env
    assert tags["verdict"] == "all_token_text_exact" and tags["parity.verdict"] == "all_token_text_exact"
    assert parent.data.params == {"campaign": "t1", "device": "cpu", "dtype": "float32"}
    assert parent.data.metrics == {"parity.cells": 4.0, "parity.cells_exact": 4.0}
    assert artifact_paths(client, parent.info.run_id) == PARENT_FILES | {"MANIFEST.json"}  # no plot: no view
    # the campaign's times: the first stage's start, the seal's end (whole seconds: the records' resolution)
    records = [read_json(ev / "stages" / f"{s}.json") for s in STAGES]
    assert parent.info.start_time == tracking.ms(min(r["started_utc"] for r in records))
    assert parent.info.end_time == tracking.ms(read_json(ev / "MANIFEST.json")["sealed_utc"])
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"

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


# --- the parent run's headline ---------------------------------------------------------------

HEADLINE_EID = "abcdef1-dirty1234abcd-c11111111-r1"
CAMPAIGN_START = "2026-01-01T00:00:00Z"  # the first stage's start, written into its record below
# what the parent run of `headline_ev` must carry (tests/test_tracking_server.py checks the same over REST)
HEADLINE_METRICS = {
    "bench.single-b1.tpot_p50_ms": 10.0, "bench.single-b1.tok_s": 100.0,
    "bench.single-graph-b8.tpot_p50_ms": 2.0, "bench.single-graph-b8.tok_s": 4000.0,
    "bench.hf-b8.tpot_p50_ms": 22.0, "bench.hf-b8.tok_s": 8 / 0.022,  # its repeats spread 10 %: noisy
    "parity.cells": 1.0, "parity.cells_exact": 1.0,
    "quality.hf.accuracy": 0.625, "quality.engine.accuracy": 0.5,
    "overlap.warm.b_over_a": 0.9, "overlap.scrubbed.b_over_a": 1.1,
}
HEADLINE_TAGS = {
    "evident.id": HEADLINE_EID, "evident.kind": "parent", "commit": "abcdef1", "dirty": "true",
    "dirty.diff": "1234abcd", "device": "cpu", "gpu": "NVIDIA H200", "gpu.count": "2",
    "verdict": "all_token_text_exact", "parity.verdict": "all_token_text_exact", "quality.verdict": "pass",
    "overlap.verdict": "b_faster", "audit.verdict": "ok", "bench.hf-b8.noisy": "true",
}
HEADLINE_ARTIFACTS = {"SUMMARY.md", "SUMMARY-with-plots.md", "config.yaml", "env.json", "checkpoint.json",
                      "MANIFEST.json", "plots/bench.png", "plots/overlap.png"}


def build_headline(root: Path) -> Path:
    """tests/handbuilt.py's directory (unsealed) with what a GPU campaign adds: bench cells of the graph path
    and of hf, quality, overlap and audit records, two GPUs in env.json, a first stage at CAMPAIGN_START."""
    ev = handbuilt.build(root, "head", HEADLINE_EID, seal=False)
    env = read_json(ev / "env.json")
    write_json(ev / "env.json", {**env, "gpus": ["NVIDIA H200", "NVIDIA H200"]})
    with Stage(ev, "bench-single-graph") as st:  # the cell names its decode path (`kernels`), not its file
        st.write_json("bench/single-b8.json", {**handbuilt.cell("single", 8, tpot=2.0), "kernels": "graph"})
    with Stage(ev, "bench-hf") as st:  # hf runs transformers' own path whatever `kernels` says: no suffix
        st.write_json("bench/hf-b8.json", {**handbuilt.cell("hf", 8, tpot=20.0, spread=0.1), "kernels": "graph"})
        st.write_json("bench/not-a-cell.json", {"note": "a stage may write other documents"})
    with Stage(ev, "quality") as st:
        st.metrics.update(hf_correct=5, hf_accuracy=0.625, hf_invalid=0, engine_correct=4, engine_accuracy=0.5,
                          engine_invalid=1, flips=1)
        st.tags["quality.verdict"] = "pass"
    with Stage(ev, "overlap") as st:
        st.add_file(write_text(ev / "plots/overlap.png", "png bytes"))
        st.metrics.update(bitwise_inputs=4, bitwise_equal=1, warm_a_median_us=10.0, warm_b_median_us=9.0,
                          warm_b_over_a=0.9, scrubbed_a_median_us=10.0, scrubbed_b_median_us=11.0,
                          scrubbed_b_over_a=1.1)
        st.tags["overlap.verdict"] = "b_faster"
    with Stage(ev, "kernel_audit") as st:
        st.tags["audit.verdict"] = "ok"
    with pytest.raises(RuntimeError), Stage(ev, "bench-collective") as st:  # failed: none of its numbers count
        st.write_json("bench/collective-b1.json", handbuilt.cell("collective", 1, tpot=99.0))
        raise RuntimeError("rank 1 died")
    with Stage(ev, "context"):
        pass
    rec = read_json(ev / "stages/context.json")
    write_json(ev / "stages/context.json", {**rec, "started_utc": CAMPAIGN_START})
    return ev


@pytest.fixture
def headline_ev(tmp_path) -> Path:
    return build_headline(tmp_path / "evidence")


def test_parent_carries_the_headline(headline_ev, uri, client):
    ids = seal(headline_ev, uri)
    parent = client.get_run(ids["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics == pytest.approx(HEADLINE_METRICS)
    assert {k: v for k, v in parent.data.tags.items() if not k.startswith("mlflow.")} == HEADLINE_TAGS
    assert parent.info.start_time == tracking.ms(CAMPAIGN_START) == 1767225600000
    sealed = read_json(headline_ev / "MANIFEST.json")["sealed_utc"]
    assert parent.info.end_time == tracking.ms(sealed) > parent.info.start_time
    assert artifact_paths(client, parent.info.run_id) == HEADLINE_ARTIFACTS
    assert (Path(client.download_artifacts(parent.info.run_id, "plots/bench.png")).read_bytes()
            == (headline_ev / "plots/bench.png").read_bytes())
    # the children carry the identity tags too, the gate verdicts stay on the parent and the deciding stage
    child = client.get_run(ids["child_run_ids"]["bench-hf"])
    assert child.data.tags["dirty.diff"] == "1234abcd" and child.data.tags["gpu"] == "NVIDIA H200"
    assert "quality.verdict" not in child.data.tags
    assert client.get_experiment(ids["experiment_id"]).tags["mlflow.experimentKind"] == "custom_model_development"


def test_each_markdown_file_with_plots_gets_a_view_mlflow_renders(headline_ev, uri, client):
    """MLflow's markdown view draws only http(s) images: `<name>-with-plots.md` is the file with each plot link as
    the parent's own artifact on the server (tests/test_mlflow_browser.py loads it in Chromium) and the rest word
    for word; DETAILS.md is logged and viewed the same way; a file without a plot link gets no view."""
    from evident.workflow.core.layout import DETAILS

    write_text(headline_ev / DETAILS, "## Details\n\n![overlap A/B](plots/overlap.png)\n")
    write_text(headline_ev / "SUMMARY.md", "## Evidence\n\nno image here\n")
    run_id = seal(headline_ev, uri)["parent_run_id"]
    assert artifact_paths(client, run_id) == HEADLINE_ARTIFACTS - {"SUMMARY-with-plots.md"} | {
        DETAILS, "DETAILS-with-plots.md"}
    view = Path(client.download_artifacts(run_id, "DETAILS-with-plots.md")).read_text()
    assert view == ("## Details\n\n![overlap A/B](http:get-artifact?path=plots%2Foverlap.png"
                    f"&run_uuid={run_id})\n")
    assert tracking.plot_view("![a](plots/x.png) ![b](other/y.png)", "r1", "https") == (
        "![a](https:get-artifact?path=plots%2Fx.png&run_uuid=r1) ![b](other/y.png)")


def test_the_experiments_shared_view_has_the_headline_as_columns(headline_ev, ev, uri, client):
    """`tracking.runs_url` opens the runs table with every parent's headline tags, then metrics, as columns."""
    import json

    ids = seal(headline_ev, uri)
    cols = json.loads(client.get_experiment(ids["experiment_id"]).tags[tracking.SHARED_VIEW])["selectedColumns"]
    tags = [k for k in HEADLINE_TAGS if k.endswith((".verdict", ".noisy"))]
    assert cols == sorted(f"tags.`{k}`" for k in tags) + sorted(f"metrics.`{k}`" for k in HEADLINE_METRICS)
    other = build_headline(headline_ev.parent.parent / "other")  # its id again, one more cell: the view still grows
    with Stage(other, "bench-single-b2") as st:
        st.write_json("bench/single-b2.json", handbuilt.cell("single", 2))
    seal(other, uri)
    after = json.loads(client.get_experiment(ids["experiment_id"]).tags[tracking.SHARED_VIEW])["selectedColumns"]
    assert set(after) - set(cols) == {"metrics.`bench.single-b2.tpot_p50_ms`", "metrics.`bench.single-b2.tok_s`"}


def test_headline_logged_once_when_the_parent_is_reused(headline_ev, uri, client):
    first = tracking.log_evidence(headline_ev, uri=uri)  # a seal killed before the manifest: parent RUNNING
    assert client.get_run(first["parent_run_id"]).info.status == "RUNNING"
    assert seal(headline_ev, uri) == first
    assert seal(headline_ev, uri) == first  # and a sync of the sealed directory
    parent = client.get_run(first["parent_run_id"])
    assert parent.data.metrics == pytest.approx(HEADLINE_METRICS)
    assert {k: len(client.get_metric_history(parent.info.run_id, k)) for k in HEADLINE_METRICS} \
        == dict.fromkeys(HEADLINE_METRICS, 1)
    assert parent.info.start_time == tracking.ms(CAMPAIGN_START)
    assert artifact_paths(client, parent.info.run_id) == HEADLINE_ARTIFACTS


def test_experiment_kind_is_set_once_and_never_overridden(ev, uri, client):
    exp_id = client.create_experiment("t1")  # made before the tag existed
    seal(ev, uri)
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(exp_id, "mlflow.experimentKind", "genai_development")  # someone's choice
    tracking.log_evidence(ev, uri=uri)
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "genai_development"


@pytest.mark.parametrize("eid, tags", [
    ("abc1234-c0123abcd-r1", {"commit": "abc1234", "dirty": "false"}),
    ("abc1234-dirty0f0f0f0f-c0123abcd-r2", {"commit": "abc1234", "dirty": "true", "dirty.diff": "0f0f0f0f"}),
    ("0000000-dirtyffffffff-c0123abcd-r1", {"commit": "0000000", "dirty": "true", "dirty.diff": "ffffffff"}),
])
def test_id_tags(eid, tags):
    assert tracking.id_tags(eid) == tags


def test_times_are_ms_since_the_epoch():
    assert tracking.ms("1970-01-01T00:00:01Z") == 1000
    assert tracking.ms(None) is None
