"""The workflow side of DeepSeek-V4: the synthetic writer (transformers and the engine load what it writes, tid2eid
holds valid expert ids, DeepSeek-V2/V3 checkpoints unchanged), the parameter count, what the campaign check refuses
before any work, the bandwidth floor, the kernel audit's and the overlap screen's shapes, the shipped models and
campaign. The campaign end to end: tests/test_pipeline.py."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

from campaigns import overridden, rejected  # noqa: E402

from evident.engine.checkpoint import load_model  # noqa: E402
from evident.engine.config import V4Args, load_args  # noqa: E402
from evident.workflow.bench import floor, replay  # noqa: E402
from evident.workflow.models import checkpoints, hf
from evident.workflow.models.families import deepseek_v4
from evident.workflow.plan import estimate
from evident.workflow.plan.campaign import check_inputs, model_config, required_fields, validate_campaign  # noqa: E402
from evident.workflow.stages import kernel_audit, overlap  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "config/schema.yaml")
V4_TINY = model_config("deepseek-v4-tiny")
FLASH = model_config("deepseek-v4-flash")
CAMPAIGN = yaml.safe_load((REPO / "config/campaigns/v4-tiny.yaml").read_text())
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def numel(cfg: dict) -> int:
    return sum(math.prod(s) for s in checkpoints.parameter_shapes(checkpoints.full_config(cfg, "float32")).values())


def meta_numel(cfg: dict) -> int:
    """Elements of transformers' own model (parameters and persistent buffers), counted on the meta device."""
    config_cls, model_cls = checkpoints.hf_classes("deepseek_v4")
    c = config_cls(**copy.deepcopy(cfg))
    with torch.device("meta"):
        model = model_cls(c)
    tied = c.tie_word_embeddings
    return sum(t.numel() for k, t in model.state_dict().items() if not (tied and k == "lm_head.weight"))


