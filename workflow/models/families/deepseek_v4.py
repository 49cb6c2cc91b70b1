"""DeepSeek-V4 (engine/deepseek_v4.py, engine.config.V4Args: transformers' DeepseekV4Config).

The engine runs it on one device, through its torch and graph paths (`problems` refuses the rest); the checkpoint
holds DeepSeek's own names (what transformers' save_pretrained writes); the overlap screen runs a C4 (compressed
sparse attention) layer's own auxiliary GEMVs, with its weights.
"""

from __future__ import annotations

import dataclasses

from evident.engine.config import CSA, HASH_MOE, HCA, SLIDING, V4, V4Args
from evident.workflow.models.families.family import HF_ONLY, Family
from evident.workflow.plan import runs

ARCHITECTURES = {V4: "DeepseekV4ForCausalLM"}
# DeepseekV4Config's legacy keys (folded into layer_types, compress_rates, mlp_layer_types, partial_rotary_factor by
# its __post_init__, as V4Args.from_hf folds them) and its training-only fields
HF_LEGACY = {"compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
             "router_aux_loss_coef", "router_jitter_noise"}
KEYS = frozenset({f.name for f in dataclasses.fields(V4Args)} | HF_ONLY | HF_LEGACY)
MTP_SKIP = ("DeepSeek-V4's multi-token-prediction module (mtp.*, num_nextn_predict_layers): greedy decoding runs "
            "without it, as transformers' DeepseekV4ForCausalLM does; neither the engine nor the oracle reads it")
NOT_COVERED = {
    "DeepSeek-V4 attention (sliding window with sinks, compressors, lightning indexer scores and top-k)":
        "no kernel in kernels/: the engine runs it as torch ops",
    "DeepSeek-V4 hyper-connections' collapse and merge, and the hyper head": "no kernel in kernels/: torch ops",
    "DeepSeek-V4 hash router (tid2eid) and sqrtsoftplus top-k router": "no kernel in kernels/: torch ops",
}
HC_WEIGHTS = "DeepSeek-V4 hyper-connection weights (Sinkhorn)"  # not covered where kernels.audit has no hc_weights


def problems(config: dict) -> list[tuple[str, str]]:
    """What the engine cannot run on a DeepSeek-V4 model, for the stages that would run it: expert parallelism
    (engine.checkpoint.load_model runs V4 on one device) and the `triton` decode path (engine/decode_kernels.py
    knows the MLA model's projections only); and what transformers cannot (bench `hf-static`: its static cache;
    the hf paths' distinct prompts: its left-padded rows).
    What the model itself cannot be (mlp_bias, ...) V4Args refuses when the campaign's model is read; the `graph`
    path is the engine's to accept or refuse."""
    stages, out = set(config["stages"]), []
    for section, stage in (("parity", "parity"), ("bench", "bench")):
        ep = [b for b in config[section]["backends"] if b in runs.EP_BACKENDS]
        if stage in stages and ep:
            keep = ["single"] + (["hf"] if section == "bench" else [])
            out.append((f"{section}.backends", f"{', '.join(ep)}: the engine runs DeepSeek-V4 on one device, without "
                                               f"expert parallelism; keep {' and '.join(keep)}"))
    if "parity" in stages and "triton" in config["parity"]["kernels"]:
        out.append(("parity.kernels", "triton: the engine's Triton decode path (engine/decode_kernels.py) covers the "
                                      "DeepSeek-V2/V3 model, not DeepSeek-V4; use torch (and graph)"))
    if "bench" in stages and "hf-static" in config["bench"]["backends"]:
        out.append(("bench.backends", "hf-static: transformers' static cache does not take DeepSeek-V4's layer types "
                                      "(transformers 5.24 fails on heavily_compressed_attention); use hf or hf-grouped"))
    if {"bench", "profile"} & stages and config["bench"]["kernels"] == "triton":
        out.append(("bench.kernels", "triton: the engine's Triton decode path (engine/decode_kernels.py) covers the "
                                     "DeepSeek-V2/V3 model, not DeepSeek-V4 (the benchmark and the profile time this "
                                     "path); use torch or graph"))
    hf = [b for b in config["bench"]["backends"] if b in runs.HF_PATHS]
    if "bench" in stages and hf and config["bench"].get("prompts"):
        out.append(("bench.prompts", f"{', '.join(hf)}: transformers' DeepSeek-V4 decodes a left-padded row otherwise "
                                     "than the same prompt alone (its compressors pool the padding: a decisive "
                                     "difference by the fourth token on the tiny model), so its distinct-prompts cells "
                                     "would fail their rows check; bench the distinct prompts on the engine alone "
                                     "(drop the hf paths from bench.backends) or leave bench.prompts out"))
    return out


