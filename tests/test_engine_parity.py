"""Acceptance of engine/ against the real transformers DeepSeek-V2 implementation (fp32, CPU).

Tiny random HF models (initializer_range 0.1 so greedy traces are decisive) are written with
``save_pretrained`` (per-expert names), as a raw ``state_dict()`` (packed transformers-5 expert names)
and as hand-written per-expert shards with an index; the engine loads each with ``load_model``.

max abs diff observed (prefill logits, engine vs HF; per-step decode logits through the latent cache
vs HF full-sequence logits), logit scale ~2.5:
  q_direct-e4-k1-s1-fk0-default   prefill 0        decode 1.13e-06
  q_lora-e8-k2-s2-fk1-yarn4       prefill 8.64e-07 decode 1.19e-06
  q_lora-e8-k3-s0-fk2-yarn40-bias prefill 1.13e-06 decode 1.37e-06
  q_direct-e4-k2-s1-fk1-tied      prefill 0        decode 1.31e-06
(from a `pytest -s` run, torch 2.13 CPU / transformers 5.24; the assertion is < 1e-4.)
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,  # noqa: E402
                          DeepseekV3ForCausalLM)

from evident.engine.checkpoint import CheckpointError, load_model  # noqa: E402
from evident.engine.config import ModelArgs  # noqa: E402
from evident.engine.generate import Generation, Rows, forced, generate  # noqa: E402
from evident.engine.model import LatentCache, MoE, Transformer, rope_inv_freq  # noqa: E402

TOL = 1e-4
VOCAB = 256
N_NEW = 16
YARN = dict(rope_type="yarn", rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
            initializer_range=0.1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "q_direct-e4-k1-s1-fk0-default": dict(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=1,
                                          n_shared_experts=1, first_k_dense_replace=0),
    "q_lora-e8-k2-s2-fk1-yarn4": dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                                      first_k_dense_replace=1, max_position_embeddings=128,
                                      rope_parameters=dict(YARN, factor=4.0, original_max_position_embeddings=32)),
    "q_lora-e8-k3-s0-fk2-yarn40-bias": dict(q_lora_rank=16, n_routed_experts=8, num_experts_per_tok=3,
                                            n_shared_experts=0, first_k_dense_replace=2, num_hidden_layers=3,
                                            attention_bias=True, max_position_embeddings=1280,
                                            rope_parameters=dict(YARN, factor=40.0,
                                                                 original_max_position_embeddings=32)),
    "q_direct-e4-k2-s1-fk1-tied": dict(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                       n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=True,
                                       routed_scaling_factor=2.5, rope_parameters=dict(rope_type="default",
                                                                                       rope_theta=500.0)),
    # group-limited routing keeps topk_group groups: top-k above topk_group, or it picks what greedy picks
    "v2group-q_direct-e8-g4-t2-k3-yarn4": dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                                               n_shared_experts=1, first_k_dense_replace=1,
                                               topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                               routed_scaling_factor=16.0, max_position_embeddings=128,
                                               rope_parameters=dict(YARN, factor=4.0,
                                                                    original_max_position_embeddings=32)),
    "v3-q_lora-e8-g4-t2-k3-interleave": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=24, n_routed_experts=8,
                                             num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                             rope_interleave=True),
    "v3-q_direct-e16-g4-t1-k3-yarn4-halves": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=None, n_routed_experts=16,
                                                  num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=0,
                                                  n_group=4, topk_group=1, norm_topk_prob=False,
                                                  routed_scaling_factor=1.0, rope_interleave=False,
                                                  max_position_embeddings=128,
                                                  rope_parameters=dict(YARN, factor=4.0,
                                                                       original_max_position_embeddings=32)),
    "v3-q_lora-e8-g2-t1-k2-fk2": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=16, n_routed_experts=8,
                                      num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
                                      num_hidden_layers=3, n_group=2, topk_group=1, norm_topk_prob=True,
                                      routed_scaling_factor=1.5, rope_interleave=True),
}
FAMILIES = {"deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
            "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}
PROMPT = [17, 200, 3, 99, 45, 128, 7, 250]


def hf_model(overrides: dict, seed: int = 0):
    """transformers' own DeepseekV2ForCausalLM, or DeepseekV3ForCausalLM for model_type deepseek_v3."""
    torch.manual_seed(seed)
    overrides = dict(overrides)
    config_cls, model_cls = FAMILIES[overrides.pop("model_type", "deepseek_v2")]
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # HF zero-inits biases and V3's score correction: make them matter
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "e_score_correction_bias")):
                p.normal_(0.0, 0.1)
    return model