@pytest.fixture(autouse=True)
def _here(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the checkpoint cache and the hash cache are relative to the working directory
    monkeypatch.delenv(estimate.ALLOW, raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return checkpoints.write_synthetic(tmp_path_factory.mktemp("v4") / "ckpt", V4_TINY, 0, 0.08, "float32")


def tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --- the writer -----------------------------------------------------------------------------------

def test_the_writer_writes_the_names_save_pretrained_writes(ckpt):
    from transformers.core_model_loading import revert_weight_conversion

    config_cls, model_cls = checkpoints.hf_classes("deepseek_v4")
    with torch.device("meta"):
        model = model_cls(config_cls(**copy.deepcopy(V4_TINY)))
    want = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    got = {k: tuple(v.shape) for k, v in tensors(ckpt).items()}
    assert got == want
    assert "head.weight" in got and "model.layers.1.attn.indexer.compressor.wkv.weight" in got
    assert "model.layers.0.ffn.experts.7.w3.weight" in got and not any("mtp." in k for k in got)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    assert load_args(ckpt) == V4Args.from_hf(V4_TINY)  # the engine reads the campaign's model back


def test_tid2eid_holds_distinct_seeded_expert_ids_as_int64(ckpt):
    t = tensors(ckpt)
    tables = {k: v for k, v in t.items() if k.endswith("gate.tid2eid")}
    hashed = [i for i, m in enumerate(V4_TINY["mlp_layer_types"]) if m == "hash_moe"]
    assert sorted(tables) == [f"model.layers.{i}.ffn.gate.tid2eid" for i in hashed]
    for v in tables.values():
        assert v.dtype == torch.int64 and v.shape == (V4_TINY["vocab_size"], V4_TINY["num_experts_per_tok"])
        assert 0 <= int(v.min()) and int(v.max()) < V4_TINY["n_routed_experts"]
        assert all(len(set(row)) == len(row) for row in v.tolist())  # distinct within a row
        assert len(set(map(tuple, v.tolist()))) > 40  # of the 56 ordered pairs of 8 experts: not one row repeated
        counts = torch.bincount(v.flatten(), minlength=V4_TINY["n_routed_experts"])
        assert int(counts.min()) > 0  # every expert is chosen by some token
    # the bf16 checkpoint of the same seed: the same table, the floats in bf16, the scales ones
    bf = tensors(checkpoints.write_synthetic(ckpt.parent / "bf16", V4_TINY, 0, 0.08, "bfloat16"))
    for k, v in bf.items():
        assert v.dtype == (torch.int64 if k.endswith("tid2eid") else torch.bfloat16), k
    assert all(torch.equal(bf[k], v) for k, v in tables.items())


def test_norms_and_hyper_connection_scales_are_ones_the_rest_random(ckpt):
    t = tensors(ckpt)
    ones = [k for k in t if k.endswith("norm.weight") or k.endswith("_scale") or k.endswith("hc_head.hc_scale")]
    assert {"model.hc_head.hc_scale", "model.layers.2.hc_attn_scale", "model.layers.2.hc_ffn_scale",
            "model.layers.1.attn.indexer.compressor.norm.weight", "model.norm.weight"} <= set(ones)
    assert all(torch.equal(t[k], torch.ones_like(t[k])) for k in ones)
    for k in ("model.layers.1.attn.compressor.ape", "model.layers.2.hc_ffn_fn", "model.hc_head.hc_fn",
              "model.layers.1.ffn.gate.weight", "model.layers.0.ffn.experts.3.w2.weight"):
        assert 0.07 < float(t[k].std()) < 0.09, k  # N(0, init_std 0.08)
    for k in ("model.layers.0.attn.attn_sink", "model.layers.2.hc_ffn_base", "model.layers.1.ffn.gate.bias"):
        assert len(set(t[k].tolist())) == t[k].numel() and float(t[k].abs().max()) < 0.5, k  # drawn, not constant


def test_the_writer_is_deterministic(ckpt, tmp_path):
    again = checkpoints.write_synthetic(tmp_path / "again", V4_TINY, 0, 0.08, "float32")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (ckpt / name).read_bytes()
    other = checkpoints.write_synthetic(tmp_path / "other", V4_TINY, 1, 0.08, "float32")
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()


def test_transformers_and_the_engine_load_it_and_agree(ckpt):
    tok, model = hf.load(ckpt, "float32", "cpu")  # raises on any missing, unexpected or mismatched key
    engine = load_model(ckpt)
    assert type(engine).__name__ == "V4Transformer"
    ids = tok("Hello, evident! The engine says something longer than the sliding window",
              return_tensors="pt").input_ids
    assert ids.shape[1] > 2 * V4_TINY["sliding_window"]
    with torch.no_grad():
        ref = model(ids).logits
        got = engine(ids, engine.new_cache(1, ids.shape[1]))
    assert (ref - got).abs().max() < 1e-4
    tied = {**V4_TINY, "tie_word_embeddings": True}
    tied_dir = checkpoints.write_synthetic(ckpt.parent / "tied", tied, 0, 0.08, "float32")
    assert "head.weight" not in tensors(tied_dir)
    hf.load(tied_dir, "float32", "cpu")
    load_model(tied_dir)


def test_deepseek_v2_and_v3_checkpoints_are_unchanged(tmp_path):
    """Their bytes are part of evidence ids: the init every name had before V4 (ones for norm weights, else
    N(0, std) in name order from one generator), and pinned hashes."""
    tiny = model_config("tiny")
    v3 = {**tiny, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1,
          "norm_topk_prob": True}
    pinned = {("v2", "float32"): "b4a358090539740d", ("v2", "bfloat16"): "b1e4939bef4dcf5a",
              ("v3", "float32"): "7a77e030741201c2", ("v3", "bfloat16"): "a543504e48f3c172"}
    for (name, dtype), digest in pinned.items():
        cfg = tiny if name == "v2" else v3
        out = checkpoints.write_synthetic(tmp_path / f"{name}-{dtype}", cfg, 0, 0.02, dtype)
        assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16] == digest, (name, dtype)
        gen = torch.Generator().manual_seed(0)
        dt = checkpoints.torch_dtype(dtype)
        t = tensors(out)
        for k, shape in sorted(checkpoints.parameter_shapes(checkpoints.full_config(cfg, dtype)).items()):
            want = torch.ones(shape) if k.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
            assert torch.equal(t[k], want.to(dt)), k


# --- the parameter count --------------------------------------------------------------------------

@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True}, {"hc_mult": 2},
                                  {"layer_types": [S, S, S]}, {"layer_types": [C, C, H], "index_topk": 2},
                                  {"mlp_layer_types": ["hash_moe"] * 3}, {"compress_rates": {C: 2, H: 16}}])
def test_the_v4_parameter_count_is_the_model_transformers_builds(over):
    cfg = {**V4_TINY, **over}
    assert estimate.parameters(cfg) == numel(cfg) == meta_numel(cfg)


