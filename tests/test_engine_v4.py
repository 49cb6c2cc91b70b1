"""DeepSeek-V4 in the engine against transformers' own DeepseekV4ForCausalLM (the oracle), float32.

Tiny configs cover every layer type (sliding, CSA, HCA) and both MLP types (hash_moe, moe). transformers' indexer
top-k breaks exact ties arbitrarily (and differently for different lengths: its own cached decode then disagrees
with its full forward), so the configs keep index_n_heads at 8, where a score of exactly 0 is rare.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

from evident.engine.checkpoint import CheckpointError, load_model, mtp_tensors  # noqa: E402
from evident.engine.config import V4Args, args_from_hf  # noqa: E402
from evident.engine.deepseek_v4 import V4Cache, V4Transformer  # noqa: E402
from evident.engine.generate import forced, generate  # noqa: E402

TOL = 1e-4  # fp32 reassociation on logits of magnitude ~5 (measured up to 2.7e-5); a logic bug moves them by ~1e-1
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=16, q_lora_rank=12,
            n_routed_experts=8, num_experts_per_tok=2, compress_rates={C: 4, H: 8}, sliding_window=6, o_groups=2,
            o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3, hc_mult=2, partial_rotary_factor=0.5,
            max_position_embeddings=256, hc_sinkhorn_iters=5)
CONFIGS = {
    "all-types": dict(num_hidden_layers=3, layer_types=[S, C, H], mlp_layer_types=["hash_moe", "moe", "moe"]),
    "csa-hca-yarn": dict(num_hidden_layers=2, layer_types=[C, H], mlp_layer_types=["moe", "hash_moe"],
                         rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32, "beta_slow": 1}),
    "wide-window-topk1": dict(num_hidden_layers=2, layer_types=[H, C], mlp_layer_types=["moe", "moe"], sliding_window=11,
                              index_topk=1, hc_mult=3, o_groups=4, num_experts_per_tok=3, compress_rates={C: 2, H: 5}),
}


def hf_model(name: str, seed: int = 0, **over):
    cfg = transformers.DeepseekV4Config(**{**BASE, **CONFIGS[name], **over})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers zeroes sinks, biases and tid2eid at init: draw them all
        for key, t in model.state_dict().items():
            if not t.is_floating_point():
                t.copy_(torch.rand(t.shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, :t.shape[1]])
            elif key.endswith("norm.weight") or key.endswith("scale"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    return model


def engine_of(hf) -> V4Transformer:
    eng = V4Transformer(args_from_hf(hf.config.to_dict()))
    eng.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, strict=True)
    return eng.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(request.param)
    return hf, engine_of(hf)


def test_prefill_and_incremental_decode_match_transformers_full_forward(pair):
    hf, eng = pair
    ids = torch.randint(0, 96, (2, 44), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        whole = eng(ids, V4Cache.for_model(eng, 2, 64))
        cache = V4Cache.for_model(eng, 2, 64)
        steps = [eng(ids[:, :13], cache)] + [eng(ids[:, t:t + 1], cache) for t in range(13, 44)]
    assert (whole - ref).abs().max() < TOL
    assert (torch.cat(steps, 1) - ref).abs().max() < TOL
    assert cache.lengths.tolist() == [44, 44]


def test_greedy_generate_is_token_exact_with_transformers(pair):
    hf, eng = pair
    prompt = [5, 17, 3, 88, 41, 9, 60]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    out = generate(eng, [prompt, prompt[:4]], 30)
    assert out.tokens[0] == ref
    alone = generate(eng, [prompt[:4]], 30)  # a row of a batch decodes as it does alone
    assert out.tokens[1] == alone.tokens[0]


def test_a_ragged_batch_prefills_one_forward_per_prompt_length(pair):
    """V4 takes no padding (a padded token would enter the window and the compressors): the rows of each prompt
    length prefill together, and every row decodes as it does alone."""
    _, eng = pair
    prompts = [[5, 17, 3, 88, 41], [9, 60, 2], [1, 2, 3, 4, 5], [7, 7, 8]]
    calls = []
    hook = eng.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    try:
        out = generate(eng, prompts, 12)
    finally:
        hook.remove()
    assert calls[:2] == [(2, 5), (2, 3)] and all(c == (4, 1) for c in calls[2:])
    assert out.tokens == [generate(eng, [p], 12).tokens[0] for p in prompts]


def test_teacher_forced_logits_match_one_forward(pair):
    hf, eng = pair
    prompt, cont = [[4, 8, 15, 16, 23], [42, 7, 1, 2, 3]], [[9] * 20, list(range(20))]
    seen = []
    forced(eng, prompt, cont, lambda logits: seen.append(logits))
    got = torch.cat(seen, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([p + c[:-1] for p, c in zip(prompt, cont)])).logits
    assert (got - ref).abs().max() < TOL


def test_every_layer_and_mlp_type_is_exercised():
    a = args_from_hf(transformers.DeepseekV4Config(**{**BASE, **CONFIGS["all-types"]}).to_dict())
    assert set(a.layer_types) == {S, C, H} and set(a.mlp_layer_types) == {"hash_moe", "moe"}


def test_indexer_selection_matters_so_the_check_can_see_it():
    """A CSA layer whose index_topk keeps fewer entries than a late query may see: the kept set is a real choice
    (index_topk widened, the logits move), and the engine follows transformers through it."""
    hf = hf_model("all-types")
    eng = engine_of(hf)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = eng(ids, V4Cache.for_model(eng, 1, 64))
        eng.layers[1].self_attn.compressor.indexer.topk = 64
        wide = eng(ids, V4Cache.for_model(eng, 1, 64))
    assert (base - wide).abs().max() > 1e-3


def test_v4_config_derivation_follows_transformers():
    for over in ({}, {"num_hidden_layers": 7}, {"compress_ratios": [0, 4, 128, 4], "num_hidden_layers": 4},
                 {"qk_rope_head_dim": 32, "num_hidden_layers": 2, "num_hash_layers": 1},
                 {"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}}):
        ref = transformers.DeepseekV4Config(**over)
        a = V4Args.from_hf({"model_type": "deepseek_v4", **over})
        assert a.layer_types == ref.layer_types and a.mlp_layer_types == ref.mlp_layer_types
        assert a.qk_rope_head_dim == ref.qk_rope_head_dim and a.compress_rates == ref.compress_rates
        for kind in ("main", "compress"):
            mine = a.rope_parameters[kind]
            theirs = {k: v for k, v in ref.rope_parameters[kind].items() if k not in ("partial_rotary_factor", "type")}
            assert {k: mine.get(k) for k in theirs} == theirs


@pytest.mark.parametrize("bad, says", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"norm_topk_prob": False}, "renormalise"),
    ({"layer_types": [S, "dense"]}, "layer_types"),
    ({"o_groups": 3}, "o_groups"),
    ({"partial_rotary_factor": 3 / 16}, "rope dims"),
    ({"sliding_window": None}, "may not be null"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters"),
    ({"n_shared_experts": 2}, "one shared expert"),
    ({"mlp_bias": True}, "biases"),
    ({"rope_parameters": {"main": {"rope_type": "default", "partial_rotary_factor": 0.25},
                          "compress": {"rope_type": "default"}}}, "one rope width"),
])
def test_unsupported_v4_configs_are_refused_by_name(bad, says):
    with pytest.raises((ValueError, NotImplementedError), match=says):
        V4Args.from_hf({"model_type": "deepseek_v4", **BASE, "num_hidden_layers": 2, **bad})


def test_checkpoint_in_deepseek_names_loads_with_mtp_skipped(tmp_path):
    hf = hf_model("all-types")
    hf.save_pretrained(tmp_path)  # DeepSeek's own names (wq_a, ffn.experts.3.w1, ...)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    assert any(".ffn.experts.0.w1.weight" in k for k in tensors)
    tensors["mtp.0.emb.weight"] = torch.zeros(3, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert mtp_tensors(tmp_path) == ["mtp.0.emb.weight"]
    eng = load_model(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert (eng(ids, eng.new_cache(1, 16)) - hf(ids).logits).abs().max() < TOL
    bf = load_model(tmp_path, dtype=torch.bfloat16)  # fp32 where transformers keeps fp32, and the router
    kinds = {n: p.dtype for n, p in bf.named_parameters()}
    assert kinds["layers.0.attn_hc.fn"] == kinds["layers.1.self_attn.sinks"] == kinds["layers.1.mlp.gate.weight"] \
        == torch.float32
    assert kinds["layers.1.mlp.experts.gate_up_proj"] == kinds["layers.1.self_attn.q_a_proj.weight"] == torch.bfloat16


def saved(tmp_path):
    """(its tensors, rewrite(tensors)): transformers' tiny model saved in DeepSeek's names, to be altered."""
    from safetensors.torch import load_file, save_file

    hf_model("all-types").save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors"), \
        lambda tensors: save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_bad_tid2eid_and_missing_tensors_are_refused(tmp_path):
    tensors, rewrite = saved(tmp_path)
    key = next(k for k in tensors if k.endswith("gate.tid2eid"))
    good = tensors[key].clone()
    tensors[key] = good + 100
    rewrite(tensors)
    with pytest.raises(CheckpointError, match="expert ids"):
        load_model(tmp_path)
    tensors[key] = good
    del tensors[next(k for k in tensors if k.endswith("attn_sink"))]
    rewrite(tensors)
    with pytest.raises(CheckpointError, match="sinks"):
        load_model(tmp_path)


def test_fp8_and_misshapen_experts_are_refused(tmp_path):
    tensors, rewrite = saved(tmp_path)
    key = next(k for k in tensors if k.endswith("ffn.experts.0.w1.weight"))
    good = tensors[key].clone()
    tensors[key] = good[:, :-1].contiguous()
    rewrite(tensors)
    with pytest.raises(CheckpointError, match="experts.0.w1.weight.*shape"):
        load_model(tmp_path)
    tensors[key] = good.to(torch.float8_e4m3fn)
    rewrite(tensors)
    with pytest.raises(CheckpointError, match="FP8"):
        load_model(tmp_path)


def test_cache_overflow_is_refused_before_any_write():
    eng = engine_of(hf_model("all-types"))
    cache = eng.new_cache(1, 8)
    with pytest.raises(ValueError, match="overflow"):
        eng(torch.zeros(1, 9, dtype=torch.long), cache)
    assert cache.lengths.tolist() == [0]


def test_the_logic_check_sees_every_v4_mutant():
    """Each logic mutant of tests/mutants.py's V4_MUTANTS moves the teacher-forced float32 log-probs (over the
    oracle's top-8, as the parity logic check reads them) past the logic tolerance; the unmutated engine and the
    precision mutant (a dtype change, none in float32) stay far inside it."""
    import mutants
    from evident.workflow.stages.compare import LOGIC_TOLERANCE

    hf = hf_model("all-types")
    eng = engine_of(hf)
    prompt, cont = [4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 5, 8, 13], list(range(30, 50))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + cont[:-1]])).logits[0], -1)
    top = ref.topk(8, -1).indices

    def error() -> float:
        seen = []
        forced(eng, [prompt], [cont], seen.append)
        lp = torch.log_softmax(torch.cat(seen, 1)[0], -1)
        return float((lp.gather(1, top) - ref.gather(1, top)).abs().max())

    assert error() < 1e-4
    for name, (kind, *_rest) in mutants.V4_MUTANTS.items():
        with mutants.applied(eng, name):
            e = error()
        assert (e > 10 * LOGIC_TOLERANCE) if kind == "logic" else (e < 1e-4), (name, e)