def hf_generate(model, prompt: list[int], n: int = N_NEW, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    gc = copy.deepcopy(model.generation_config)
    # None: never stop early; an id outside the vocabulary, since transformers falls back to the config's eos for None
    gc.eos_token_id = VOCAB if eos is None else eos
    gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 0, False, n
    # explicit attention_mask: otherwise HF masks any prompt token equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)[0, len(prompt):].tolist()
    assert eos is not None or len(out) == n
    return out


def engine_prefill(model: Transformer, tokens: list[int]) -> torch.Tensor:
    cache = LatentCache.for_model(model, max_rows=1, max_len=len(tokens))
    with torch.inference_mode():
        return model(torch.tensor([tokens]), cache)


def per_expert_state_dict(model) -> dict[str, torch.Tensor]:
    """HF state_dict (packed experts) -> original DeepSeek per-expert names."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].clone()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        elif not (k == "lm_head.weight" and model.config.tie_word_embeddings):  # tied: omitted, as on the hub
            out[k] = v.clone()
    return out


def write_checkpoint(path, model, tensors: dict[str, torch.Tensor], shards: int = 1) -> str:
    os.makedirs(path, exist_ok=True)
    model.config.to_json_file(os.path.join(path, "config.json"))
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return str(path)
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, HF model, checkpoint dir written by save_pretrained, engine model loaded from it)."""
    name = request.param
    hf = hf_model(CONFIGS[name])
    ckpt = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf.save_pretrained(ckpt)
    return name, hf, str(ckpt), load_model(ckpt)


# ---------------------------------------------------------------------------------------------
# parity with HF
# ---------------------------------------------------------------------------------------------
def test_save_pretrained_names(pair):
    _, hf, ckpt, _ = pair
    from safetensors import safe_open
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    packed = [n for n in hf.state_dict() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert packed, "HF state_dict() uses packed expert tensors"
    assert not any(n.endswith("experts.gate_up_proj") for n in names), "save_pretrained writes per-expert names"
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)


def test_prefill_logits_parity(pair):
    name, hf, _, eng = pair
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits
    got = engine_prefill(eng, PROMPT)
    diff = (got - ref).abs().max().item()
    print(f"\n[{name}] prefill max abs diff {diff:.3g} (logit scale {ref.abs().max().item():.3g})")
    assert got.shape == ref.shape
    assert diff < TOL


def test_weight_formats_agree(pair, tmp_path):
    """Packed state_dict() names (single file) and per-expert names (sharded + index) load identically."""
    name, hf, _, eng = pair
    ref = engine_prefill(eng, PROMPT)
    packed = load_model(write_checkpoint(tmp_path / "packed", hf, hf.state_dict()))
    sharded = load_model(write_checkpoint(tmp_path / "sharded", hf, per_expert_state_dict(hf), shards=3))
    assert torch.equal(engine_prefill(packed, PROMPT), ref)
    assert torch.equal(engine_prefill(sharded, PROMPT), ref)


def test_a_load_builds_the_model_unfilled(tmp_path):
    """The model a checkpoint is seated in is built without torch.nn.init's fills: on the meta device a fill would
    import torch._dynamo, ~2.5 CPU-s in every engine process (a server, a parity or bench stage)."""
    ckpt = str(tmp_path)
    hf_model(next(iter(CONFIGS.values()))).save_pretrained(ckpt)
    code = ("import sys, torch; from evident.engine.checkpoint import load_model; "
            f"load_model({ckpt!r}); print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stdout + r.stderr[-2000:]


def test_greedy_and_decode_parity(pair):
    name, hf, _, eng = pair
    ref_tokens = hf_generate(hf, PROMPT)
    gen = generate(eng, [PROMPT], N_NEW)
    print(f"\n[{name}] HF {ref_tokens}\n[{name}] EN {gen.tokens[0]}\n"
          f"[{name}] min margin {min(gen.margins[0]):.3g}")
    assert gen.tokens[0] == ref_tokens
    assert len(gen.margins[0]) == N_NEW
    # token-by-token decode logits through the latent cache == HF full-sequence logits
    seq = PROMPT + ref_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    cache = LatentCache.for_model(eng, max_rows=1, max_len=len(seq))
    with torch.inference_mode():
        steps = [eng(torch.tensor([PROMPT]), cache)[0]]
        steps += [eng(torch.tensor([[t]]), cache)[0] for t in ref_tokens[:-1]]
    diff = (torch.cat(steps) - ref[:-1]).abs().max().item()
    print(f"[{name}] decode max abs diff {diff:.3g}")
    assert diff < TOL


def test_eos_stops_like_hf():
    hf = hf_model(CONFIGS["q_lora-e8-k2-s2-fk1-yarn4"])
    trace = hf_generate(hf, PROMPT)
    eos = trace[4]
    expected = trace[: trace.index(eos) + 1]
    assert hf_generate(hf, PROMPT, eos=eos) == expected
    eng = Transformer(ModelArgs.from_hf(hf.config.to_dict()))
    eng.load_state_dict(_engine_sd(hf), strict=True)
    gen = generate(eng, [PROMPT, PROMPT[:5]], N_NEW, eos_token_id=[eos, 9999])
    assert gen.tokens[0] == expected
    assert gen.tokens[1] == generate(eng, [PROMPT[:5]], N_NEW, eos_token_id=eos).tokens[0]


def _engine_sd(hf) -> dict[str, torch.Tensor]:
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in per_expert_state_dict(hf).items()}


# ---------------------------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_model(tmp_path_factory):
    hf = hf_model(CONFIGS["q_lora-e8-k2-s2-fk1-yarn4"], seed=1)
    ckpt = tmp_path_factory.mktemp("batch")
    hf.save_pretrained(ckpt)
    return hf, load_model(ckpt)


def test_batch_rows_identical(batch_model):
    _, eng = batch_model
    single = generate(eng, [PROMPT], N_NEW).tokens[0]
    for b in range(1, 9):
        gen = generate(eng, [PROMPT] * b, N_NEW)
        assert gen.tokens == [single] * b, f"batch {b}"


def test_batch_mixed_lengths(batch_model):
    hf, eng = batch_model
    short, long_ = PROMPT[:5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    gen = generate(eng, [short, long_], N_NEW)
    assert gen.tokens[0] == generate(eng, [short], N_NEW).tokens[0] == hf_generate(hf, short)
    assert gen.tokens[1] == generate(eng, [long_], N_NEW).tokens[0] == hf_generate(hf, long_)
    prompts = [[(31 * i + 7 * j) % VOCAB for j in range(1 + (3 * i) % 11)] for i in range(8)]
    gen8 = generate(eng, prompts, 8)
    for p, row in zip(prompts, gen8.tokens):
        assert row == generate(eng, [p], 8).tokens[0]


def test_a_ragged_batch_prefills_in_one_forward(batch_model):
    """Batched prefill: the rows of any lengths go through one forward (right-padded), each row's cache length its own
    prompt's, and its logits at every real position HF's for that prompt alone."""
    hf, eng = batch_model
    prompts = [PROMPT[:3], PROMPT, [9, 8, 7, 6, 5, 4, 3]]
    calls = []
    hook = eng.register_forward_hook(lambda m, args, kwargs, out: calls.append(args[0].shape), with_kwargs=True)
    try:
        generate(eng, prompts, 1)
    finally:
        hook.remove()
    assert calls == [torch.Size([3, len(PROMPT)])]
    cache = LatentCache.for_model(eng, max_rows=3, max_len=16)
    width = max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    with torch.inference_mode():
        out = eng(tokens, cache, lengths=torch.tensor([len(p) for p in prompts]))
    assert cache.lengths.tolist() == [len(p) for p in prompts]
    with torch.no_grad():
        for r, p in enumerate(prompts):
            assert (out[r, :len(p)] - hf(torch.tensor([p])).logits[0]).abs().max() < TOL


def test_forced_follows_the_given_path_on_every_row(batch_model):
    """Teacher-forced along HF's greedy trace through the batched decode step: every position's logits are HF's
    full-sequence logits, on each of 3 rows; position p predicts token p + 1."""
    hf, eng = batch_model
    trace = hf_generate(hf, PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + trace])).logits[0, :-1]
    seen = []
    forced(eng, [PROMPT] * 3, [trace] * 3, seen.append)
    assert [tuple(t.shape[:2]) for t in seen] == [(3, len(PROMPT))] + [(3, 1)] * (len(trace) - 1)
    got = torch.cat(seen, dim=1)
    assert (got - ref).abs().max().item() < TOL
    with pytest.raises(ValueError, match="same length"):
        forced(eng, [PROMPT, PROMPT[:-1]], [trace, trace], seen.append)