def test_the_v4_parameter_count_of_the_flash_width_and_of_legacy_keys():
    assert estimate.parameters(FLASH) == numel(FLASH) == meta_numel(FLASH) == 14_236_142_705
    legacy = {k: v for k, v in V4_TINY.items() if k not in ("layer_types", "mlp_layer_types", "partial_rotary_factor")}
    legacy.update(compress_ratios=[0, 4, 128], num_hash_layers=1, qk_rope_head_dim=8,
                  compress_rates={C: 4, H: 128})
    assert estimate.parameters(legacy) == numel(legacy) == meta_numel(legacy)
    a = V4Args.from_hf(legacy)
    assert a.layer_types == [S, C, H] and a.mlp_layer_types == ["hash_moe", "moe", "moe"] and a.qk_rope_head_dim == 8


# --- the campaign check ---------------------------------------------------------------------------

def campaign(**over) -> dict:
    return overridden(CAMPAIGN, **over)


def test_the_shipped_v4_campaign_is_valid_and_runs_every_stage():
    cfg = campaign()
    validate_campaign(cfg, SCHEMA)
    assert cfg["stages"] == ["oracle", "parity", "bench", "serve_bench", "overlap", "kernel_audit", "quality", "profile"]
    assert cfg["checkpoint"]["config"] == V4_TINY and "base" not in cfg["checkpoint"]
    assert cfg["device"] == "cpu" and cfg["dtype"] == "float32" and cfg["parity"]["require_exact"]
    assert set(cfg["bench"]["backends"]) == {"single", "hf"} and cfg["quality"]["targets"] == ["hf", "engine"]


def test_expert_parallel_backends_and_the_triton_path_are_refused_naming_the_key():
    msg = rejected(campaign(**{"parity.backends": ["single", "collective"], "parity.kernels": ["torch", "triton"],
                               "bench.backends": ["single", "host-staged", "hf"], "bench.kernels": "triton"}))
    lines = msg.splitlines()
    assert lines[0] == ("invalid campaign config at `parity.backends`: collective: the engine runs DeepSeek-V4 on one "
                        "device, without expert parallelism; keep single."), msg
    assert lines[1] == ("invalid campaign config at `bench.backends`: host-staged: the engine runs DeepSeek-V4 on one "
                        "device, without expert parallelism; keep single and hf."), msg
    assert lines[2].startswith("invalid campaign config at `parity.kernels`: triton: the engine's Triton decode path")
    assert "use torch (and graph)" in lines[2]
    assert lines[3].startswith("invalid campaign config at `bench.kernels`: triton:")
    assert "use torch or graph" in lines[3]
    assert "4 errors." in msg


def test_transformers_static_cache_is_refused_for_v4_and_its_other_paths_are_not():
    assert "at `bench.backends`: hf-static: transformers' static cache" in rejected(
        campaign(**{"bench.backends": ["single", "hf-static"]}))
    validate_campaign(campaign(**{"bench.backends": ["single", "hf", "hf-grouped"]}), SCHEMA)


def test_distinct_prompts_beside_transformers_paths_are_refused_and_on_the_engine_alone_are_not():
    prompts = [f"prompt {i} " * (i + 1) for i in range(8)]
    assert "at `bench.prompts`: hf: transformers' DeepSeek-V4 decodes a left-padded row otherwise" in rejected(
        campaign(**{"bench.prompts": prompts}))
    validate_campaign(campaign(**{"bench.prompts": prompts, "bench.backends": ["single"]}), SCHEMA)


def test_the_graph_path_and_stages_not_run_are_not_refused():
    validate_campaign(campaign(**{"parity.kernels": ["torch", "graph"], "bench.kernels": "graph"}), SCHEMA)
    # a backend of a stage the campaign does not run is never run
    validate_campaign(campaign(stages=["oracle", "quality"], **{"parity.backends": ["collective"],
                                                               "bench.backends": ["host-staged"],
                                                               "bench.kernels": "triton"}), SCHEMA)
    # the profile times bench.kernels' path
    assert "at `bench.kernels`" in rejected(campaign(stages=["profile"], **{"bench.kernels": "triton"}))
    # DeepSeek-V2 keeps every backend and path
    v2 = campaign(**{"checkpoint.base": "tiny", "parity.backends": ["single", "collective"],
                     "parity.kernels": ["torch", "triton"], "bench.kernels": "triton", "quality.gsm8k.max_tokens": 16})
    validate_campaign(v2, SCHEMA)


def test_a_local_v4_checkpoint_is_refused_too(ckpt):
    cfg = campaign(checkpoint={"source": "local", "path": str(ckpt)}, **{"parity.backends": ["host-staged"]})
    assert "at `parity.backends`: host-staged: the engine runs DeepSeek-V4 on one device" in rejected(cfg)
    validate_campaign(campaign(checkpoint={"source": "local", "path": str(ckpt)}), SCHEMA)


