"""End to end: the real Snakefile in a temporary working directory, as a user runs it."""

from __future__ import annotations

import copy
import csv
import getpass
import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import cluster
import pytest
import tinyev
import yaml
from test_summary import assert_pasteable, gate_rows

from evident.workflow.core import layout
from evident.workflow.core.evidence import config_hash, sha256_file
from evident.workflow.core.layout import DETAILS, MANIFEST, SUMMARY
from evident.workflow.stages import overlap as ov

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    e.update(env or {})
    return subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(workdir), "-c2", *args],
                          capture_output=True, text=True, env=e, timeout=900)


TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())


def campaign(tmp: Path, **overrides) -> Path:
    """A whole campaign file (nothing is inherited from config/config.yaml): the tiny model with random weights,
    one case, the single backend, with overrides. The quality gate is advisory: on random weights it makes no claim."""
    cfg = {"campaign": "e2e", "device": "cpu", "checkpoint": tinyev.synthetic(),
           "cases": [{"name": "greeting", "prompt": "Hello, evident!", "max_new_tokens": 8}],
           "parity": {"batch_sizes": [1, 3], "backends": ["single"]},
           "bench": {"backends": ["single"], "batch_sizes": [1], "new_tokens": 4, "repeats": 1, "warmup": 0,
                     "prompts": ["Hi"], "http": {"concurrency": [1]}},
           # the schema's GSM8K defaults (64 rows, 5 shots) do not fit the embedded set and the tiny context
           "quality": {"targets": ["hf", "engine"], "reference": "hf", "advisory": True,
                       "gsm8k": {"source": "embedded", "limit": 2, "shots": 1, "max_tokens": 8}}}
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    path = tmp / "campaign.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def only_evidence_dir(workdir: Path, name: str) -> Path:
    dirs = [p for p in (workdir / "evidence" / name).iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    wd, first, first_s = cluster.default_local_run(tmp_path_factory)  # one run a session, shared with test_cluster
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return wd, first, first_s


@cluster.shares_default_run
def test_default_campaign_writes_sealed_evidence(default_run):
    wd, run, seconds = default_run
    ev = only_evidence_dir(wd, "tiny")
    print(f"default campaign: {seconds:.1f}s")
    backends = ("single", "host-staged", "collective")
    for rel in ("MANIFEST.json", "SUMMARY.md", "config.yaml", "env.json", "checkpoint.json", "oracle/hf.json",
                "parity/comparison.json", "bench/summary.csv", "bench/baseline.json", "plots/bench.png",
                "overlap/screen.json", "overlap/timings.csv", "plots/overlap.png", "kernels/audit.json",
                "quality/gsm8k-hf.json", "quality/gsm8k-engine.json", "quality/gsm8k-hf-rows.jsonl",
                "quality/gsm8k-engine-rows.jsonl", "quality/gsm8k-gate.json", "logs/quality-engine-server.log",
                "profile/capture.json", "profile/kernels.csv", "profile/trace.json.gz", "plots/profile.png",
                "logs/oracle.log", *(f"logs/parity-{b}.log" for b in backends),
                *(f"parity/{b}-b{n}.json" for b in backends for n in (1, 4, 8)),
                *(f"bench/{b}{c}-b{n}.json" for b in ("single", "collective") for c in ("", "-distinct")
                  for n in (1, 4, 8)),
                *(f"bench/http-engine{c}-c{n}.json" for c in ("", "-distinct") for n in (1, 4, 8)),
                "logs/serve_bench-engine-server.log"):
        assert (ev / rel).is_file(), rel
    manifest = json.loads((ev / MANIFEST).read_text())
    assert manifest["verdict"] == "all_token_text_exact"
    assert json.loads((ev / "parity/comparison.json").read_text())["verdict"] == "all_token_text_exact"
    # on the CPU the kernel audit has nothing compiled: skipped with its reason, never ok
    assert manifest["stages"].pop("kernel_audit") == "skipped"
    # the tiny DeepSeek-V2 has no auxiliary GEMV projections to screen, and the campaign states no shapes
    assert manifest["stages"].pop("overlap") == "skipped"
    assert set(manifest["stages"].values()) == {"ok"}
    # every file but the manifest itself is sealed with its hash
    on_disk = {p.relative_to(ev).as_posix() for p in ev.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert set(manifest["files"]) == on_disk
    for rel, f in manifest["files"].items():
        assert sha256_file(ev / rel) == f["sha256"], rel
    # the id's config part is the hash of the resolved config that was written
    resolved = yaml.safe_load((ev / "config.yaml").read_text())
    assert ev.name.split("-c")[1].startswith(config_hash(resolved)[:8])
    assert manifest["config_sha256"] == config_hash(resolved)
    # SUMMARY.md pastes into a pull request: every gate first (one not run never passes), short, no relative link;
    # the full tables and the plots are DETAILS.md's (tests/test_summary.py has the same checks on hand-built files)
    summary, details = (ev / SUMMARY).read_text(), (ev / DETAILS).read_text()
    assert {SUMMARY, DETAILS} <= set(manifest["files"])
    rows = gate_rows(summary)
    parity = rows.pop("parity")
    assert parity[:2] == ["`all_token_text_exact`", "passes"] and re.fullmatch(r"(\d+)/\1 cells exact", parity[2])
    assert re.fullmatch(r"`engine` (\d+)/64, `hf` \1/64 \(reference\)", rows["quality"].pop()), rows["quality"]
    assert rows == {"overlap": ["`not_measured`", "measured nothing: not a pass", ov.SKIP_REASON],
                    "audit": ["`not_compiled`", "measured nothing: not a pass",
                              json.loads((ev / "kernels/audit.json").read_text())["reason"]],
                    "quality": ["`pass`", "passes"],
                    "soak": ["—", "not run (not in the campaign's `stages:`)", "—"]}  # the soak runs only where named
    assert_pasteable(summary)
    lines = summary.splitlines()
    assert len(lines) <= 70 and max(len(line) for line in lines if line.startswith("|")) <= 200, len(lines)
    assert "### Claim boundary" in summary and "- Does not show: quality beyond the generated arithmetic" in summary
    assert "### Decode benchmark" in details and "![decode tok/s" in details
    assert "### Benchmark over HTTP" in details and "The builtin engine in process and over HTTP" in details
    assert "### Overlap A/B screen (skipped)" in details and "no auxiliary GEMV projections" in details
    assert "overlap.png" not in summary + details  # the skipped screen's placeholder plot is not shown
    assert "### Kernel resource audit" in details and "Not compiled: no CUDA device" in details
    # the GSM8K quality gate (embedded set, engine through its endpoint against hf) and the profile capture
    # the quality gate on the trained checkpoint: held-out generated questions, answers against gold
    assert manifest["quality"] == "pass" and manifest["stages"]["quality"] == "ok"
    assert "### GSM8K quality gate (64 test rows, 2 shots" in details and "**Quality verdict: `pass`**" in details
    assert "Compared: extracted answers (strict match) against gold" in details and "identical completions 64/64" in details
    hf = json.loads((ev / "quality/gsm8k-hf.json").read_text())
    assert hf["accuracy"] >= 0.5 and hf["data"]["test"]["source"] == "generated", hf
    trained = json.loads((ev / "checkpoint.json").read_text())["trained"]
    assert trained["train"]["steps"] == 800 and trained["loss"]["last"] < trained["loss"]["first"]
    assert "### Profile capture (torch, 4 decode steps" in details and "ncu: no CUDA device" in details
    cells = json.loads((ev / "parity/comparison.json").read_text())["cells"]
    assert {c["backend"] for c in cells} == {*backends, "host-staged vs collective"}
    bench = json.loads((ev / "bench/collective-b8.json").read_text())
    assert bench["collective"] == "gloo" and bench["ep_size"] == 2
    assert bench["stats"]["tpot"]["count"] == bench["contract"]["repeats"] * (bench["contract"]["new_tokens"] - 2)
    # the distinct-prompts cells: each row as its prompt alone, more experts a step than one prompt's top_k
    distinct = json.loads((ev / "bench/single-distinct-b8.json").read_text())
    assert distinct["rows_check"]["verdict"] == "rows_as_alone" and len(set(distinct["contract"]["prompt_tokens"])) > 1
    assert distinct["floor"]["unique_experts"]["max"] > distinct["floor"]["unique_experts"]["top_k"]
    assert "- `distinct`: row r the prompt `bench.prompts[r]`" in details and "| single | distinct |" in summary


@cluster.shares_default_run
def test_every_file_of_the_default_run_is_in_the_contract(default_run):
    """docs/evidence.md's table (layout.FILES) names every file the default campaign leaves: a `<part>` is one path
    segment's worth, `[-distinct]` is optional."""
    ev = only_evidence_dir(default_run[0], "tiny")
    pattern = re.compile("|".join(re.sub(r"<[^>]+>", "[^/]+", re.escape(p).replace(r"\[\-distinct\]", "(?:-distinct)?"))
                                  for p, _, _ in layout.FILES))
    files = [p.relative_to(ev).as_posix() for p in ev.rglob("*") if p.is_file()]
    assert len(files) > 80
    assert [f for f in files if not pattern.fullmatch(f)] == []


@cluster.shares_default_run
def test_evidence_has_no_host_user_or_home(default_run):
    wd, _, _ = default_run
    ev = only_evidence_dir(wd, "tiny")
    # word boundaries: a short host name such as "vm" may occur inside other words
    needles = [re.escape(str(Path.home())) + r"\b", rf"/home/{re.escape(getpass.getuser())}\b",
               rf"\b{re.escape(socket.gethostname())}\b"]
    for p in ev.rglob("*"):
        if p.is_file() and p.suffix != ".png":  # compressed pixels match short words by chance
            text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
            for n in needles:
                assert not re.search(n, text), f"{n!r} in {p.relative_to(ev)}"


@cluster.shares_default_run
def test_mlflow_has_one_parent_and_a_child_per_stage(default_run):
    from mlflow.tracking import MlflowClient

    wd, _, _ = default_run
    ev = only_evidence_dir(wd, "tiny")
    manifest = json.loads((ev / MANIFEST).read_text())
    assert manifest["tracking"]["status"] == "logged"
    c = MlflowClient(tracking_uri=f"sqlite:///{wd / 'mlflow.db'}")
    exp = c.get_experiment_by_name("tiny")
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("evident.kind") == "parent"]
    children = [r for r in runs if r.data.tags.get("evident.kind") == "stage"]
    assert len(parents) == 1 and parents[0].data.tags["evident.id"] == ev.name
    assert parents[0].info.status == "FINISHED"
    assert sorted(r.data.tags["evident.stage"] for r in children) == sorted(manifest["stages"])
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    compare = next(r for r in children if r.data.tags["evident.stage"] == "compare")
    assert compare.data.tags["verdict"] == "all_token_text_exact"
    assert "parity/comparison.json" in {a.path for a in c.list_artifacts(compare.info.run_id, "parity")}


@cluster.shares_default_run
def test_second_run_does_nothing(default_run):
    wd, _, _ = default_run
    ev = only_evidence_dir(wd, "tiny")
    before = {p: p.stat().st_mtime_ns for p in ev.rglob("*")}
    t0 = time.perf_counter()
    again = snakemake(wd)
    print(f"no-op rerun: {time.perf_counter() - t0:.1f}s")
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr
    assert {p: p.stat().st_mtime_ns for p in ev.rglob("*")} == before
    # a sealed directory is never recomputed, even with its inputs gone (`make clean`)
    shutil.rmtree(wd / ".evident")
    again = snakemake(wd)
    assert again.returncode == 0, again.stdout[-2000:]
    assert {p: p.stat().st_mtime_ns for p in ev.rglob("*")} == before
    assert (wd / ".evident" / "gates" / "tiny" / f"{ev.name}.json").is_file()  # the gate re-read the seal


def test_unknown_key_and_bad_value_fail_naming_the_key(tmp_path):
    bad = campaign(tmp_path, **{"parity.batch_szes": [1]})
    r = snakemake(tmp_path, "-n", "--configfile", str(bad))
    assert r.returncode != 0 and "at `parity`" in r.stdout and "'batch_szes' was unexpected" in r.stdout
    bad = campaign(tmp_path, device="gpu")
    r = snakemake(tmp_path, "-n", "--configfile", str(bad))
    assert r.returncode != 0 and "at `device`: 'gpu' is not one of" in r.stdout
    bad = campaign(tmp_path, campaign="../escape")
    r = snakemake(tmp_path, "-n", "--configfile", str(bad))
    assert r.returncode != 0 and "at `campaign`: '../escape' does not match" in r.stdout
    assert not (tmp_path / "evidence").exists()


def test_corrupt_local_checkpoint_fails_naming_the_file(tmp_path):
    from evident.workflow.models.checkpoints import write_synthetic

    cfg = tinyev.synthetic()
    ckpt = write_synthetic(tmp_path / "ckpt", cfg["config"], 0, cfg["init_std"], "float32")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    spec = {"source": "local", "path": str(ckpt)}
    r = snakemake(tmp_path, "--configfile", str(campaign(tmp_path, checkpoint=spec)))
    assert r.returncode != 0
    assert "model.safetensors" in r.stdout + r.stderr and "corrupt or truncated" in r.stdout + r.stderr
    ev = only_evidence_dir(tmp_path, "e2e")
    assert not (ev / MANIFEST).exists() and not (ev / "checkpoint.json").exists()
    assert str(tmp_path) not in (ev / "config.yaml").read_text()  # local paths are redacted
    assert ckpt.is_dir() and weights.is_file()  # the user's directory is never a rule output
    assert json.loads((ev / "stages/checkpoint.json").read_text())["status"] == "failed"


def test_accuracy_gap_fails_the_run_after_sealing_a_real_divergence(tmp_path):
    """transformers' native DeepseekV2 ignores norm_topk_prob; the engine follows DeepSeek's
    reference semantics, so this config makes the two implementations really disagree. The gate fails on the
    defect itself, with or without `parity.require_exact`."""
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())["checkpoint"]["config"]
    cfg["norm_topk_prob"] = True
    # parity and its oracle alone: the stages that see the gap
    r = snakemake(tmp_path, "--configfile", str(campaign(tmp_path, **{"checkpoint.config": cfg, "stages": ["parity"]})))
    assert r.returncode != 0
    assert "engine_accuracy_gap" in r.stdout + r.stderr
    ev = only_evidence_dir(tmp_path, "e2e")
    manifest = json.loads((ev / MANIFEST).read_text())  # sealed before the gate failed
    assert manifest["verdict"] == "engine_accuracy_gap"
    div = json.loads((ev / "parity/comparison.json").read_text())["first_divergence"]
    assert div["case"] == "greeting" and div["oracle_token"] != div["engine_token"]
    assert div["oracle_margin"] >= 1e-4
    cells = json.loads((ev / "parity/comparison.json").read_text())["cells"]
    assert all(not c["logic"]["pass"] for c in cells)  # the teacher-forced float32 run sees it too