def test_forward_rows_at_different_positions(batch_model):
    """Multi-token chunk for two rows at different cache lengths; causal within the chunk."""
    hf, eng = batch_model
    a, b = PROMPT, [3, 1, 4, 1, 5]
    ca, cb = [10, 20, 30], [40, 50, 60]
    cache = LatentCache.for_model(eng, max_rows=3, max_len=16)
    with torch.inference_mode():
        eng(torch.tensor([a]), cache, torch.tensor([2]))
        eng(torch.tensor([b]), cache, torch.tensor([0]))
        out = eng(torch.tensor([cb, ca]), cache, torch.tensor([0, 2]))
    assert cache.lengths.tolist() == [len(b) + 3, 0, len(a) + 3]
    assert cache.kv.shape == (2, 3, 16, 16) and cache.pe.shape == (2, 3, 16, 8)
    with torch.no_grad():
        ref_b = hf(torch.tensor([b + cb])).logits[0, -3:]
        ref_a = hf(torch.tensor([a + ca])).logits[0, -3:]
    assert (out[0] - ref_b).abs().max() < TOL
    assert (out[1] - ref_a).abs().max() < TOL


def test_launched_steps_decode_as_steps_one_at_a_time(batch_model):
    """generate launches step k + 1 before step k's tokens reach the host (``observe`` makes it wait for each): the
    same tokens and margins either way (to fp32 rounding: a step launched before a row's end is known still holds the
    row, and CPU matmuls round by batch), where rows end at different steps (an EOS, a stop) and the step launched for
    rows already ended is dropped: no token, no progress call."""
    _, eng = batch_model
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3]]
    free = generate(eng, prompts, N_NEW).tokens
    eos = free[1][3]  # row 1 ends at its 4th token

    def stop(r, toks):
        return len(toks) == {0: 10, 2: 6}.get(r)

    def run(observe=None):
        steps, progress = [], []

        @contextlib.contextmanager
        def around(step, total):
            steps.append(step)
            yield

        gen = generate(eng, prompts, N_NEW, eos_token_id=eos, stop=stop, around=around, observe=observe,
                       progress=lambda s, t: progress.append(s))
        return gen, steps, progress

    launched, steps, progress = run()
    waited, steps_waited, progress_waited = run(observe=lambda rows, logits: None)
    assert launched.tokens == waited.tokens
    for a, b in zip(launched.margins, waited.margins):
        assert a == pytest.approx(b, abs=1e-5)
    assert [len(t) for t in launched.tokens] == [10, 4, 6]
    for r, row in enumerate(launched.tokens):
        assert row == free[r][:len(row)]
    assert progress == progress_waited == steps_waited == list(range(1, 11))
    assert steps == list(range(1, 12))  # one step launched past the last token, and dropped