def test_mlp_bias_and_bad_v4_fields_are_refused_before_any_work():
    assert "at `checkpoint.config`: mlp_bias / attention_bias: DeepSeek-V4's projections have no biases here" in \
        rejected(campaign(**{"checkpoint.config": {"mlp_bias": True}}))
    assert "at `checkpoint.config`: o_groups=3 must divide num_attention_heads=4" in rejected(
        campaign(**{"checkpoint.config": {"o_groups": 3}}))
    assert "layer_types has 2 entries for num_hidden_layers=3" in rejected(
        campaign(**{"checkpoint.config": {"layer_types": [S, C]}}))
    msg = rejected(campaign(**{"checkpoint.config": {"index_topk": 0, "compress_rate": 4}}))
    assert "at `checkpoint.config.index_topk`: 0 is less than the minimum of 1" in msg, msg
    assert "unknown DeepSeek config field 'compress_rate'; did you mean 'compress_rates'" in msg, msg
    # each family's fields: a DeepSeek-V4 field on a DeepSeek-V2 model is unknown, and no V4 name is suggested there
    msg = rejected(campaign(**{"checkpoint.base": "tiny", "checkpoint.config": {"index_topk": 4, "num_hiden_layers": 2}}))
    assert "unknown DeepSeek config field 'index_topk'" in msg and "num_hash_layers" not in msg, msg


def test_a_partial_v4_config_without_a_base_names_the_v4_fields():
    cfg = campaign(checkpoint={"source": "synthetic", "config": {"model_type": "deepseek_v4", "hidden_size": 64}})
    msg = rejected(cfg)
    assert "at `checkpoint.config`: missing field(s) " in msg and "index_topk" in msg and "kv_lora_rank" not in msg
    assert "compress_rates" in required_fields("deepseek_v4") and "kv_lora_rank" in required_fields()
    full = campaign(checkpoint={"source": "synthetic", "config": dict(V4_TINY)})
    validate_campaign(full, SCHEMA)  # written out in full: the same as the base
    assert full["checkpoint"]["config"] == V4_TINY


def test_check_inputs_alone_refuses_on_the_resolved_config():
    cfg = campaign()
    validate_campaign(cfg, SCHEMA)
    cfg["parity"]["backends"] = ["collective"]
    assert [k for k, _ in check_inputs(cfg, cfg["checkpoint"]["config"])] == ["parity.backends"]


# --- the floor, the audit's and the screen's shapes ----------------------------------------------

