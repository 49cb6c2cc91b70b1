"""A campaign refused before any work, as a new user meets it: the refusal's message alone (not Snakemake's traceback
of the Snakefile's line), a non-zero exit and nothing left behind, through `snakemake` and `evident run`; a local
checkpoint that is not there; --config overrides, whose nested scalars Snakemake reads as strings, read by the schema's
types."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from campaigns import SCHEMA, rejected

from evident.workflow.plan.campaign import typed, validate_campaign

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
CASES = [{"name": "hello", "prompt": "Hello, evident!"}]
SEE = "See config/schema.yaml and docs/campaigns.md."
FOLDER = "give an existing Hugging Face-format checkpoint folder (config.json, its tokenizer and *.safetensors weights)."


def local(path) -> dict:
    return {"campaign": "mini", "checkpoint": {"source": "local", "path": str(path)}, "cases": copy.deepcopy(CASES)}


def run(command: list[str], wd: Path, *args: str) -> subprocess.CompletedProcess:
    """`snakemake` or `evident run` on the project's Snakefile in a working directory of its own (no campaign file
    in it: what is found there afterwards, the run left)."""
    wd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([*command, "-s", str(REPO / "Snakefile"), "-d", str(wd), "-c1", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def left_behind(wd: Path) -> list[str]:
    """Anything but Snakemake's own log: an evidence directory, a campaign's lock (.evident/locks/<campaign>/), an
    incomplete mark or a lock under .snakemake/."""
    return sorted(str(p.relative_to(wd)) for p in wd.rglob("*")
                  if p.is_file() and p.relative_to(wd).parts[:2] != (".snakemake", "log"))


# --- a local checkpoint must be there before any work -----------------------------------------------------------

def test_a_local_checkpoint_that_is_not_there_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rejected(local(tmp_path / "nowhere")).splitlines() == [
        f"invalid campaign config at `checkpoint.path`: {tmp_path / 'nowhere'} does not exist: {FOLDER}", SEE]
    # a relative path is read from the working directory: the message says which
    assert (f"at `checkpoint.path`: ckpt (relative to {tmp_path}) does not exist: {FOLDER}"
            in rejected(local("ckpt")))
    (tmp_path / "ckpt").mkdir()
    assert f"at `checkpoint.path`: ckpt (relative to {tmp_path}) is not a folder with a config.json: " in rejected(
        local("ckpt"))
    (tmp_path / "weights.safetensors").write_bytes(b"")
    assert f"at `checkpoint.path`: {tmp_path}/weights.safetensors is a file, not a folder: " in rejected(
        local(tmp_path / "weights.safetensors"))
    # a folder with a config.json passes this check (its weights are the checkpoint record's to check)
    (tmp_path / "ckpt/config.json").write_text(json.dumps(TINY["checkpoint"]["config"]))
    validate_campaign(local("ckpt"), SCHEMA)


@pytest.mark.parametrize("command", [["snakemake"], ["evident", "run"]], ids=["snakemake", "evident-run"])
def test_a_refusal_is_its_message_alone_and_leaves_nothing(tmp_path, command):
    """Before: Snakemake's `WorkflowError in file .../Snakefile, line 18:` and a traceback around the message, and for
    a missing local checkpoint a MissingInputException in rule record_checkpoint (after the campaign's lock was
    taken), naming the file but not the key."""
    campaign = tmp_path / "mini.yaml"
    campaign.write_text(yaml.safe_dump(local(tmp_path / "nowhere")))
    wd = tmp_path / "wd"
    r = run([str(BIN / command[0]), *command[1:]], wd, "--configfile", str(campaign))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"invalid campaign config at `checkpoint.path`: {tmp_path / 'nowhere'} does not exist: {FOLDER}", SEE], r.stderr
    assert r.stdout == ""
    assert left_behind(wd) == []


# --- --config overrides ------------------------------------------------------------------------------------------

def test_overrides_are_read_by_the_schema_s_types():
    schema = yaml.safe_load(Path(SCHEMA).read_text())
    # as Snakemake's --config hands them over: `overlap={inputs: 8, K: null, segments: [64, 32]}` and so on
    given = {"overlap": {"inputs": "8", "K": "null", "segments": ["64", "32"], "dtype": "float16"},
             "parity": {"require_exact": "true"}, "checkpoint": {"train": {"lr": "0.001"}},
             "bench": {"prompt": "8"}, "quality": {"targets": ["hf", {"name": "x", "url": "http://127.0.0.1:1/v1"}]}}
    assert typed(given, schema) == {
        "overlap": {"inputs": 8, "K": None, "segments": [64, 32], "dtype": "float16"},
        "parity": {"require_exact": True}, "checkpoint": {"train": {"lr": 0.001}},
        "bench": {"prompt": "8"},  # a string where the schema takes a string
        "quality": {"targets": ["hf", {"name": "x", "url": "http://127.0.0.1:1/v1"}]}}
    # what does not read as a type the schema takes there is left for the schema to refuse, naming the key
    assert typed({"overlap": {"inputs": "many", "K": "[1]"}, "colour": "8"}, schema) == {
        "overlap": {"inputs": "many", "K": "[1]"}, "colour": "8"}
    cfg = copy.deepcopy(TINY)
    cfg["overlap"] = {"inputs": "many"}
    assert "at `overlap.inputs`: 'many' is not of type 'integer'" in rejected(cfg, {"overlap": {"inputs": "many"}})
    # only the overrides: a campaign file's own quoted number is still refused
    cfg = copy.deepcopy(TINY)
    cfg["bench"]["new_tokens"], cfg["overlap"] = "16", {"inputs": "8"}
    msg = rejected(cfg, {"overlap": {"inputs": "8"}})
    assert "at `bench.new_tokens`: '16' is not of type 'integer'" in msg and "overlap" not in msg, msg


def test_a_nested_config_override_reaches_the_schema_typed(tmp_path):
    """Before: `'8' is not of type 'integer'` and `'256' is not of type 'integer', 'null'`. Now the values are read
    as numbers, and K alone meets the campaign check's own rule; stated with its fellows, the dry run goes on."""
    snakemake = str(BIN / "snakemake")
    r = run([snakemake], tmp_path / "k", "-n", "--config", "overlap={inputs: 8, K: 256}")
    assert r.returncode == 1 and "is not of type" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stdout.splitlines() == [  # a dry run: Snakemake logs to stdout, its note on --config first
        f"Config file {REPO}/config/config.yaml is extended by additional config specified via the command line.",
        "invalid campaign config at `overlap`: states K but not all of K, segments and gemm_n: the screen's shapes "
        "are stated together or taken from the model.", SEE], r.stdout
    assert left_behind(tmp_path / "k") == []
    r = run([snakemake], tmp_path / "all", "-n", "--config",
            "overlap={inputs: 8, K: 256, segments: [64, 32], segment_dtypes: [float32, float16], gemm_n: 128}")
    assert r.returncode == 0 and "This was a dry-run" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# --- a machine without Triton (macOS): its paths refused, the torch path runs -----------------------------------

def test_triton_paths_are_refused_where_triton_is_not_installed_and_the_torch_path_is_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec answers None, as on a Mac
    cfg = copy.deepcopy(TINY)
    validate_campaign(cfg, SCHEMA)  # the default campaign takes the torch path: nothing refused
    cfg = copy.deepcopy(TINY)
    cfg["parity"]["kernels"], cfg["bench"]["kernels"] = ["torch", "triton"], "graph"
    lines = rejected(cfg).splitlines()
    assert [line.split("`")[1] for line in lines[:-1]] == ["parity.kernels", "bench.kernels"], lines
    assert all("Triton is not installed here" in line and "use the torch path" in line for line in lines[:-1])
    monkeypatch.delitem(sys.modules, "triton")
    cfg = copy.deepcopy(TINY)
    cfg["parity"]["kernels"], cfg["bench"]["kernels"] = ["torch", "triton"], "graph"
    validate_campaign(cfg, SCHEMA)  # with Triton, the same campaign passes this check