def parameters(a: V4Args) -> int:
    """DeepSeek-V4's checkpoint tensors (transformers' DeepseekV4ForCausalLM: parameters and the tid2eid buffers),
    per layer:

        attention   q_a (h*q), its norm (q), q_b (q*H*d), kv (h*d), its norm (d), the grouped output projection
                    (o_a: H*d*o_lora, o_b: g*o_lora*h), sinks (H)
        compressor  CSA (rate m, overlapping windows): kv and gate h*2d each, position bias m*2d, norm d; its
                    indexer the same at index_head_dim c (h*2c twice, m*2c, c), q_b (q*n_I*c), weights_proj (h*n_I);
                    HCA: kv and gate h*d each, position bias m*d, norm d; sliding layers none
        MoE         the router (E*h) and its correction bias (E) or, hash layers, tid2eid (vocab*k); E routed experts
                    (3*h*I each) and one shared expert of moe_intermediate_size I (biases with mlp_bias)
        the rest    2 norms (2h), 2 hyper-connections ((2+n)*n * n*h + (2+n)*n + 3 each, n = hc_mult)

    and the embedding, the final norm, the hyper head (n * n*h + n + 1) and lm_head (unless tied)."""
    h, H, d, q, n = a.hidden_size, a.num_attention_heads, a.head_dim, a.q_lora_rank, a.hc_mult
    E, I, c, nI = a.n_routed_experts, a.moe_intermediate_size, a.index_head_dim, a.index_n_heads
    attention = (h * q + q + q * H * d + h * d + d + H * d * a.o_lora_rank + a.o_groups * a.o_lora_rank * h + H)
    hc = (2 + n) * n * n * h + (2 + n) * n + 3
    shared = 3 * h * I + int(a.mlp_bias) * (2 * I + h)
    total = 0
    for i, (kind, mlp) in enumerate(zip(a.layer_types, a.mlp_layer_types)):
        m = a.ratio(i)
        compressor = {CSA: 2 * h * 2 * d + m * 2 * d + d + 2 * h * 2 * c + m * 2 * c + c + q * nI * c + h * nI,
                      HCA: 2 * h * d + m * d + d}.get(kind, 0)
        router = E * h + (a.vocab_size * a.num_experts_per_tok if mlp == HASH_MOE else E)
        total += attention + compressor + router + E * 3 * h * I + shared + 2 * h + 2 * hc
    embed = a.vocab_size * h
    return total + embed + h + n * n * h + n + 1 + (0 if a.tie_word_embeddings else embed)


