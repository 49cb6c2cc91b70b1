"""Bad input: each a clear error before work starts, naming what is wrong, and nothing written as complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tinyev
import torch
import yaml
from campaigns import overridden, rejected

from evident.workflow.cli import configfiles
from evident.workflow.models import checkpoints
from evident.workflow.plan.campaign import CampaignFileError, read_campaign_file, validate_campaign

REPO = Path(__file__).resolve().parents[2]
SCHEMA = str(REPO / "config/schema.yaml")
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def tiny(**overrides) -> dict:
    return overridden(TINY, **overrides)


def test_the_default_campaign_is_valid():
    validate_campaign(tiny(), SCHEMA)


@pytest.mark.parametrize("key,value,where,why", [
    ("colour", "blue", "<top level>", "'colour' was unexpected"),
    ("parity.batch_szes", [1], "parity", "'batch_szes' was unexpected; did you mean 'batch_sizes'?"),
    ("checkpoint.confg", {}, "checkpoint", "'confg' was unexpected; did you mean 'config'?"),
    ("checkpoint.base", "tny", "checkpoint.base", "no shipped model 'tny'; did you mean 'tiny'?"),
    ("checkpoint.config.hidden_size", "64", "checkpoint.config.hidden_size", "'64' is not of type 'integer'"),
    ("checkpoint.config.num_experts_per_tok", 9, "checkpoint.config", "num_experts_per_tok=9 must be <= n_routed_experts=8"),
    ("bench.new_tokens", "16", "bench.new_tokens", "'16' is not of type 'integer'"),
    ("checkpoint.config.num_hiden_layers", 2, "checkpoint.config",
     "unknown DeepSeek config field 'num_hiden_layers'; did you mean 'num_hidden_layers' or 'num_mtp_layers'?"),
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
    ("cases.0.prompt", "many words " * 200, "cases.0.prompt",
     "the prompt is 1802 tokens and 24 new tokens are asked: more than the model's context of 256 tokens"),
    ("bench.new_tokens", 250, "bench.prompt", "and 250 new tokens are asked: more than the model's context of 256"),
    ("bench.prompts", ["one", "two"], "bench.prompts", "2 prompts for batch sizes up to 8: row r of a batch gets "
     "prompts[r] (never cycled, which would repeat rows); give at least 8 different prompts"),
    ("bench.prompts", ["same"] * 8, "bench.prompts", "has non-unique elements"),
    ("bench.prompts", [f"p{i}" for i in range(9)], "bench.prompts", "is too long"),
    ("bench.prompts", [f"p{i}" for i in range(7)] + [" \n"], "bench.prompts.7", "the prompt is blank"),
    ("bench.prompts", [f"p{i}" for i in range(7)] + ["many words " * 200], "bench.prompts.7",
     "the prompt is 1802 tokens and 16 new tokens are asked: more than the model's context of 256 tokens"),
    ("quality.gsm8k.limit", 65, "quality.gsm8k.limit", "65 rows asked, the test data has 64"),
    ("quality.gsm8k.shots", 9, "quality.gsm8k.shots", "9 shots asked, the train data has 8"),
    ("quality.gsm8k.shots", 5, "quality.gsm8k.shots", "5 shots) + max_tokens 24 exceed"),
    ("quality.gsm8k.max_tokens", 256, "quality.gsm8k.max_tokens", "256 tokens do not fit the model's context of 256"),
    ("quality.reference", "engine2", "quality.reference", "'engine2' is not one of quality.targets ['hf', 'engine']"),
    ("parallel.ep_size", 3, "parallel.ep_size", "3 ranks do not divide the model's 8 routed experts"),
])
def test_bad_config_names_the_key(key, value, where, why):
    msg = rejected(tiny(**{key: value}))
    assert f"at `{where}`" in msg and why in msg, msg


def test_every_error_at_once():
    """A typo, a missing `cases` and a bad value: all three, each naming its key, not the first alone."""
    cfg = tiny(**{"bench.new_tokns": 4, "device": "gpu"})
    del cfg["cases"]
    msg = rejected(cfg)
    assert msg.splitlines() == [
        "invalid campaign config at `device`: 'gpu' is not one of ['auto', 'cpu', 'cuda'].",
        "invalid campaign config at `bench`: 'new_tokns' was unexpected; did you mean 'new_tokens'?",
        "invalid campaign config at `<top level>`: 'cases' is a required property: the oracle and parity stages "
        "follow the cases' prompts (a campaign whose `stages` leave both out needs none).",
        "3 errors. See config/schema.yaml and docs/campaigns.md."], msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_stops_before_work(monkeypatch):
    monkeypatch.delenv("EVIDENT_SKIP_DEVICE_CHECK", raising=False)
    msg = rejected(tiny(device="cuda"))
    assert "at `device`" in msg and "no CUDA GPU is visible" in msg


# --- checkpoints: missing, truncated, not the recorded one, prompts beyond the context ----------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tinyev.synthetic()
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
    """Before any work where the tokenizer exists then (above: a synthetic one is built from its config); a hub
    checkpoint's comes with the download, and the checkpoint record counts its prompts."""
    cfg = tiny(**{"cases.0.prompt": "many words " * 200})
    with pytest.raises(checkpoints.CheckpointInvalid, match=r"cases.0 \(addition\): the prompt is \d+ tokens and 24 new"
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
def test_prompt_beyond_the_context_stops_before_any_work(tmp_path):
    """A synthetic checkpoint's tokenizer is built from its config before any work: no evidence directory, no
    checkpoint written. (A hub checkpoint's prompts are counted by the checkpoint record: test above.)"""
    cfg = {"campaign": "long", "device": "cpu", "checkpoint": tinyev.synthetic(),
           "cases": [{"name": "long", "prompt": "many words " * 200, "max_new_tokens": 4}],
           "parity": {"batch_sizes": [1], "backends": ["single"]},
           "bench": {"backends": ["single"], "batch_sizes": [1], "new_tokens": 4, "repeats": 1, "warmup": 0},
           "overlap": {"inputs": 4}, "tracking": {"enabled": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    wd = tmp_path / "wd"
    r = subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-c2", "record_checkpoint",
                        "--configfile", str(tmp_path / "c.yaml")], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert ("invalid campaign config at `cases.0.prompt`: the prompt is 1802 tokens and 4 new tokens are asked: more "
            "than the model's context of 256 tokens") in out, out[-3000:]
    assert not (wd / "evidence").exists() and not (wd / ".evident").exists()
