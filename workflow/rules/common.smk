# Shared values: the evidence id is derived from the code (git) and the resolved config.
import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from evident.workflow.core import layout, locks
from evident.workflow.core.evidence import evidence_id, git_state
from evident.workflow.models import families
from evident.workflow.parity import gsm8k
from evident.workflow.plan import gpus, runs, screens, targets
from evident.workflow.plan.campaign import evidence_config
from evident.workflow.plan.estimate import checkpoint_dir

# The stages run in the interpreter that runs Snakemake, named in their commands by a variable every job's shell sets
# (Snakemake's default prefix, then it), not by its path: Snakemake reruns a job whose params changed, and the same
# tree run through a venv at another path (moved, or reached through a link) must not rerun its stages.
shell.prefix(f"set -euo pipefail; export EVIDENT_PY={shlex.quote(sys.executable)}; ")
PY = '"$EVIDENT_PY"'
GIT = git_state(workflow.basedir)
RECORDED = evidence_config(config)  # what config.yaml holds and the id hashes: no tracking, resources or paths
EID = evidence_id(GIT, RECORDED, config["repeat"])
E = layout.directory(config["campaign"], EID)
SEALED = os.path.exists(f"{E}/{layout.MANIFEST}")


# Two invocations writing one evidence directory: the second is refused here, naming the first. Snakemake's own lock
# covers a running DAG's files only (a second run is first told to `--rerun-incomplete` the running job's outputs), and
# its refusal advises `--unlock`: while another run is live, that refusal names the run instead. The locks, their
# files (gone with the run, refused or not) and the stale Snakemake locks a killed run leaves: workflow/core/locks.py.
if not workflow.dryrun and workflow.is_main_process:
    WORKDIR_LOCK, _stale = locks.share_workdir()
    if _stale:
        print(f"evident: removed {_stale} stale Snakemake lock file(s) left by a run that was killed", file=sys.stderr)
    _mine = None if SEALED else Path(f".evident/locks/{config['campaign']}/{EID}.lock")
    if _stale is None:  # another run is live: its locks are real
        locks.name_live_runs(_mine)
    if _mine is not None:
        _files = [str(p) for p in workflow.overwrite_configfiles or []] or [f"{workflow.basedir}/config/config.yaml"]
        try:
            EVIDENCE_LOCK = locks.hold(_mine, locks.describe(config["campaign"], EID, _files))
        except locks.Held as h:
            raise WorkflowError(f"evidence directory {E} is being written by another snakemake run ({h}) in this "
                                "working directory; wait for it to end and run again (its lock goes when its process "
                                "does)")

SEAL_LOGS = f".evident/logs/{config['campaign']}/{EID}"
GATE_RECORD = f".evident/gates/{config['campaign']}/{EID}.json"  # the gate's record: every sealed run, passing or failing
GATE = f"{SEAL_LOGS}/gate.passed"  # the gate rule's output, written only on a pass: what `rule all` asks for
CONFIG_JSON = json.dumps(RECORDED, sort_keys=True)


CKPT = str(checkpoint_dir(config))  # workflow/plan/estimate.py (which checks its free disk)
PARITY_RUNS = [runs.run_name(b, k) for k in config["parity"]["kernels"] for b in config["parity"]["backends"]]
# the `engines:` entries as given (their URLs and commands travel on the command line; the evidence config records a
# hash of each URL and the commands with their paths redacted): parity runs each but those with `parity: false`
# (parity_target), quality the named, the HTTP bench those of kind openai
TARGETS = targets.by_name(config)
PARITY_TARGETS = {n: TARGETS[n] for n in targets.names(config)}
PARITY = [f"{E}/{layout.parity_run(f'{r}-b{n}')}" for r in [*PARITY_RUNS, *PARITY_TARGETS]
          for n in config["parity"]["batch_sizes"]]
BENCH = [f"{E}/{layout.bench_cell(runs.bench_cell(b, n, p))}" for b in config["bench"]["backends"]
         for p in runs.bench_contracts(config["bench"]) for n in config["bench"]["batch_sizes"]]
# the benchmark over HTTP's targets: the builtin engine's server (`engine`), `engines:` entries of kind openai as given
HTTP_TARGETS = {t: TARGETS.get(t) or {"name": t, "kind": targets.BUILTIN} for t in targets.bench_targets(config)}
HTTP_BENCH = ([f"{E}/{layout.bench_cell(runs.http_cell(t, c, p))}" for t in HTTP_TARGETS
               for p in runs.bench_contracts(config["bench"]) for c in config["bench"]["http"]["concurrency"]]
              if "serve_bench" in config["stages"] else [])


def launcher(wildcards, threads):
    """The engine's expert-parallel backends run as torchrun ranks; `single` is one process.

    The job's threads are shared among the ranks: oversubscribed cores make gloo crawl. On GPUs the job
    holds one device per rank (engine_gpus).
    """
    py = on_gpus(engine_gpus(wildcards))
    if wildcards.backend in runs.ONE_PROCESS:
        return py
    n = config["parallel"]["ep_size"]
    return f"OMP_NUM_THREADS={max(1, threads // n)} {py} -m torch.distributed.run --standalone --nproc-per-node {n}"


def evidence_dir(wildcards):
    """The evidence directory, as a param function (a hard-coded prefix of outputs is a lint)."""
    return E