def test_snakemake_lint_has_only_the_justified_finding(tmp_path):
    r = subprocess.run([str(SNAKEMAKE), "--lint", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    findings = {line.strip() for line in (r.stdout + r.stderr).splitlines() if line.strip().startswith("* ")}
    # justified in workflow/rules/common.smk: the project venv is the software environment
    assert findings == {"* Specify a conda environment or container for each rule.:"}


def test_a_campaign_pointed_at_a_server_url_and_a_command_seals_their_verdicts(tmp_path):
    """`engines:` (docs/engine-targets.md): a running OpenAI-compatible server's URL (the engine's own, on a
    checkpoint written from the same spec: the same bytes) and a command, beside the builtin engine, in one run:
    each its parity run held to the oracle, the URL a quality target and benched over HTTP too (with the builtin
    engine's server, beside the in-process bench), sealed with each verdict and level. `parity.kernels: [torch,
    triton]`: the builtin engine also runs through the Triton kernels (the interpreter on the CPU), each setting
    with its own parity cells against the same oracle (no other end-to-end run takes the triton path)."""
    from evident.workflow.models import checkpoints
    from evident.workflow.plan import targets

    spec = tinyev.synthetic()
    ckpt = tmp_path / "served-ckpt"
    checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], "float32")
    command = f"{{python}} {REPO / 'tests/command_engine.py'} --checkpoint {{checkpoint}} --dtype {{dtype}} {{request}} {{out}}"
    with targets.engine_server(ckpt, "cpu", "float32", tmp_path / "logs/served.log") as (url, _):
        cfg = campaign(tmp_path, **{"stages": ["parity", "serve_bench", "quality"], "parity.batch_sizes": [1, 2],
                                    "parity.kernels": ["torch", "triton"],
                                    "cases": [{"name": "greeting", "prompt": "Hello", "max_new_tokens": 4}],
                                    "bench.batch_sizes": [1, 2], "bench.prompts": ["Hi", "Hello, evident!"],
                                    "bench.http": {"concurrency": [1, 2]},
                                    "engines": [{"name": "remote", "kind": "openai", "url": url},
                                                {"name": "mine", "kind": "command", "command": command}],
                                    "quality.targets": ["hf", "remote"]})
        r = snakemake(tmp_path / "wd", "--configfile", str(cfg))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ev = only_evidence_dir(tmp_path / "wd", "e2e")
    comparison = json.loads((ev / "parity/comparison.json").read_text())
    assert {n: (t["level"], t["verdict"]) for n, t in comparison["targets"].items()} == {
        "remote": ("token", "all_token_text_exact"), "mine": ("token", "all_token_text_exact")}
    assert comparison["verdict"] == "all_token_text_exact"
    assert {c["backend"] for c in comparison["cells"]} == {"single", "remote", "mine"}
    assert sorted((c["kernels"], c["batch"], c["verdict"]) for c in comparison["cells"] if c["backend"] == "single") \
        == [("torch", 1, "all_token_text_exact"), ("torch", 2, "all_token_text_exact"),
            ("triton", 1, "all_token_text_exact"), ("triton", 2, "all_token_text_exact")]
    run = json.loads((ev / "parity/single-triton-b2.json").read_text())
    assert run["kernels"] == "triton" and run["backend"] == "single"
    assert json.loads((ev / "stages/parity-single-triton.json").read_text())["params"]["kernels"] == "triton"
    assert (ev / "quality/gsm8k-remote.json").is_file()
    summary, details = (ev / SUMMARY).read_text(), (ev / DETAILS).read_text()
    assert "`remote` (openai, token level)" in summary and "| engine target |" in summary
    assert "Engine targets" in details
    assert url.split("//")[1] not in (ev / "config.yaml").read_text()  # a hash of the URL only
    for target in ("engine", "remote"):  # the builtin engine's server and the URL: every concurrency
        assert all((ev / f"bench/http-{target}-c{c}.json").is_file() for c in (1, 2)), target
    side = [r for r in csv.DictReader((ev / "bench/summary.csv").open()) if r["transport"] == "http"]
    assert {(r["target"], r["inprocess_cell"]) for r in side} == {  # each prompt contract beside its own
        ("engine", "single-b1"), ("engine", "single-b2"), ("engine", "single-distinct-b1"),
        ("engine", "single-distinct-b2"), ("remote", "")}
    assert "### Benchmark over HTTP" in details and "| `remote` | same | 2 |" in re.sub(" +", " ", details)
    assert "| `remote` | same |" in summary
    gate = json.loads(next((tmp_path / "wd/.evident/gates/e2e").glob("*.json")).read_text())
    assert gate["parity_targets"] == {"remote": {"verdict": "all_token_text_exact", "level": "token"},
                                      "mine": {"verdict": "all_token_text_exact", "level": "token"}}