def saved_state(model, tied: bool) -> dict:
    """What save_pretrained writes (transformers' revert_weight_conversion: DeepSeek's own names, per-expert
    w1/w2/w3), which from_pretrained converts back; a tied lm_head left out."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return revert_weight_conversion(model, state)


def audit(a: V4Args) -> dict:
    """The kernel audit at V4's shapes: the Ks of its projections (hidden_size: q_a, kv, the compressors' and
    indexer's projections, weights_proj, the router, the shared expert's gate/up; q_lora_rank: q_b and the indexer's
    q_b; num_attention_heads * head_dim / o_groups: a group of the grouped o_a; o_groups * o_lora_rank: o_b;
    moe_intermediate_size: the experts' down; hc_mult * hidden_size: the hyper-connections' mixes), its vocabulary,
    its routed experts (hidden, moe_intermediate, n_routed_experts, experts per token) with the swiglu clamp and its
    hyper-connection weights kernel (hc_mult, hc_sinkhorn_iters), as `options` where kernels.audit.audit takes them.
    Its attention (sliding window with sinks, the compressors, the lightning indexer's scores and top-k), the
    hyper-connections' collapse and merge and the hyper head, and the routers have no kernel in kernels/ (the engine
    runs them as torch ops): NOT_COVERED, with HC_WEIGHTS where kernels.audit does not compile that kernel."""
    import inspect

    from evident.kernels.audit import COVERED
    from evident.kernels.audit import audit as compile_audit

    h = a.hidden_size
    ks = [h, a.q_lora_rank, a.num_attention_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank,
          a.moe_intermediate_size, a.hc_mult * h]
    takes = inspect.signature(compile_audit).parameters
    options = {"limit": float(a.swiglu_limit), "hc": (a.hc_mult, a.hc_sinkhorn_iters)}
    hc = {} if "hc_weights" in COVERED else {HC_WEIGHTS: "not compiled by kernels/audit.py"}
    return {"k": sorted(set(ks)), "vocab": a.vocab_size,
            "experts": (h, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok),
            "options": {k: v for k, v in options.items() if k in takes}, "not_covered": {**NOT_COVERED, **hc}}


def layout(a: V4Args, dtype) -> dict:
    """bench.floor.Layout's fields (engine.deepseek_v4.V4Transformer on the meta device): the tensors the engine
    keeps in fp32 (engine.v4_checkpoint.FP32: norms, sinks, position biases, hyper-connections, the router) at 4
    bytes, the rest in `dtype`; a hash layer reads its tid2eid row per row (k int64 ids) instead of the router's
    scores' top-k, the top-k layers the router and their score correction bias (fp32, with the weights); the cache by
    `cache_bytes`."""
    from evident.engine.deepseek_v4 import V4Transformer
    from evident.engine.tensors import on_meta
    from evident.engine.v4_checkpoint import FP32

    with on_meta():
        model = V4Transformer(a)
    size = lambda name, t: t.numel() * (4 if FP32.search(name) else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    bias = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    table = 0 if a.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    return dict(weights=sum(size(n, p) for n, p in params.items()) - routed - table
                + sum(4 * b.numel() for b in bias.values()),
                per_row=sum(t == HASH_MOE for t in a.mlp_layer_types) * a.num_experts_per_tok * 8,
                row=a.hidden_size * dtype.itemsize,
                expert=[3 * a.hidden_size * a.moe_intermediate_size * dtype.itemsize] * a.num_hidden_layers,
                top_k=a.num_experts_per_tok, n_experts=a.n_routed_experts,
                cache_row=lambda positions: cache_bytes(a, positions, dtype.itemsize))


def cache_bytes(a: V4Args, positions: int, itemsize: int) -> int:
    """The cache one row reads in a decode step at `positions`: every layer's sliding window, min(P, sliding_window)
    keys of head_dim (K = V: one shared head); a compressed layer of rate m its compressed entries so far, P // m of
    head_dim (a CSA layer attends to the indexer's index_topk of them only, min(index_topk, P // m), but its indexer
    scores all P // m indexer entries of index_head_dim); and the source tokens each compressor (and indexer) pools
    into the entry a window's last token closes: kv and gate, span x head each (span = 2m for CSA's overlapping
    windows, of which the pooling reads one half of each token's 2 x head; m for HCA), read once every m steps,
    counted as 1/m of them a step."""
    d, c, n = a.head_dim, a.index_head_dim, 0
    for i, kind in enumerate(a.layer_types):
        n += min(positions, a.sliding_window) * d
        if kind == SLIDING:
            continue
        m = a.ratio(i)
        entries = positions // m
        span = 2 * m if kind == CSA else m
        if kind == CSA:  # attends to the indexer's top-k entries; the indexer scores all of its own
            n += min(a.index_topk, entries) * d + entries * c + 2 * span * c / m
        else:
            n += entries * d
        n += 2 * span * d / m  # the compressor's pooled window, once every m steps
    return int(n * itemsize)


def overlap_fields(hf_config: dict) -> dict | None:
    """The screened projections' fields, read as the engine reads the config (transformers' defaults for absent
    fields, the layer schedule derived): None when none of its layers is a C4 (compressed sparse attention) layer."""
    a = V4Args.from_hf(hf_config)
    if CSA not in a.layer_types:
        return None
    return {f: getattr(a, f) for f in ("hidden_size", "head_dim", "index_head_dim", "index_n_heads", "q_lora_rank")}


def own_layer(ckpt, hf_config: dict, dtype) -> tuple[dict, tuple]:
    """The first C4 layer's own weights, as the engine's graph step runs them: the auxiliary rows joined in launch
    order (compressor kv_proj, gate_proj; indexer kv_proj, gate_proj, weights_proj) and the GEMM's (q_a_proj,
    kv_proj), in the torch `dtype`. (record, (w, wg))."""
    import torch

    from evident.engine.checkpoint import read_tensors
    from evident.engine.v4_checkpoint import engine_name

    layer = V4Args.from_hf(hf_config).layer_types.index(CSA)
    at, c, i = f"layers.{layer}.self_attn", f"layers.{layer}.self_attn.compressor", \
        f"layers.{layer}.self_attn.compressor.indexer"
    aux = [f"{c}.kv_proj", f"{c}.gate_proj", f"{i}.kv_proj", f"{i}.gate_proj", f"{i}.scorer.weights_proj"]
    main = [f"{at}.q_a_proj", f"{at}.kv_proj"]
    want = {n + ".weight" for n in aux + main}
    tensors = read_tensors(str(ckpt), skip=lambda name: engine_name(name) not in want)[0]
    by = {key: t for key, t in ((engine_name(k), t) for k, t in tensors.items()) if key in want}
    w = torch.cat([by[n + ".weight"] for n in aux]).to(dtype)
    wg = torch.cat([by[n + ".weight"] for n in main]).to(dtype)
    return {"layer": layer, "aux": aux, "gemm": main}, (w, wg)


FAMILY = Family(
    name="DeepSeek-V4", architectures=ARCHITECTURES, args=V4Args.from_hf, tiny="deepseek-v4-tiny", keys=KEYS,
    problems=problems, parameters=parameters, saved_state=saved_state, pads_values=False, mtp_skip=MTP_SKIP,
    audit=audit, layout=layout, overlap_fields=overlap_fields, own_layer=own_layer)