def test_the_v4_floor_counts_what_a_step_must_read(ckpt):
    """Against the engine's loaded model (real tensors, fp32 where it keeps fp32) and the cache written out by hand."""
    model = load_model(ckpt, dtype=torch.bfloat16)
    a = model.args
    got = floor.step_bytes(ckpt, torch.bfloat16, batch=3, positions=40)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    others = [p for n, p in model.named_parameters() if ".experts." not in n and n != "embed_tokens.weight"]
    bias = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    hashed = sum(m == "hash_moe" for m in a.mlp_layer_types) * 3 * a.num_experts_per_tok * 8
    assert got["weights"] == nbytes(others) + nbytes(bias) + hashed
    expert = 3 * a.hidden_size * a.moe_intermediate_size * 2
    assert got["chosen_experts"] == a.num_hidden_layers * a.num_experts_per_tok * expert
    assert got["embedding_rows"] == 3 * a.hidden_size * 2
    d, c, W = a.head_dim, a.index_head_dim, a.sliding_window  # 32, 16, 8; CSA rate 4, HCA rate 8
    window = 3 * W * d  # every layer: the last 8 of 40 positions
    csa = min(a.index_topk, 40 // 4) * d + (40 // 4) * c + 2 * 8 * c / 4 + 2 * 8 * d / 4
    hca = (40 // 8) * d + 2 * 8 * d / 8
    assert got["cache"] == 3 * int((window + csa + hca) * 2)
    assert got["total"] == got["weights"] + got["chosen_experts"] + got["embedding_rows"] + got["cache"]
    early = floor.step_bytes(ckpt, torch.bfloat16, batch=1, positions=3)["cache"]  # inside the window, no entry yet
    assert early == int((3 * 3 * d + 2 * 8 * c / 4 + 2 * 8 * d / 4 + 2 * 8 * d / 8) * 2)


def test_the_replay_reads_hash_layers_from_tid2eid_and_transformers_routers_agree(ckpt):
    """The floor's experts on DeepSeek-V4 (workflow/bench/replay.py): a hash layer chooses its table's row of the step's
    input token; every layer chooses as transformers' routers do on the same tokens."""
    model = load_model(ckpt)
    rows, tokens = [[5, 9, 2, 40, 17, 3], [7, 3]], [[3, 8, 1, 4, 6], [2, 2, 9, 6, 5]]
    got = replay.replay(model, rows, tokens)
    hashed = [i for i, m in enumerate(V4_TINY["mlp_layer_types"]) if m == "hash_moe"]
    assert hashed and len(got[0].experts[0]) == V4_TINY["num_hidden_layers"]  # every V4 layer routes
    for row, gen in zip(got, tokens):
        assert len(row.experts) == len(gen) - 1
        for s, layers in enumerate(row.experts):  # decode step s + 2 feeds gen[s]
            for i in hashed:
                assert layers[i] == model.layers[i].mlp.gate.tid2eid[gen[s]].tolist()
    _, theirs = hf.load(ckpt, "float32", "cpu")
    assert [[[sorted(ids) for ids in step] for step in r.experts] for r in replay.replay(theirs, rows, tokens, hf=True)] \
        == [[[sorted(ids) for ids in step] for step in r.experts] for r in got]


def test_the_kernel_audit_takes_v4_shapes(ckpt):
    ks, vocab = kernel_audit.model_shapes(ckpt)
    h = V4_TINY["hidden_size"]
    assert ks == sorted({h, V4_TINY["q_lora_rank"], 4 * 32 // 2, 2 * 16, V4_TINY["moe_intermediate_size"], 4 * h})
    assert vocab == 512
    assert kernel_audit.shapes(ckpt)["experts"] == (h, 32, 8, 2)
    missing = kernel_audit.not_covered(ckpt)
    assert set(deepseek_v4.NOT_COVERED) <= set(missing) and any("mla" in k for k in missing)
    import inspect

    from evident.kernels.audit import COVERED, audit

    takes = inspect.signature(audit).parameters
    want = {"limit": 10.0, "hc": (4, 20)}
    assert kernel_audit.shapes(ckpt)["options"] == {k: v for k, v in want.items() if k in takes}
    assert (deepseek_v4.HC_WEIGHTS in missing) == ("hc_weights" not in COVERED)


def test_the_overlap_screen_takes_the_v4_models_c4_shapes():
    assert overlap.model_shapes(FLASH) == {"K": 4096, "segments": [2048, 512, 64], "gemm_n": 1536}
    assert overlap.model_shapes(V4_TINY) == {"K": 64, "segments": [128, 64, 8], "gemm_n": 64}
    assert overlap.model_shapes({**V4_TINY, "layer_types": [S, H, H]}) is None  # no C4 layer: nothing to screen
    cfg = campaign()
    validate_campaign(cfg, SCHEMA)
    for cuda in (True, False):  # on the CPU the tiny model's own shapes, or small interpreter ones naming them
        got = overlap.shapes_of(cfg, cuda=cuda)
        screened = got.get("configured") or got
        assert {k: screened[k] for k in ("source", "K", "segments", "gemm_n")} == {
            "source": "model", "K": 64, "segments": [128, 64, 8], "gemm_n": 64}, got


def test_the_flash_model_is_deepseek_v4_flash_s_width():
    defaults = transformers.DeepseekV4Config().to_dict()
    width = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "o_groups",
             "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "hc_mult",
             "partial_rotary_factor", "swiglu_limit", "routed_scaling_factor", "scoring_func")
    assert {k: FLASH[k] for k in width} == {k: defaults[k] for k in width}
    assert FLASH["num_hidden_layers"] == 2 and FLASH["layer_types"] == [H, C]
    assert FLASH["mlp_layer_types"] == ["hash_moe", "moe"]
    assert FLASH["compress_rates"] == defaults["compress_rates"]
    tiny = V4Args.from_hf(V4_TINY)
    assert set(tiny.layer_types) == {S, C, H} and set(tiny.mlp_layer_types) == {"hash_moe", "moe"}
    assert tiny.index_n_heads >= 8  # exact ties of the indexer's scores stay rare


def test_a_graph_session_reloads_into_another_dtype(ckpt):
    """parity's teacher-forced runs reload the engine in float32; the V4 graph path must free its own (it had no
    stacks to clear and failed on the H200 there)."""
    from evident.workflow.models.session import Session, load_engine

    s = Session({}, "single", "cpu", load_engine(ckpt, "cpu", "bfloat16", None, "graph"), None, [], None, "graph", ckpt)
    with torch.inference_mode():
        s.model.graph_decode.cache(1, 8)
    old = s.model.graph_decode
    s.reload("float32")
    assert not old.caches and s.model.graph_decode is not old
    assert s.model.embed_tokens.weight.dtype == torch.float32