V4 = yaml.safe_load((REPO / "config/campaigns/v4-tiny.yaml").read_text())


@pytest.fixture(scope="module")
def v4_run(tmp_path_factory):
    """The shipped DeepSeek-V4 campaign (config/campaigns/v4-tiny.yaml: every stage a CPU runs, require_exact) cut to a
    few tokens, shared by the assertions below, with its tracking server unreachable (a loopback port with nothing
    listening: the evidence goes to the store at the seal, whatever the stages, so one run shows both). Returns (the
    evidence directory, the tracking URI)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    wd = tmp_path_factory.mktemp("v4")
    cfg = copy.deepcopy(V4)
    cfg["campaign"] = "v4-e2e"
    for case in cfg["cases"]:
        case["max_new_tokens"] = 10  # the prompts (28-65 tokens) already leave the window and close entries
    cfg["parity"]["batch_sizes"] = [1, 2]
    cfg["bench"].update(batch_sizes=[1], new_tokens=4, warmup=0, repeats=1)
    cfg["overlap"]["inputs"] = 2
    cfg["quality"]["gsm8k"].update(limit=2, max_tokens=8)
    cfg["profile"]["steps"] = 2
    path = wd / "v4.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    r = snakemake(wd, "--configfile", str(path), env={"MLFLOW_TRACKING_URI": uri})
    print(f"v4 campaign: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return only_evidence_dir(wd, "v4-e2e"), uri


def test_v4_campaign_is_token_exact_against_transformers(v4_run):
    ev, _ = v4_run
    manifest = json.loads((ev / MANIFEST).read_text())
    assert manifest["verdict"] == "all_token_text_exact" and manifest["gates"]["parity"] == "all_token_text_exact"
    comparison = json.loads((ev / "parity/comparison.json").read_text())
    assert comparison["verdict"] == "all_token_text_exact"
    cells = [c for c in comparison["cells"] if c["case"] != "ragged"]
    assert sorted({(c["backend"], c["kernels"], c["batch"]) for c in cells}) == [("single", "torch", 1),
                                                                                  ("single", "torch", 2)]
    assert len(cells) == 2 * len(V4["cases"])
    ragged = [c for c in comparison["cells"] if c["case"] == "ragged"]  # b2: two cases' prompts of their own lengths
    assert [(c["batch"], c["verdict"], c["ragged"]["verdict"]) for c in ragged] == [
        (2, "all_token_text_exact", "rows_as_alone")]
    for c in cells:  # every case, free-running and teacher-forced in float32
        assert c["verdict"] == "all_token_text_exact" and c["first_divergence"] is None, c
        assert c["logic"]["pass"] and c["logic"]["max"] < 1e-4 and c["logic"]["top1_agreement"] == 1.0, c
    oracle = json.loads((ev / "oracle/hf.json").read_text())
    assert oracle["implementation"].startswith("transformers.DeepseekV4ForCausalLM")
    assert all(len(c["prompt_ids"]) > 2 * 8 for c in oracle["cases"])  # past the sliding window of 8
    recorded = yaml.safe_load((ev / "config.yaml").read_text())
    assert recorded["checkpoint"]["config"]["model_type"] == "deepseek_v4"
    assert "skipped" not in json.loads((ev / "checkpoint.json").read_text())  # no MTP tensors written


V4_FILES = ("bench/single-b1.json", "bench/hf-b1.json", "bench/summary.csv", "plots/bench.png", "overlap/screen.json",
            "plots/overlap.png", "kernels/audit.json", "quality/gsm8k-engine.json", "quality/gsm8k-hf.json",
            "logs/quality-engine-server.log", "profile/capture.json", "profile/kernels.csv", "plots/profile.png")


def test_v4_campaign_runs_every_cpu_stage(v4_run):
    ev, _ = v4_run
    manifest = json.loads((ev / MANIFEST).read_text())
    stages = dict(manifest["stages"])
    assert stages.pop("kernel_audit") == "skipped"  # nothing compiles without CUDA
    assert stages == {s: "ok" for s in ("context", "checkpoint", "oracle", "parity-single", "compare", "bench-single",
                                        "bench-hf", "serve_bench-engine", "bench_report", "overlap", "quality",
                                        "profile")}
    for rel in V4_FILES:
        assert (ev / rel).is_file(), rel
    screen = json.loads((ev / "overlap/screen.json").read_text())  # the model's own C4 projections, bitwise
    screened = screen["shapes"].get("configured") or screen["shapes"]
    assert {k: screened[k] for k in ("source", "K", "segments", "gemm_n")} == {
        "source": "model", "K": 64, "segments": [128, 64, 8], "gemm_n": 64}, screen["shapes"]
    assert screen["bitwise"]["all_outputs_equal"] == screen["bitwise"]["inputs"] == 2
    assert manifest["gates"]["overlap"] == "not_measured"  # no timing without CUDA, never a pass
    audit = json.loads((ev / "kernels/audit.json").read_text())
    assert audit["verdict"] == "not_compiled" and any(k.startswith("DeepSeek-V4") for k in audit["not_covered"])
    gate = json.loads((ev / "quality/gsm8k-gate.json").read_text())
    assert gate["advisory"] and gate["random_weights"]
    assert gate["gates"][0]["same_completion"] == gate["gates"][0]["rows"] == 2  # the engine answers as transformers
    capture = json.loads((ev / "profile/capture.json").read_text())
    assert capture["tool"] == "torch" and capture["steps"] == 2
    parts = capture["floor"]["bytes"]
    assert parts["cache"] > 0 and parts["chosen_experts"] == 3 * 2 * 3 * 64 * 32 * 4  # layers x top-k x expert
    summary = (ev / SUMMARY).read_text()
    assert "transformers DeepseekV4 oracle" in summary and "DeepSeek-V4 attention" in summary  # the audit's gap
    assert "DeepSeek-V4 attention" in (ev / DETAILS).read_text()


def test_tracking_unreachable_still_seals_complete_evidence(v4_run):
    """The v4 run's tracking server was unreachable: the run passed, sealed every file with tracking pending (`evident
    sync` replays it), and the URL (a host) reached no evidence file. The recorded campaign is the file's alone: no
    key of the default campaign's model (its yarn rope) joins the V4 model's."""
    ev, uri = v4_run
    manifest = json.loads((ev / MANIFEST).read_text())
    assert manifest["tracking"]["status"] == "pending"
    for p in ev.rglob("*"):
        assert not p.is_file() or uri.removeprefix("http://") not in p.read_text(errors="replace"), p
    recorded = yaml.safe_load((ev / "config.yaml").read_text())
    assert "tracking" not in recorded
    assert "rope_scaling" in TINY["checkpoint"]["config"] and "rope_scaling" not in recorded["checkpoint"]["config"]
    assert {"oracle/hf.json", "parity/single-b2.json", "parity/comparison.json", "SUMMARY.md", *V4_FILES} \
        <= set(manifest["files"])
