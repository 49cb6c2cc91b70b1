"""The campaign check before any work: a named base model plus overrides, complete model configs, the size
estimate against this machine, quality defaults fitted to the data and the context, bench.baseline, every error
at once; and, through Snakemake, that a refused campaign writes nothing while a minimal one runs to a seal."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import handbuilt
import pytest
import yaml
from snakemake.exceptions import WorkflowError
from test_summary import gate_rows

from evident.workflow.core.evidence import config_hash, sha256_bytes
from evident.workflow.core.layout import DETAILS, MANIFEST, SUMMARY
from evident.workflow.models import checkpoints
from evident.workflow.plan import estimate, runs
from evident.workflow.plan.campaign import evidence_config, models, required_fields, validate_campaign

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "config/schema.yaml")
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
LITE = yaml.safe_load((REPO / "config/campaigns/dsv2-lite-graph.yaml").read_text())["checkpoint"]["config"]
CASES = [{"name": "hello", "prompt": "Hello, evident!"}]


def minimal(**checkpoint) -> dict:
    """What a new user writes: a name, a model, one case."""
    return {"campaign": "mini", "checkpoint": checkpoint or {"base": "tiny"}, "cases": copy.deepcopy(CASES)}


def valid(cfg: dict) -> dict:
    validate_campaign(cfg, SCHEMA)
    return cfg


def rejected(cfg: dict) -> str:
    with pytest.raises(WorkflowError) as e:
        validate_campaign(cfg, SCHEMA)
    return str(e.value)


@pytest.fixture(autouse=True)
def _here(monkeypatch, tmp_path):
    """Each check runs in an empty working directory (bench.baseline and the checkpoint cache are relative to it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(estimate.ALLOW, raising=False)


# --- checkpoint.base and complete configs ---------------------------------------------------------

def test_shipped_models_are_the_campaigns_models():
    assert models() == ["deepseek-v2-lite", "deepseek-v4-flash", "deepseek-v4-tiny", "moonlight-16b-a3b", "tiny",
                        "tiny-mla576"]
    assert yaml.safe_load((REPO / "config/models/tiny.yaml").read_text()) == TINY["checkpoint"]["config"]
    assert yaml.safe_load((REPO / "config/models/deepseek-v2-lite.yaml").read_text()) == LITE
    # the DeepSeek-V3 architecture at Moonlight-16B-A3B's published shape: 16 B parameters
    moonlight = yaml.safe_load((REPO / "config/models/moonlight-16b-a3b.yaml").read_text())
    assert moonlight["model_type"] == "deepseek_v3" and round(estimate.parameters(moonlight) / 1e9, 2) == 15.96


def test_a_base_and_the_config_written_out_are_the_same_campaign():
    """The merged config is written back and base dropped: same recorded config, evidence id and checkpoint cache."""
    full = copy.deepcopy(TINY)
    based = copy.deepcopy(TINY)
    based["checkpoint"] = {"base": "tiny", **{k: v for k, v in TINY["checkpoint"].items() if k != "config"}}
    valid(full), valid(based)
    assert "base" not in based["checkpoint"] and based["checkpoint"]["config"] == TINY["checkpoint"]["config"]
    assert config_hash(evidence_config(based)) == config_hash(evidence_config(full))
    assert estimate.cache_dir(based) == estimate.cache_dir(full)


def test_base_fields_are_overridden_by_checkpoint_config():
    cfg = valid(minimal(base="tiny", config={"num_hidden_layers": 2, "max_position_embeddings": 512}))
    model = cfg["checkpoint"]["config"]
    assert model == {**TINY["checkpoint"]["config"], "num_hidden_layers": 2, "max_position_embeddings": 512}
    assert cfg["quality"]["gsm8k"]["max_tokens"] == 128  # a quarter of the new context


def test_a_partial_config_without_a_base_is_refused_naming_what_is_missing():
    """The issue's campaign: two MoE fields alone, transformers' defaults for the rest (5.41 B parameters)."""
    msg = rejected(minimal(config={"n_routed_experts": 4, "num_experts_per_tok": 2}))
    missing = [f for f in required_fields() if f not in ("n_routed_experts", "num_experts_per_tok")]
    assert msg.splitlines()[0] == (
        f"invalid campaign config at `checkpoint.config`: missing field(s) {', '.join(missing)}: transformers would "
        "take its defaults for them (here: 5.41 B parameters); give every field, or set checkpoint.base "
        f"({', '.join(models())}) and keep checkpoint.config for the fields that differ."), msg
    assert "hidden_size" in missing and "rope_scaling" not in required_fields()  # absent: plain RoPE
    assert f"no model: set checkpoint.base ({', '.join(models())}) or give checkpoint.config in full" in rejected(
        {"campaign": "mini", "cases": CASES})


def test_base_is_for_synthetic_checkpoints_only():
    msg = rejected(minimal(source="hub", base="tiny", repo_id="a/b", revision="0" * 40))
    assert "at `checkpoint.base`: only for source synthetic or trained: a hub checkpoint brings its own config.json" in msg
    msg = rejected(minimal(source="local", path="ckpt", config={"hidden_size": 64}))
    assert "at `checkpoint.config`: only for source synthetic or trained: a local checkpoint brings its own config.json" in msg


def test_a_misspelt_model_field_gets_the_closest_names():
    msg = rejected(minimal(base="tiny", config={"n_routed_expert": 4, "qk_rope_dim": 8}))
    assert ("at `checkpoint.config`: unknown DeepSeek config field 'n_routed_expert'; did you mean "
            "'n_routed_experts'") in msg, msg
    assert "unknown DeepSeek config field 'qk_rope_dim'; did you mean 'qk_rope_head_dim' or" in msg, msg
    assert "2 errors." in msg


# --- the size estimate ----------------------------------------------------------------------------

@pytest.mark.parametrize("over", [{}, {"q_lora_rank": 16}, {"tie_word_embeddings": True},
                                  {"attention_bias": True, "mlp_bias": True}, {"first_k_dense_replace": 5},
                                  {"n_shared_experts": 0}])
def test_the_parameter_count_is_the_model_transformers_builds(over):
    cfg = {**TINY["checkpoint"]["config"], **over}
    assert estimate.parameters(cfg) == sum(math.prod(s) for s in checkpoints.parameter_shapes(cfg).values())


def test_the_parameter_count_of_deepseek_v2_lite_and_of_the_issue_s_partial_config():
    for cfg in (LITE, {"n_routed_experts": 4, "num_experts_per_tok": 2}):
        assert estimate.parameters(cfg) == sum(math.prod(s) for s in checkpoints.parameter_shapes(cfg).values())
    assert estimate.parameters(LITE) == 15_706_484_224


def test_the_estimate_s_formula():
    p = 15_706_484_224
    n = estimate.need(p, "bfloat16")
    assert (n.weights, n.disk, n.write, n.peak) == (2 * p, 2 * p, 2 * checkpoints.MAX_SHARD_BYTES, 4 * p)
    assert n.line() == ("15.71 B parameters; weights 31.4 GB (bfloat16); checkpoint 31.4 GB on disk; peak memory "
                        "62.8 GB (the float32 copy of the oracle and parity stages)")
    small = estimate.need(252_960, "float32")
    assert small.peak == small.write == 2 * 4 * 252_960  # the writer's shard and its serialised copy


def test_a_checkpoint_s_headers_give_its_parameters(tmp_path):
    spec = TINY["checkpoint"]
    ckpt = checkpoints.write_synthetic(tmp_path / "c", spec["config"], 0, 0.02, "bfloat16")
    assert estimate.local_parameters(ckpt) == estimate.parameters(spec["config"])
    assert estimate.local_parameters(tmp_path / "nowhere") is None


def test_a_model_beyond_host_memory_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(estimate, "host_memory", lambda: 10 * 10**9)
    monkeypatch.setattr(estimate, "free_disk", lambda path: 10**15)
    cfg = minimal(base="deepseek-v2-lite")
    cfg["device"] = "cpu"
    msg = rejected(copy.deepcopy(cfg))
    assert msg.splitlines()[0] == (
        "invalid campaign config at `checkpoint`: the model does not fit this machine: peak memory (62.8 GB) exceeds "
        "host memory (10.0 GB). Estimate: 15.71 B parameters; weights 62.8 GB (float32); checkpoint 62.8 GB on disk; "
        "peak memory 62.8 GB (the float32 copy of the oracle and parity stages). Make it smaller (e.g. "
        "checkpoint.base: tiny), or set EVIDENT_ALLOW_LARGE=1 to run it anyway."), msg
    monkeypatch.setenv(estimate.ALLOW, "1")
    valid(cfg)


def test_on_cuda_the_float32_copy_must_fit_the_gpu_and_the_write_the_host(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(estimate, "gpu_memory", lambda: 40 * 10**9)
    monkeypatch.setattr(estimate, "host_memory", lambda: 5 * 10**9)
    monkeypatch.setattr(estimate, "free_disk", lambda path: 10**15)
    monkeypatch.delenv("EVIDENT_SKIP_DEVICE_CHECK", raising=False)
    cfg = {**minimal(base="deepseek-v2-lite"), "device": "cuda", "dtype": "bfloat16"}
    msg = rejected(cfg)
    assert ("the model does not fit this machine: the float32 copy (62.8 GB) exceeds GPU memory (40.0 GB); "
            "the synthetic write (8.6 GB) exceeds host memory (5.0 GB).") in msg, msg


def test_on_cuda_training_state_must_fit_the_gpu(monkeypatch):
    """A trained checkpoint holds float32 weights, gradients and AdamW's two moments on the GPU: 16 B a parameter,
    four times the float32 copy that alone would fit."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(estimate, "host_memory", lambda: 10**12)
    monkeypatch.setattr(estimate, "free_disk", lambda path: 10**15)
    monkeypatch.delenv("EVIDENT_SKIP_DEVICE_CHECK", raising=False)
    cfg = {**minimal(source="trained", base="deepseek-v2-lite", config={"num_hidden_layers": 4}), "device": "cuda",
           "dtype": "bfloat16"}
    monkeypatch.setattr(estimate, "gpu_memory", lambda: 32 * 10**9)
    msg = rejected(copy.deepcopy(cfg))
    assert ("the model does not fit this machine: training (36.1 GB: float32 weights, gradients and AdamW's moments) "
            "exceeds GPU memory (32.0 GB)") in msg and "peak memory 36.1 GB (training" in msg, msg
    monkeypatch.setattr(estimate, "gpu_memory", lambda: 141 * 10**9)
    valid(cfg)


def test_the_disk_under_the_checkpoint_cache_must_hold_a_new_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setattr(estimate, "free_disk", lambda path: 2 * 10**8)
    cfg = {**minimal(base="tiny", config={"hidden_size": 1024, "vocab_size": 65536}), "device": "cpu"}
    msg = rejected(copy.deepcopy(cfg))
    assert "the checkpoint (0.5 GB) exceeds the free disk under .evident/checkpoints/ (0.2 GB)" in msg, msg
    assert not (tmp_path / ".evident").exists()
    resolved = copy.deepcopy(cfg)
    monkeypatch.setenv(estimate.ALLOW, "1")
    valid(resolved)
    (tmp_path / estimate.cache_dir(resolved)).mkdir(parents=True)  # cached already: nothing to write
    monkeypatch.delenv(estimate.ALLOW)
    valid(cfg)


# --- quality defaults: fitted to the data and the context; explicit values checked -----------------

def test_quality_defaults_fit_the_embedded_data_and_the_tiny_context():
    g = valid(minimal())["quality"]["gsm8k"]
    assert (g["limit"], g["shots"], g["max_tokens"]) == (8, 1, 64)
    tok, _, _ = checkpoints.build_tokenizer(512, 0, 1)
    from evident.workflow.parity import gsm8k

    rows = {s: gsm8k.load_split(g, s)[0] for s in ("test", "train")}
    longest = max(len(tok.encode(it["prompt"]).ids) for it in gsm8k.build_prompts(rows["test"], rows["train"], 8, 1))
    assert longest + 64 <= 256 < max(len(tok.encode(it["prompt"]).ids)
                                     for it in gsm8k.build_prompts(rows["test"], rows["train"], 8, 2)) + 64


def test_quality_defaults_on_a_long_context_are_the_harness_s(monkeypatch):
    monkeypatch.setenv(estimate.ALLOW, "1")
    g = valid({**minimal(base="deepseek-v2-lite"), "device": "cpu"})["quality"]["gsm8k"]
    assert (g["limit"], g["shots"], g["max_tokens"]) == (8, 5, 256)


def test_explicit_quality_values_are_kept():
    g = valid(copy.deepcopy(TINY))["quality"]["gsm8k"]
    assert (g["limit"], g["shots"], g["max_tokens"]) == (64, 2, 24)


def _local_data(tmp_path: Path, n: int) -> dict:
    f = tmp_path / "test.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(n)))
    return {"source": "local", "test": str(f), "test_sha256": sha256_bytes(f.read_bytes()),
            "train": str(f), "train_sha256": sha256_bytes(f.read_bytes())}


def test_local_data_rows_are_counted_before_any_work(tmp_path):
    g = valid({**minimal(), "quality": {"gsm8k": _local_data(tmp_path, 3)}})["quality"]["gsm8k"]
    assert (g["limit"], g["shots"]) == (3, 3)
    msg = rejected({**minimal(), "quality": {"gsm8k": {**_local_data(tmp_path, 3), "limit": 5}}})
    assert "at `quality.gsm8k.limit`: 5 rows asked, the test data has 3; leave limit unset (null) for all its rows" in msg
    msg = rejected({**minimal(), "quality": {"gsm8k": {"source": "local", "test": "absent.jsonl"}}})
    assert "at `quality.gsm8k.test`: absent.jsonl not found; set quality.gsm8k.test to a GSM8K JSONL file" in msg


def test_hub_data_takes_the_harness_defaults_without_a_download():
    g = valid({**minimal(), "quality": {"gsm8k": {"source": "hub"}}})["quality"]["gsm8k"]
    assert (g["limit"], g["shots"], g["max_tokens"]) == (64, 5, 64)


def test_a_context_too_short_for_any_prompt_is_refused():
    msg = rejected(minimal(base="tiny", config={"max_position_embeddings": 64}))
    assert ("at `quality.gsm8k.max_tokens`: the longest prompt (63 tokens, 0 shots) + max_tokens 16 exceed the "
            "model's context of 64 tokens") in msg, msg


# --- other checks -----------------------------------------------------------------------------------

def test_quality_targets_and_overlap_shapes():
    msg = rejected({**minimal(), "quality": {"targets": ["hf", "hf"]},
                    "overlap": {"K": 64, "segments": [8, 8], "gemm_n": 8}})
    assert "at `quality.targets`: a target name appears twice: ['hf', 'hf']" in msg
    assert "at `overlap.segment_dtypes`: needs one dtype per overlap.segments entry" in msg


def test_a_baseline_that_does_not_exist_is_refused_naming_the_key(tmp_path):
    msg = rejected({**minimal(), "bench": {"baseline": "7c0"}})
    assert msg.splitlines()[0] == ("invalid campaign config at `bench.baseline`: no evidence directory matches '7c0': "
                                   "campaign mini has none under evidence/mini/ here yet (a path names another "
                                   "campaign's)."), msg
    handbuilt.build(tmp_path / "evidence", "mini", "7c0aaaa-c11111111-r1", plot=False)
    handbuilt.build(tmp_path / "evidence", "mini", "8d0aaaa-c11111111-r1", plot=False, seal=False)
    assert "no evidence directory matches '9'" in rejected({**minimal(), "bench": {"baseline": "9"}})
    assert "is not sealed" in rejected({**minimal(), "bench": {"baseline": "8d0"}})
    valid({**minimal(), "bench": {"baseline": "7c0"}})
    valid({**minimal(), "bench": {"baseline": str(tmp_path / "evidence/mini/7c0aaaa-c11111111-r1")}})
    assert "at `bench.baseline`: no evidence directory matches" in rejected(
        {**minimal(), "bench": {"baseline": "evidence/other/7c0"}})


def test_stages_bring_what_they_need_in_the_pipeline_s_order():
    assert valid({**minimal(), "stages": ["quality", "parity"]})["stages"] == ["oracle", "parity", "quality"]
    # default: every stage but the soak, which keeps a server busy for a minute and runs only where named
    assert valid(minimal())["stages"] == [s for s in runs.STAGES if s != "soak"]
    msg = rejected({**minimal(), "stages": ["qualty"]})
    assert "invalid campaign config at `stages.0`: 'qualty' is not one of" in msg
    assert "at `stages`: [] should be non-empty" in rejected({**minimal(), "stages": []})
    no_cases = {"campaign": "mini", "checkpoint": {"base": "tiny"}}
    assert "at `<top level>`: 'cases' is a required property: the oracle and parity stages" in rejected(
        {**no_cases, "stages": ["parity"]})
    assert "cases" not in valid({**no_cases, "stages": ["quality", "bench"]})


def test_the_old_key_nsight_is_read_as_profile_with_a_warning(capsys):
    cfg = valid({**minimal(), "nsight": {"steps": 2}})
    assert cfg["profile"]["steps"] == 2 and "nsight" not in cfg
    assert "campaign key `nsight` is now `profile`" in capsys.readouterr().err
    assert "at `nsight`: is the old name of `profile`, which is given too" in rejected(
        {**minimal(), "nsight": {"steps": 2}, "profile": {"steps": 3}})


def test_deepseek_v3_and_group_limited_routing_are_checked_before_any_work():
    v3 = {"model_type": "deepseek_v3", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1}
    assert valid({**minimal(base="tiny", config=v3)})["checkpoint"]["config"]["model_type"] == "deepseek_v3"
    # rope on the halves too, on every decode path (the graph path permutes it into interleaved pairs)
    halves = {**v3, "rope_interleave": False}
    assert valid({**minimal(base="tiny", config=halves), "parity": {"kernels": ["torch", "graph"]}})[
        "checkpoint"]["config"]["rope_interleave"] is False
    assert "at `checkpoint.config`: group_limited_greedy: n_group=3 must divide n_routed_experts=8" in rejected(
        minimal(base="tiny", config={"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}))
    assert "at `checkpoint.config.model_type`: 'llama' is not one of" in rejected(
        minimal(base="tiny", config={"model_type": "llama"}))


def test_overlap_shapes_are_stated_together():
    assert "at `overlap`: states K but not all of K, segments and gemm_n" in rejected(
        {**minimal(), "overlap": {"K": 4096}})
    # `gate` would name the quality gate's own file (workflow/parity/gsm8k.py RESULT, GATE): the schema refuses it
    assert "at `quality.targets.1`" in rejected(
        {**minimal(), "quality": {"targets": ["hf", {"name": "gate", "url": "http://127.0.0.1:1"}]}})


# --- through Snakemake: nothing written on a refusal; the minimal campaign runs to a seal ------------

def snakemake(wd: Path, cfg: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    wd.mkdir(parents=True, exist_ok=True)
    (wd.parent / f"{wd.name}.yaml").write_text(yaml.safe_dump(cfg))
    e = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", estimate.ALLOW)}
    return subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(wd), "-c2", *args,
                           "--configfile", str(wd.parent / f"{wd.name}.yaml")],
                          capture_output=True, text=True, timeout=900, env={**e, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("cfg, message", [
    ({"campaign": "mini", "checkpoint": {"config": {"n_routed_experts": 4, "num_experts_per_tok": 2}}, "cases": CASES},
     "invalid campaign config at `checkpoint.config`: missing field(s) bos_token_id, eos_token_id"),
    ({"campaign": "mini", "checkpoint": {"base": "deepseek-v2-lite", "config": {"num_hidden_layers": 5000}},
      "cases": CASES}, "invalid campaign config at `checkpoint`: the model does not fit this machine"),
    ({"campaign": "mini", "checkpont": {"base": "tiny"}},
     "invalid campaign config at `<top level>`: 'checkpont' was unexpected; did you mean 'checkpoint'?\n"
     "invalid campaign config at `<top level>`: 'cases' is a required property: the oracle and parity stages "
     "follow the cases' prompts (a campaign whose `stages` leave both out needs none).\n2 errors."),
    ({**minimal(), "quality": {"gsm8k": {"limit": 64}}},
     "invalid campaign config at `quality.gsm8k.limit`: 64 rows asked, the embedded test data has 8"),
    ({**minimal(), "bench": {"baseline": "7c0"}},
     "invalid campaign config at `bench.baseline`: no evidence directory matches '7c0'"),
], ids=["partial-model", "too-large", "typo-and-missing", "limit", "baseline"])
def test_a_refused_campaign_writes_nothing(tmp_path, cfg, message):
    wd = tmp_path / "wd"
    r = snakemake(wd, cfg)
    assert r.returncode != 0 and message in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in wd.iterdir()) in ([], [".snakemake"]), list(wd.iterdir())
    assert not (wd / "evidence").exists() and not (wd / ".evident").exists()


@pytest.mark.slow
def test_a_minimal_campaign_runs_to_a_sealed_directory(tmp_path):
    """`campaign`, `checkpoint` and `cases` alone: every other key's default fits the tiny model and the embedded
    data, and the checkpoint stage prints its estimate before writing. On random weights the quality gate makes no
    claim, and without `quality.advisory` that fails the run, after sealing."""
    wd = tmp_path / "wd"
    r = snakemake(wd, minimal())
    assert r.returncode != 0 and "the GSM8K quality gate says no_claim" in r.stdout + r.stderr, r.stderr[-3000:]
    ev = next((wd / "evidence/mini").iterdir())
    assert (ev / MANIFEST).is_file() and json.loads((ev / MANIFEST).read_text())["quality"] == "no_claim"
    recorded = yaml.safe_load((ev / "config.yaml").read_text())
    assert "base" not in recorded["checkpoint"] and recorded["checkpoint"]["config"] == TINY["checkpoint"]["config"]
    g = recorded["quality"]["gsm8k"]
    assert (g["limit"], g["shots"], g["max_tokens"]) == (8, 1, 64)
    log = next((wd / ".evident/checkpoints").glob("*.log")).read_text()
    assert log.startswith("[checkpoint] estimate: 252,960 parameters; weights 1.0 MB"), log
    assert "[checkpoint] wrote model.safetensors: 1.0 MB of 1.0 MB (100%)" in log


@pytest.mark.slow
def test_a_campaign_runs_only_its_stages(tmp_path):
    """`stages: [quality]`: no oracle, parity, bench, overlap, audit or profile job; the gates of the stages not run
    are recorded as not run (never as passed), and SUMMARY.md names those stages."""
    wd = tmp_path / "wd"
    cfg = {"campaign": "mini", "checkpoint": {"base": "tiny"}, "stages": ["quality"],  # no cases: no oracle to follow
           "quality": {"targets": ["hf"], "advisory": True, "gsm8k": {"limit": 2, "max_tokens": 8}}}
    r = snakemake(wd, cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ev = next((wd / "evidence/mini").iterdir())
    manifest = json.loads((ev / MANIFEST).read_text())
    assert set(manifest["stages"]) == {"context", "checkpoint", "quality"}
    assert manifest["gates"] == {"quality": "no_claim"} and manifest["verdict"] is None
    assert not any((ev / d).exists() for d in ("oracle", "parity", "bench", "overlap", "kernels", "profile"))
    gate = json.loads(next((wd / ".evident/gates/mini").iterdir()).read_text())
    assert gate["verdicts"] == {"parity": None, "overlap": None, "audit": None, "quality": "no_claim", "soak": None}
    assert gate["not_run"] == ["parity", "overlap", "audit", "soak"] and gate["advisory"] == ["quality"]
    summary = (ev / SUMMARY).read_text()
    assert ("Stages not run (the campaign's `stages:`): oracle, parity, bench, serve_bench, soak, overlap, "
            "kernel_audit, profile.") in summary
    rows = gate_rows(summary)
    assert {g: r[:2] for g, r in rows.items() if g != "quality"} == dict.fromkeys(
        ("parity", "overlap", "audit", "soak"), ["—", "not run (not in the campaign's `stages:`)"])
    assert rows["quality"][:2] == ["`no_claim`", "**fails** (advisory: the run does not fail on it)"]
    assert "### Parity" not in summary and "### GSM8K quality gate" in (ev / DETAILS).read_text()