def test_a_pick_launched_for_a_row_that_left_never_reaches_the_row_that_took_its_slot(batch_model):
    """Rows.launch twice before finish: the first step's picks end row b, row c joins b's slot, and the second step
    (launched while b was live) still carries b's pick for that slot: finish drops it. Rows a and c then decode as
    each does alone."""
    _, eng = batch_model
    a, b, c = PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3]
    want = {0: generate(eng, [a], 8).tokens[0], 1: generate(eng, [c], 8).tokens[0]}
    got = {0: [], 1: []}

    def take(s, t, m):
        got[s].append(t)
        return len(got[s]) >= 8

    with torch.inference_mode():
        rows = Rows(eng, 2, 32)
        slots, logits = rows.join([a, b])
        rows.advance(slots, torch.stack([t[-1] for t in logits]), take)
        first, second = rows.launch(), rows.launch()
        assert rows.finish(first, lambda s, t, m: take(s, t, m) or s == 1) == 2  # b leaves after its 2nd token
        got[1] = []
        slots, logits = rows.join([c])
        assert slots == [1]
        rows.advance(slots, logits[0][-1:], take)
        assert rows.finish(second, take) == 1  # a's pick; b's is dropped, not handed to c
        pending = rows.launch()
        while rows.free() < 2:
            launched = rows.launch()
            rows.finish(pending, take)
            pending = launched
    assert got == want


