# Shared values: the evidence id is derived from the code (git) and the resolved config.
import json
import os
import sys

from workflow.campaign import evidence_config
from workflow.evidence import config_hash, evidence_id, git_state

PY = sys.executable  # the stages run in the interpreter that runs Snakemake
GIT = git_state(workflow.basedir)
RECORDED = evidence_config(config)  # what config.yaml holds and the id hashes: no tracking, no paths
EID = evidence_id(GIT, RECORDED, config["repeat"])
E = f"evidence/{config['campaign']}/{EID}"
SEALED = os.path.exists(f"{E}/MANIFEST.json")
GATE = f".evident/gates/{config['campaign']}/{EID}.json"
SEAL_LOGS = f".evident/logs/{config['campaign']}/{EID}"
CONFIG_JSON = json.dumps(RECORDED, sort_keys=True)


def checkpoint_dir():
    """A local checkpoint is used in place (never a rule's output, so Snakemake never deletes it);
    synthetic and hub ones live in a cache keyed by their spec."""
    spec = config["checkpoint"]
    if spec["source"] == "local":
        return spec["path"]
    key = config_hash({"checkpoint": spec, "dtype": config["dtype"], "device": config["device"]})[:12]
    return f".evident/checkpoints/{spec['source']}-{key}"


CKPT = checkpoint_dir()
# An engine run is a backend, `-triton` added when the engine decodes through the Triton kernels.
PARITY_RUNS = [b if k == "torch" else f"{b}-{k}" for k in config["parity"]["kernels"] for b in config["parity"]["backends"]]
PARITY = [f"{E}/parity/{r}-b{n}.json" for r in PARITY_RUNS for n in config["parity"]["batch_sizes"]]
BENCH = [f"{E}/bench/{b}-b{n}.json" for b in config["bench"]["backends"] for n in config["bench"]["batch_sizes"]]


def backend_of(wildcards):
    """The backend of a rule's `run` wildcard (single, host-staged or collective, maybe `-triton`)."""
    return wildcards.run.removesuffix("-triton")


def kernels_of(wildcards):
    return "triton" if wildcards.run.endswith("-triton") else "torch"


def launcher(wildcards, threads):
    """The engine's expert-parallel backends run as torchrun ranks; `single` is one process.

    The job's threads are shared among the ranks: oversubscribed cores make gloo crawl.
    """
    if backend_of(wildcards) == "single":
        return PY
    n = config["parallel"]["ep_size"]
    return f"OMP_NUM_THREADS={max(1, threads // n)} {PY} -m torch.distributed.run --standalone --nproc-per-node {n}"


def evidence_dir(wildcards):
    """The evidence directory, as a param function (a hard-coded prefix of outputs is a lint)."""
    return E


# `snakemake --lint` asks for a conda environment or container per rule. Deliberately none: the
# project's own virtual environment (`make run`) is the software environment, recorded in
# env.json, and the lent GPU machines have neither conda nor a container runtime.
