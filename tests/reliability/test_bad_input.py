"""Bad input: each a clear error before work starts, naming what is wrong, and nothing written as complete."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from snakemake.exceptions import WorkflowError

from workflow import checkpoints
from workflow.campaign import CampaignFileError, read_campaign_file, validate_campaign
from workflow.cli import configfiles
from workflow.evidence import MANIFEST

REPO = Path(__file__).resolve().parents[2]
SCHEMA = str(REPO / "config/schema.yaml")
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def tiny(**overrides) -> dict:
    cfg = copy.deepcopy(TINY)
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return cfg


def rejected(cfg: dict) -> str:
    with pytest.raises(WorkflowError) as e:
        validate_campaign(cfg, SCHEMA)
    return str(e.value)


def test_the_default_campaign_is_valid():
    validate_campaign(tiny(), SCHEMA)


@pytest.mark.parametrize("key,value,where,why", [
    ("colour", "blue", "<top level>", "'colour' was unexpected"),
    ("parity.batch_szes", [1], "parity", "'batch_szes' was unexpected"),
    ("bench.new_tokens", "16", "bench.new_tokens", "'16' is not of type 'integer'"),
    ("checkpoint.config.num_hiden_layers", 2, "checkpoint.config", "'num_hiden_layers'"),
    ("campaign", "a/b", "campaign", "does not match"),
    ("campaign", "..", "campaign", "does not match"),
    ("campaign", "../escape", "campaign", "does not match"),
    ("campaign", "my campaign", "campaign", "does not match"),
    ("campaign", "", "campaign", "does not match"),
    ("parity.batch_sizes", [0, 1], "parity.batch_sizes.0", "less than the minimum of 1"),
    ("parity.batch_sizes", [1, 9], "parity.batch_sizes.1", "greater than the maximum of 8"),
    ("bench.batch_sizes", [], "bench.batch_sizes", "should be non-empty"),
    ("cases.0.prompt", "", "cases.0.prompt", "should be non-empty"),
    ("cases.0.prompt", "  \n\t", "cases.0.prompt", "the prompt is blank"),
    ("cases.0.prompt", "caf\udce9", "cases.0.prompt", "not valid UTF-8"),
    ("cases.0.max_new_tokens", 256, "cases.0.max_new_tokens", "do not fit the model's context of 256"),
    ("cases.0.max_new_tokens", 0, "cases.0.max_new_tokens", "less than the minimum of 1"),
])
def test_bad_config_names_the_key(key, value, where, why):
    msg = rejected(tiny(**{key: value}))
    assert f"at `{where}`" in msg and why in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_stops_before_work(monkeypatch):
    monkeypatch.delenv("EVIDENT_SKIP_DEVICE_CHECK", raising=False)
    msg = rejected(tiny(device="cuda"))
    assert "at `device`" in msg and "no CUDA GPU is visible" in msg


# --- checkpoints: missing, truncated, not the recorded one, prompts beyond the context ----------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = TINY["checkpoint"]
    return checkpoints.write_synthetic(tmp_path_factory.mktemp("ckpt") / "c", cfg["config"], 0, cfg["init_std"], "float32")


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ckpt, tmp_path / "c"))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(checkpoints.CheckpointInvalid, match="does not exist"):
        checkpoints.describe(tmp_path / "nowhere")


def test_missing_and_truncated_weights(ckpt, tmp_path):
    c = copy_of(ckpt, tmp_path)
    w = c / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(checkpoints.CheckpointInvalid, match="model.safetensors is corrupt or truncated"):
        checkpoints.describe(c)
    w.unlink()
    with pytest.raises(checkpoints.CheckpointInvalid, match=r"no \*.safetensors file"):
        checkpoints.describe(c)


def test_weights_that_differ_from_checkpoint_json(ckpt, tmp_path):
    record = {"files": checkpoints.describe(ckpt)}
    c = copy_of(ckpt, tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(c / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1  # still a valid safetensors file, with other weights
    save_file(tensors, c / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(checkpoints.CheckpointInvalid, match=r"model.safetensors has sha256 [0-9a-f]{64}, expected"):
        checkpoints.verify(c, record)


def test_prompt_longer_than_the_context(ckpt):
    cfg = tiny(**{"cases.0.prompt": "many words " * 200})
    validate_campaign(cfg, SCHEMA)  # a prompt's tokens need the tokenizer: the checkpoint record counts them
    with pytest.raises(checkpoints.CheckpointInvalid, match=r"cases.0 \(greeting\): the prompt is \d+ tokens and 24 new"
                                                           r" tokens are asked: more than the model's context of 256"):
        checkpoints.check_prompts(ckpt, cfg)
    ok = tiny()
    validate_campaign(ok, SCHEMA)
    checkpoints.check_prompts(ckpt, ok)


@pytest.mark.parametrize("content, message", [
    (b"campaign: t\ncases: [{name: a, prompt: \"caf\xe9\"}]\n", "is not UTF-8 text: byte 0xe9 at line 2, column 31; save it as UTF-8"),
    (b"campaign: t\ncases: [1\n", "is not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, column 1"),
    (b"- campaign\n", "must hold a mapping of keys (campaign:, cases:, ...), not list"),
    (b"", "must hold a mapping of keys (campaign:, cases:, ...), not NoneType"),
])
def test_campaign_file_that_cannot_be_read(tmp_path, content, message):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(CampaignFileError) as e:
        read_campaign_file(str(f))
    assert str(e.value) == f"campaign file {f} {message}"
    with pytest.raises(CampaignFileError, match="campaign file .*absent.yaml: No such file or directory"):
        read_campaign_file(str(tmp_path / "absent.yaml"))
    f.write_text(yaml.safe_dump(TINY))
    assert read_campaign_file(str(f)) == TINY


def test_run_finds_every_campaign_file_on_snakemake_s_command_line():
    argv = ["-c2", "--configfile", "a.yaml", "b.yaml", "-n", "--configfile=c.yaml", "--configfiles", "d.yaml",
            "--config", "repeat=2", "target"]
    assert configfiles(argv) == ["a.yaml", "b.yaml", "c.yaml", "d.yaml"]
    assert configfiles(["-c2", "all"]) == []


# --- through Snakemake: a campaign file that is not UTF-8, a bad name; nothing written --------------

@pytest.mark.slow
def test_campaign_files_that_snakemake_refuses(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"campaign: t\ncases: [{name: a, prompt: \"caf\xe9 \xff\"}]\n")
    wd = tmp_path / "wd"
    r = subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-n", "--configfile", str(bad)],
                       capture_output=True, text=True, timeout=300)
    # Snakemake reads --configfile itself, before the Snakefile: its own traceback, the undecodable byte named
    assert r.returncode != 0 and "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9" in r.stdout + r.stderr
    assert not (wd / "evidence").exists()
    # `evident run` (what `make run` calls) reads the file first: one line, the place, the fix; no snakemake
    r = subprocess.run([str(SNAKEMAKE.with_name("evident")), "run", "-s", str(REPO / "Snakefile"), "-d", str(wd),
                        "-n", "--configfile", str(bad)], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"evident: campaign file {bad} is not UTF-8 text: byte 0xe9 at line 2, column 31; save it as UTF-8\n"
    assert not (wd / "evidence").exists()
    bad.write_text(yaml.safe_dump(tiny(campaign="my campaign")))
    r = subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-n", "--configfile", str(bad)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "invalid campaign config at `campaign`: 'my campaign' does not match" in r.stdout + r.stderr
    assert not (wd / "evidence").exists()


@pytest.mark.slow
def test_prompt_beyond_the_context_fails_at_the_checkpoint_record(tmp_path):
    """The first stage that has the tokenizer stops the run: no oracle or engine work, no manifest."""
    cfg = {"campaign": "long", "device": "cpu", "checkpoint": copy.deepcopy(TINY["checkpoint"]),
           "cases": [{"name": "long", "prompt": "many words " * 200, "max_new_tokens": 4}],
           "parity": {"batch_sizes": [1], "backends": ["single"]},
           "bench": {"backends": ["single"], "batch_sizes": [1], "new_tokens": 4, "repeats": 1, "warmup": 0},
           "overlap": {"inputs": 4}, "tracking": {"enabled": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-c2", "record_checkpoint",
                        "--configfile", str(tmp_path / "c.yaml")], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "more than the model's context of 256 tokens" in out, out[-3000:]
    ev = next((tmp_path / "evidence/long").iterdir())
    assert not (ev / MANIFEST).exists() and not (ev / "checkpoint.json").exists() and not (ev / "oracle").exists()
    assert json.loads((ev / "stages/checkpoint.json").read_text())["status"] == "failed"