def test_progress_and_generate_errors(batch_model):
    _, eng = batch_model
    calls = []
    generate(eng, [PROMPT], 4, progress=lambda s, t: calls.append((s, t)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert isinstance(generate(eng, [PROMPT], 0), Generation)
    with pytest.raises(ValueError, match="empty"):
        generate(eng, [PROMPT, []], 4)
    with pytest.raises(ValueError, match="batch size"):
        generate(eng, [PROMPT] * 9, 4)
    with pytest.raises(ValueError, match="batch size"):
        generate(eng, [], 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(eng, [PROMPT], 128 - len(PROMPT) + 1)


# ---------------------------------------------------------------------------------------------
# config / rope / routing units
# ---------------------------------------------------------------------------------------------
V2_LITE = {  # shape fields of deepseek-ai/DeepSeek-V2-Lite config.json (legacy rope form)
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "architectures": ["DeepseekV2ForCausalLM"], "some_unknown_key": 3,
}


def test_v2_lite_rope_and_scale_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    args = ModelArgs.from_hf(V2_LITE)
    assert args.rope_type == "yarn" and args.rope_parameters["rope_theta"] == 10000
    hf_cfg = DeepseekV2Config(**{k: v for k, v in V2_LITE.items() if k != "some_unknown_key"})
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    inv, factor = rope_inv_freq(args.rope_parameters, args.qk_rope_head_dim, args.max_position_embeddings)
    assert torch.equal(inv, ref_inv) and factor == ref_factor
    assert args.softmax_scale == yarn_apply_mscale(hf_cfg.rope_parameters, hf_cfg.qk_head_dim ** -0.5)
    new_form = dict(V2_LITE)
    del new_form["rope_theta"], new_form["rope_scaling"]
    new_form["rope_parameters"] = dict(hf_cfg.rope_parameters)
    assert ModelArgs.from_hf(new_form) == args


def test_config_validation():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArgs.from_hf({**V2_LITE, "num_experts_per_tok": None})
    # no config is read as another family's, nor a routing as another's
    with pytest.raises(NotImplementedError, match="model_type='llama' is not supported"):
        ModelArgs.from_hf({**V2_LITE, "model_type": "llama"})
    with pytest.raises(NotImplementedError, match="topk_method='noaux_tc' is not supported for deepseek_v2"):
        ModelArgs.from_hf({**V2_LITE, "topk_method": "noaux_tc"})
    with pytest.raises(NotImplementedError, match="only noaux_tc"):
        ModelArgs.from_hf({**V2_LITE, "model_type": "deepseek_v3", "topk_method": "group_limited_greedy"})
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=64"):
        ModelArgs.from_hf({**V2_LITE, "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1})
    with pytest.raises(ValueError, match="num_experts_per_tok=6 > the 4 experts of topk_group=1 groups"):
        ModelArgs.from_hf({**V2_LITE, "topk_method": "group_limited_greedy", "n_group": 16, "topk_group": 1})
    v3 = ModelArgs.from_hf({**V2_LITE, "model_type": "deepseek_v3", "n_group": 8, "topk_group": 4,
                            "num_nextn_predict_layers": 1})
    assert v3.routing == "noaux_tc" and v3.num_mtp_layers == 1 and v3.rope_interleave
    with pytest.raises(NotImplementedError, match="dynamic"):
        ModelArgs.from_hf({**V2_LITE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    dense_only = ModelArgs.from_hf({**V2_LITE, "num_experts_per_tok": None, "first_k_dense_replace": 27})
    assert not any(dense_only.is_moe_layer(i) for i in range(27))


def test_norm_topk_prob_routing_sums_to_one():
    torch.manual_seed(0)
    cfg = {**BASE, **CONFIGS["q_lora-e8-k3-s0-fk2-yarn40-bias"], "norm_topk_prob": True,
           "routed_scaling_factor": 16.0}
    cfg.pop("initializer_range")
    model = Transformer(ModelArgs.from_hf(cfg))
    moe = model.layers[2].mlp
    assert isinstance(moe, MoE)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    w, idx = moe.route(torch.randn(10, 48))
    assert w.dtype == torch.float32 and idx.shape == (10, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(10))
    moe.norm_topk_prob = False  # HF-native semantics: scaled softmax probabilities
    w2, _ = moe.route(torch.randn(10, 48))
    assert (w2.sum(-1) <= 16.0 + 1e-5).all() and not torch.allclose(w2.sum(-1), torch.ones(10))


def test_bf16_load_keeps_router_fp32(batch_model, tmp_path):
    hf, _ = batch_model
    ckpt = write_checkpoint(tmp_path / "bf16", hf, per_expert_state_dict(hf))
    eng = load_model(ckpt, dtype=torch.bfloat16)
    assert eng.layers[1].mlp.gate.weight.dtype == torch.float32
    assert eng.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    gen = generate(eng, [PROMPT, PROMPT[:3]], 4)
    assert [len(t) for t in gen.tokens] == [4, 4]


# ---------------------------------------------------------------------------------------------
# loading errors
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_hf():
    return hf_model(CONFIGS["q_direct-e4-k2-s1-fk1-tied"])


def test_missing_tensor(small_hf, tmp_path):
    sd = per_expert_state_dict(small_hf)
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    ckpt = write_checkpoint(tmp_path, small_hf, sd)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        load_model(ckpt)


def test_unexpected_and_misshapen_tensor(small_hf, tmp_path):
    sd = per_expert_state_dict(small_hf)
    ckpt = write_checkpoint(tmp_path / "extra", small_hf, {**sd, "model.layers.0.bogus.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.bogus\.weight'"):
        load_model(ckpt)
    sd["model.norm.weight"] = torch.ones(47)
    ckpt = write_checkpoint(tmp_path / "shape", small_hf, sd)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape"):
        load_model(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(small_hf, tmp_path, damage):
    ckpt = write_checkpoint(tmp_path, small_hf, per_expert_state_dict(small_hf))
    path = os.path.join(ckpt, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"\x13\x37" * 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(ckpt)


def test_missing_files(small_hf, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    small_hf.config.to_json_file(os.path.join(tmp_path, "config.json"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)
    ckpt = write_checkpoint(tmp_path / "sharded", small_hf, per_expert_state_dict(small_hf), shards=2)
    os.remove(os.path.join(ckpt, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(ckpt)


def test_v3_multi_token_prediction_layers_are_skipped_and_the_router_stays_fp32(tmp_path):
    """A V3 checkpoint may hold its MTP layers (numbered after the model's own): not read, not run, as transformers
    runs DeepseekV3ForCausalLM; the same tensors without num_mtp_layers are refused. The score correction bias is
    fp32 in a bf16 engine, as the router weight is."""
    hf = hf_model(CONFIGS["v3-q_lora-e8-g4-t2-k3-interleave"])
    layers = hf.config.num_hidden_layers
    mtp = {f"model.layers.{layers}.{k[len('model.layers.0.'):]}": v for k, v in hf.state_dict().items()
           if k.startswith("model.layers.0.")}
    hf.config.num_mtp_layers = 1
    ckpt = write_checkpoint(tmp_path / "mtp", hf, {**hf.state_dict(), **mtp}, shards=2)
    eng = load_model(ckpt)
    assert eng.args.num_mtp_layers == 1 and len(eng.layers) == layers
    with torch.no_grad():
        assert (engine_prefill(eng, PROMPT) - hf(torch.tensor([PROMPT])).logits).abs().max() < TOL
    hf.config.num_mtp_layers = 0
    with pytest.raises(CheckpointError, match=f"unexpected tensor 'model.layers.{layers}."):
        load_model(write_checkpoint(tmp_path / "no-mtp", hf, {**hf.state_dict(), **mtp}))
    low = load_model(tmp_path / "mtp", dtype=torch.bfloat16)
    gate = low.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)

