"""Beyond one machine (docs/gpu-and-cluster.md "Running on a cluster").

- Resources and local GPU assignment: every rule declares its resources from the campaign; with
  `--resources gpu=N` each GPU job of a local run gets devices of its own (checked on the CPU by the assignment,
  on two GPUs also by the device each job's torch saw).
- A real cluster: the default campaign on a one-node Slurm cluster (Debian's slurmctld, slurmd, munge) through
  `--workflow-profile workflow/profiles/slurm`, tracked by an `mlflow server` on PostgreSQL: its expert-parallel
  parity run (two torchrun ranks in one job), the comparison and the seal go through sbatch, the other stages' files
  are the local run's; the evidence must equal the local run's, and the server must hold the parent and child runs
  (tests/cluster.py sets it all up).
"""

from __future__ import annotations

import importlib.util
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

from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.core.layout import DETAILS, MANIFEST, SUMMARY
from evident.workflow.plan import gpus

REPO = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
EP2 = REPO / "config/campaigns/dsv2-lite-ep2.yaml"


def env_without(*names: str, **extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in names and not k.startswith("SLURM_")}
    e.update(extra)
    return e


def smk(workdir: Path, *args: str, env: dict | None = None, snakefile: Path = REPO / "Snakefile",
        timeout: float = 900, snakemake: tuple[str, ...] = ("-m", "snakemake")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *snakemake, "-s", str(snakefile), "-d", str(workdir), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else env_without("MLFLOW_TRACKING_URI"))


# --- resources per rule ----------------------------------------------------------------------------------------

def dry_jobs(out: str) -> list[dict]:
    """The jobs of `snakemake -n -p`: rule, wildcards, resources, shell command."""
    jobs = []
    for block in re.split(r"\n(?=rule |localrule )", out):
        m = re.match(r"(?:local)?rule (\w+):", block)
        if not m or m.group(1) == "all":
            continue
        res = re.search(r"resources: (.*)", block).group(1)
        jobs.append({"rule": m.group(1), "wildcards": (re.search(r"wildcards: (.*)", block) or [None, ""])[1],
                     "resources": dict(kv.split("=", 1) for kv in res.split(", ") if "=" in kv),
                     "shell": (re.search(r"Shell command: (.*)", block) or [None, ""])[1]})
    return jobs