# --- What each job asks for (docs/gpu-and-cluster.md "Running on a cluster") ------------------------------------------
# Each of the rules declares its Snakemake resources (job_resources), from the campaign: `gpu` (0 on a CPU
# campaign; an expert-parallel job one per rank), `gpu_model` (GPU jobs, where the campaign sets one),
# `cpus_per_task` (= its threads), `mem_mb`, `runtime` (minutes). The local scheduler caps running jobs by
# them (`--cores`, `--resources gpu=N`); the Slurm executor turns them into sbatch/srun --gpus, --cpus-per-task,
# --mem and --time. Locally Snakemake does not say which GPU a job gets: a GPU job's stage runs through
# `python -m evident.workflow.plan.gpus N --`, which hands it N devices of its own (workflow/plan/gpus.py); under Slurm,
# Slurm chose them and that wrapper changes nothing.
RES = config["resources"]
SCHEDULE = "EVIDENT_SCHEDULE"


def schedule():
    """(the campaign's jobs use GPUs, the cores of a job that runs alone), decided once by the Snakemake process
    that schedules the run and inherited by its jobs through the environment: a cluster job parses this file
    again on its node, which may see other GPUs and cores (Slurm's jobs inherit the environment: --export=ALL)."""
    if not workflow.is_main_process and os.environ.get(SCHEDULE):
        kind, _, cores = os.environ[SCHEDULE].partition(",")
        return kind == "gpu", int(cores)
    uses = config["device"] == "cuda" or (config["device"] == "auto" and bool(gpus.visible()))
    # a local run's --cores; a cluster executor has none (it places jobs on nodes): resources.cpus
    cores = workflow.global_resources["_cores"].value or RES["cpus"] or config["parallel"]["ep_size"]
    os.environ[SCHEDULE] = f"{'gpu' if uses else 'cpu'},{cores}"
    return uses, cores


USES_GPU, ALONE = schedule()  # ALONE: the threads of a timing run, so that no other job runs beside it
# A device per expert-parallel rank; context records the devices the campaign uses (env.json), so it holds them all.
EP_RUNS = any(b not in runs.ONE_PROCESS for s in ("parity", "bench") if s in config["stages"] for b in config[s]["backends"])
CAMPAIGN_GPUS = config["parallel"]["ep_size"] if EP_RUNS else 1

if USES_GPU and workflow.is_main_process:  # the local pool: the first N visible GPUs with --resources gpu=N
    _size = getattr(workflow.global_resources.get("gpu"), "value", None)  # None: no --resources gpu given
    _pool = gpus.export_pool(_size)
    if _size is not None and _pool is not None and len(_pool) < _size:
        print(f"evident: --resources gpu={_size}, but only {len(_pool)} GPU(s) are visible here: "
              "GPU jobs wait for a free device", file=sys.stderr)


def served_gpus(specs):
    """GPUs of a job of a target of `specs`: one where it runs an engine here (the builtin's server, a serve or command
    target), none for a URL."""
    return lambda wildcards: 0 if "url" in specs[wildcards.target] else 1


target_gpus = served_gpus(PARITY_TARGETS)  # an engine target's parity run
http_gpus = served_gpus(HTTP_TARGETS)  # the benchmark over HTTP of a target


def engine_gpus(wildcards):
    """GPUs of an engine run (parity, bench): one per rank."""
    return 1 if wildcards.backend in runs.ONE_PROCESS else config["parallel"]["ep_size"]


def on_gpus(n):
    """The interpreter a stage runs in, through workflow.gpus when it holds n GPUs. A CPU campaign's stages run the
    Triton kernels through Triton's interpreter, whose switch must be set before Python starts."""
    if not USES_GPU:
        return f"TRITON_INTERPRET=1 {PY}"
    return f"{PY} -m evident.workflow.plan.gpus {n} -- {PY}" if n else PY


def job_resources(gpu=0):
    """A rule's resources; `gpu` (the devices it holds on a GPU campaign) may be a function of the wildcards."""
    res = {"gpu": gpu if USES_GPU else 0, "cpus_per_task": lambda wildcards, threads: threads,
           "mem_mb": RES["mem_mb"], "runtime": RES["runtime"]}
    if USES_GPU and gpu and RES["gpu_model"]:
        res["gpu_model"] = RES["gpu_model"]
    return res


# `snakemake --lint` asks for a conda environment or container per rule. Deliberately none: the
# project's own virtual environment (`make run`) is the software environment, recorded in
# env.json, and the lent GPU machines have neither conda nor a container runtime.


# The quality stage (rules/quality.smk): its targets, and the paths and URLs that travel on its command line.
def quality_args(wildcards):
    """Paths and URLs travel on the command line: the evidence config records names and hashes only."""
    q, g = config["quality"], config["quality"]["gsm8k"]
    args = []
    if g["source"] == "local":
        args += [f"--test '{g['test']}'" if g["test"] else "", f"--train '{g['train']}'" if g["train"] else ""]
    args += [f"--endpoint '{t['name']}={t['url']}'" for t in q["targets"] if isinstance(t, dict)]
    if named := [TARGETS[t] for t in q["targets"] if t in TARGETS]:
        args.append(f"--engines {shlex.quote(json.dumps(named))}")
    return " ".join(a for a in args if a)


def quality_data():
    g = config["quality"]["gsm8k"]
    return [g[s] for s in ("test", "train") if g["source"] == "local" and g[s]]


QUALITY_TARGETS = [t if isinstance(t, str) else t["name"] for t in config["quality"]["targets"]]