def test_every_rule_declares_its_resources_from_the_campaign(tmp_path):
    # the default campaign on the CPU, through the local profile: no GPU anywhere, no device wrapper
    r = smk(tmp_path / "cpu", "-n", "-p", "--workflow-profile", str(REPO / "workflow/profiles/local"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = dry_jobs(r.stdout)
    assert len(jobs) == 19 and len({j["rule"] for j in jobs}) == 16, sorted(j["rule"] for j in jobs)
    for j in jobs:
        assert j["resources"]["gpu"] == "0" and "gpu_model" not in j["resources"], j
        assert {"cpus_per_task", "mem_mb", "runtime"} <= set(j["resources"]), j
        assert "evident.workflow.plan.gpus" not in j["shell"], j
        # the CPU runs Triton's interpreter, whose switch Triton reads when torch first imports it
        if j["rule"] in ("parity", "bench", "serve_bench", "overlap", "profile", "quality"):
            assert "TRITON_INTERPRET=1 " in j["shell"], j
    bench = [j for j in jobs if j["rule"] in ("bench", "serve_bench")]
    assert {j["resources"]["cpus_per_task"] for j in bench} == {str(os.cpu_count())}  # a timing run: all cores

    # an EP2 campaign on GPUs (submitted from a machine without one): an EP stage asks for 2 GPUs, a single-device
    # stage for 1, CPU-only stages for none; the campaign's GPU model goes to the GPU jobs only
    ep2 = tmp_path / "ep2.yaml"
    ep2.write_text(yaml.safe_dump({**yaml.safe_load(EP2.read_text()), "resources": {"gpu_model": "h200",
                                                                                   "mem_mb": 65536}}))
    r = smk(tmp_path / "gpu", "-n", "-p", "-c8", "--resources", "gpu=2", "--configfile", str(ep2),
            env=env_without("MLFLOW_TRACKING_URI", EVIDENT_SKIP_DEVICE_CHECK="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = dry_jobs(r.stdout)
    cpu_only = {"record_checkpoint", "compare", "bench_report", "seal", "gate", "archive"}
    for j in jobs:
        want = (0 if j["rule"] in cpu_only else
                2 if j["rule"] in ("parity", "bench") and j["wildcards"].split(",")[0] not in ("backend=single", "backend=hf") else
                2 if j["rule"] == "context" else 1)  # context records the devices the campaign uses: all of them
        assert j["resources"]["gpu"] == str(want), j
        assert j["resources"].get("gpu_model") == ("h200" if want else None), j
        assert j["resources"]["mem_mb"] == "65536"
        assert (f"-m evident.workflow.plan.gpus {want} -- " in j["shell"]) == bool(want), j
        assert "TRITON_INTERPRET" not in j["shell"], j
    assert {j["rule"] for j in jobs if j["resources"]["gpu"] == "2"} == {"context", "parity", "bench"}
    # the scheduler's resources are not part of what was measured: the id's config hash is the same without them
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(EP2.read_text()).items() if k != "resources"}))
    config_part = r"evidence/dsv2-lite-ep2/[^/ ]+-c([0-9a-f]{8})-r1/"
    hashes = {re.search(config_part, r.stdout).group(1)}
    r = smk(tmp_path / "gpu", "-n", "-c8", "--configfile", str(plain),
            env=env_without("MLFLOW_TRACKING_URI", EVIDENT_SKIP_DEVICE_CHECK="1"))
    hashes.add(re.search(config_part, r.stdout).group(1))
    assert len(hashes) == 1, hashes


# --- local GPU assignment --------------------------------------------------------------------------------------

# A workflow of GPU jobs written with the real rules' helpers (rules/common.smk: job_resources, on_gpus), each job
# recording the devices it was given, what torch saw there (on a GPU machine), and when it ran.
PROBE = """import json, os, sys, time
t0 = time.time()
seen = None
if os.environ.get("CUDA_VISIBLE_DEVICES") and os.path.exists("/dev/nvidia0"):
    import torch
    seen = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
time.sleep(float(sys.argv[2]))
json.dump({"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "uuids": seen, "start": t0, "end": time.time()},
          open(sys.argv[1], "w"))
"""
SNAKEFILE = """from evident.workflow.plan.campaign import validate_campaign

configfile: "campaign.yaml"
validate_campaign(config, "{repo}/config/schema.yaml")

include: "{repo}/workflow/rules/common.smk"

rule all:
    input: expand("jobs/one-{{i}}.json", i=range({one})) + expand("jobs/two-{{i}}.json", i=range({two}))

rule one:
    output: "jobs/one-{{i}}.json"
    resources: **job_resources(gpu=1)
    params: py=on_gpus(1)
    shell: "{{params.py}} probe.py {{output}} {sleep}"

rule two:
    output: "jobs/two-{{i}}.json"
    resources: **job_resources(gpu=2)
    params: py=on_gpus(2)
    shell: "{{params.py}} probe.py {{output}} {sleep}"
"""


def gpu_workflow(wd: Path, one: int, two: int = 0, sleep: float = 2) -> Path:
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "probe.py").write_text(PROBE)
    cfg = {"campaign": "gpus", "device": "cuda", "checkpoint": tinyev.synthetic(),
           "cases": TINY["cases"][:1]}
    (wd / "campaign.yaml").write_text(yaml.safe_dump(cfg))
    (wd / "Snakefile").write_text(SNAKEFILE.format(repo=REPO, one=one, two=two, sleep=sleep))
    return wd / "Snakefile"


def jobs_of(wd: Path) -> list[dict]:
    return [read_json(p) for p in sorted((wd / "jobs").glob("*.json"))]


def overlapping(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_two_gpu_jobs_at_once_get_different_devices(tmp_path):
    """`--resources gpu=2` lets two single-GPU jobs run at once: each gets its own device. On a CPU machine the
    pool is ids 0..1 and the check is the assignment; with two GPUs each job's torch must also see a different one
    (`.venv/bin/python -m pytest tests/test_cluster.py -k different_devices` on a 2-GPU machine)."""
    env = env_without("MLFLOW_TRACKING_URI", "CUDA_VISIBLE_DEVICES", gpus.POOL_ENV, EVIDENT_SKIP_DEVICE_CHECK="1")
    wd = tmp_path / "two"
    # the greedy scheduler: a GPU machine with only the carried wheels has no ILP solver (tools/device_wheels.sh)
    r = smk(wd, "-c4", "--resources", "gpu=2", "--scheduler", "greedy", snakefile=gpu_workflow(wd, one=4), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = jobs_of(wd)
    assert len(jobs) == 4 and {j["cvd"] for j in jobs} == {"0", "1"}, jobs
    pairs = [(a, b) for i, a in enumerate(jobs) for b in jobs[i + 1:] if overlapping(a, b)]
    assert pairs, "no two jobs ran at once"
    for a, b in pairs:  # never one device for two jobs at once
        assert a["cvd"] != b["cvd"], (a, b)
        if a["uuids"] is not None:
            assert a["uuids"] != b["uuids"] and len(a["uuids"]) == 1, (a, b)
    assert not any(overlapping(a, b) and overlapping(a, c) and overlapping(b, c)
                   for i, a in enumerate(jobs) for k, b in enumerate(jobs[i + 1:], i + 1) for c in jobs[k + 1:])

    # an EP2 job holds both devices: nothing runs beside it
    wd = tmp_path / "ep"
    r = smk(wd, "-c4", "--resources", "gpu=2", "--scheduler", "greedy",
            snakefile=gpu_workflow(wd, one=2, two=1, sleep=1.5), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = jobs_of(wd)
    two = [j for j in jobs if j["cvd"] and "," in j["cvd"]]
    assert len(two) == 1 and two[0]["cvd"] == "0,1"
    assert not any(overlapping(two[0], j) for j in jobs if j is not two[0])
    if two[0]["uuids"] is not None:
        assert len(set(two[0]["uuids"])) == 2


def test_a_job_waits_for_a_free_device_and_cluster_jobs_are_left_alone(tmp_path):
    """The pool never hands out a held device; a job the local run did not start (a Slurm job) keeps its devices."""
    env = env_without("CUDA_VISIBLE_DEVICES", gpus.POOL_ENV, PYTHONPATH=str(REPO))
    mine = f"{socket.gethostname()}:{os.getpid()}"  # this test process, an ancestor of the jobs below, owns the pool
    held = gpus.acquire(1, ["0"], locks=tmp_path / ".evident/gpus")
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "evident.workflow.plan.gpus", "1", "--", "sh", "-c", f"echo $CUDA_VISIBLE_DEVICES > {out}"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env={**env, gpus.POOL_ENV: f"0@{mine}"}, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    assert p.poll() is None and not out.exists()  # waiting, not sharing
    held[0][1].close()
    assert p.wait(timeout=30) == 0 and out.read_text().strip() == "0"
    assert "waiting for 1 free GPU(s) of 0" in p.stderr.read()
    # exported by a Snakemake process that is not its ancestor (a Slurm job's case): its devices stay as they are
    other = subprocess.Popen(["sleep", "60"])
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**env, gpus.POOL_ENV: f"0,1@{socket.gethostname()}:{other.pid}",
                            "CUDA_VISIBLE_DEVICES": "7"})
    other.kill()
    other.wait()
    assert r.returncode == 0 and out.read_text().strip() == "7" and "evident:" not in r.stderr
    # a job that needs more devices than the pool has fails, saying so
    r = subprocess.run([sys.executable, "-m", "evident.workflow.plan.gpus", "2", "--", "true"], cwd=tmp_path, capture_output=True,
                       text=True, env={**env, gpus.POOL_ENV: f"0@{mine}"}, timeout=60)
    assert r.returncode != 0 and "needs 2 GPU(s), the local pool has 1" in r.stderr


# --- a real cluster ------------------------------------------------------------------------------------------

# Files whose content depends on the clock (tests/reliability/test_faults.py: TIME_VARYING): stage records, logs,
# bench timings and what is drawn from them. Everything else must be byte-identical between the two runs.
TIME_VARYING = ("MANIFEST.json", "SUMMARY.md", "DETAILS.md", "stages/", "logs/", "bench/", "plots/bench.png",
                "profile/", "plots/profile.png")
NO_PLUGIN = "the Slurm executor plugin is not installed: pip install -e '.[cluster]' (the test extra includes it)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld, slurmd, postgres and `mlflow server`; skips, saying why, where one cannot start."""
    for mod, why in (("snakemake_executor_plugin_slurm", NO_PLUGIN), ("psycopg2", "psycopg2 is not installed: "
                     "pip install -e '.[cluster]'"), ("flask", "`mlflow server` needs the full mlflow package")):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(why)
    root = tmp_path_factory.mktemp("cluster")
    daemons = cluster.Daemons(root, shared=root / "shared")
    t0 = time.perf_counter()
    try:
        install_s = cluster.install()
        daemons.munge()
        daemons.slurm()
        daemons.postgres()
        daemons.mlflow()  # migrates its database while the local run goes on
    except (cluster.Unavailable, OSError, subprocess.SubprocessError) as e:
        daemons.stop()
        pytest.skip(f"no one-node Slurm cluster on this machine: {e}")
    print(f"\ncluster: packages installed in {install_s:.1f}s, daemons started in "
          f"{time.perf_counter() - t0 - install_s:.1f}s")
    yield daemons
    daemons.stop()


def sealed(wd: Path) -> Path:
    dirs = [p for p in (wd / "evidence/tiny").iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


# The stages the Slurm run computes itself, then the seal: the engine's expert-parallel parity run (two torchrun ranks
# in one job, over gloo) and the comparison of every run (one process), held byte for byte to the local run's. Every
# stage of the default campaign again on Slurm (16 jobs, not 3) took 3.5 times as long: the others are one process each
# (quality and serve_bench with the engine's server beside them in the job), and bench, serve_bench and profile leave
# timings, never compared.
ON_SLURM = ("parity-collective", "compare")


def seed_evidence(local: Path, remote: Path) -> list[str]:
    """The local run's evidence directory copied to `remote` (times kept, as a rerun of an interrupted campaign finds
    its finished stages) but for the seal's files and every file of the stages ON_SLURM: their stage records,
    results, logs and benchmark records. Returns those stages' names."""
    skip, rerun = {MANIFEST, SUMMARY, DETAILS}, []
    for record in sorted((local / layout.STAGES).glob("*.json")):
        r = read_json(record)
        if r["name"] in ON_SLURM:
            rerun.append(r["name"])
            skip |= {layout.stage_record(r["name"]), *r["files"], layout.log(r["name"]), layout.benchmark(r["name"])}
    for p in sorted(local.rglob("*")):
        rel = p.relative_to(local).as_posix()
        if p.is_file() and rel not in skip:
            (remote / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, remote / rel)
    return rerun


@pytest.mark.slow
@cluster.shares_default_run
def test_default_campaign_on_slurm_equals_the_local_run(slurm, tmp_path_factory):
    local, r, local_s = cluster.default_local_run(tmp_path_factory)  # shared with any other test that needs it
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    try:
        slurm.mlflow_ready()
    except cluster.Unavailable as e:
        pytest.skip(f"no tracking server on PostgreSQL here: {e}")

    remote = slurm.shared / "work"
    # the trained checkpoint cached as the local run left it (training is deterministic on one platform:
    # tests/test_training.py), and the local run's files of the stages Slurm does not run
    cluster.seed_checkpoint_cache(remote, tmp_path_factory)
    a = sealed(local)
    rerun = seed_evidence(a, remote / a.relative_to(local))
    assert sorted(rerun) == sorted(ON_SLURM), rerun
    t0 = time.time()
    r = smk(remote, "--workflow-profile", str(REPO / "workflow/profiles/slurm"),
            # no accounting database here: squeue is the status command. The plugin polls 1 s after a job ends,
            # then 10 s longer after each check that finds none ended (not configurable); its waits are capped at
            # cluster.POLL_CAP_S here, so each job's end is seen within seconds
            "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1",
            env=env_without("MLFLOW_TRACKING_URI", gpus.POOL_ENV, MLFLOW_TRACKING_URI=slurm.mlflow_uri),
            snakemake=("-c", cluster.SNAKEMAKE_POLL_CAPPED))
    slurm_s = time.time() - t0
    print(f"default campaign: local {local_s:.1f}s; on slurm, {', '.join(rerun)} and the seal {slurm_s:.1f}s")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    # the stages above and the seal went through sbatch (gate and archive are local rules); nothing copied ran again
    assert len(submitted) == len(rerun) + 1, out[-3000:]

    b = sealed(remote)
    assert a.name == b.name  # same code, same config, same evidence id
    ma, mb = read_json(a / MANIFEST), read_json(b / MANIFEST)
    assert sorted(ma["files"]) == sorted(mb["files"])
    computed = {rel for name in rerun for rel in read_json(b / layout.stage_record(name))["files"]}
    for name in rerun:  # written by this run's jobs, not copied
        assert read_json(b / layout.stage_record(name))["started_utc"] >= time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime(t0 - 1)), name
    stable = [rel for rel in ma["files"] if not rel.startswith(TIME_VARYING)]
    assert len(stable) >= 20, stable
    # the run at every batch and the comparison, computed on Slurm, among the files held byte for byte
    assert computed <= set(stable) and "parity/comparison.json" in computed and len(computed) == 1 + 3, computed
    differ = [rel for rel in stable if ma["files"][rel]["sha256"] != mb["files"][rel]["sha256"]]
    assert differ == [], differ
    for key in ("verdict", "stages", "quality", "config_sha256", "git"):
        assert ma.get(key) == mb.get(key), key
    assert ma["verdict"] == "all_token_text_exact"
    for rel in ma["files"]:  # stage records agree on all but the clock and timings
        if rel.startswith("stages/"):
            x, y = read_json(a / rel), read_json(b / rel)
            for k in ("started_utc", "finished_utc", "seconds", "metrics"):
                x.pop(k), y.pop(k)
            assert x == y, rel

    # the tracking server on PostgreSQL holds the parent and a child run per stage, artifacts on the shared file system
    from mlflow.tracking import MlflowClient

    assert ma["tracking"]["status"] == mb["tracking"]["status"] == "logged"
    c = MlflowClient(slurm.mlflow_uri)
    runs = c.search_runs([c.get_experiment_by_name("tiny").experiment_id], max_results=1000)
    parents = [x for x in runs if x.data.tags.get("evident.kind") == "parent"]
    children = [x for x in runs if x.data.tags.get("evident.kind") == "stage"]
    assert len(parents) == 1 and parents[0].data.tags["evident.id"] == b.name
    assert parents[0].info.run_id == mb["tracking"]["parent_run_id"]
    assert sorted(x.data.tags["evident.stage"] for x in children) == sorted(mb["stages"])
    assert {x.info.status for x in runs} == {"FINISHED"}
    assert all(x.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for x in children)
    art = slurm.shared / "mlflow-artifacts"
    assert all(x.info.artifact_uri.startswith(str(art)) for x in runs)
    assert (art / parents[0].info.experiment_id / parents[0].info.run_id / "artifacts" / MANIFEST).is_file()
    import psycopg2  # the runs are rows of the PostgreSQL store, not of some local file

    with psycopg2.connect(slurm.pg_uri) as db, db.cursor() as cur:
        cur.execute("select count(*) from runs where lifecycle_stage = 'active'")
        assert cur.fetchone()[0] == len(runs) == len(mb["stages"]) + 1
