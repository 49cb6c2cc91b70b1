"""DeepSeek-V2 and DeepSeek-V3: the MLA family (engine/model.py, engine.config.ModelArgs).

The engine runs every decode path and backend on it, so a campaign has nothing of this family to refuse; the
checkpoint keeps the original per-expert names; the overlap screen finds no compressor to screen.
"""

from __future__ import annotations

import dataclasses

from evident.engine.config import ModelArgs
from evident.workflow.models.families.family import HF_ONLY, Family

# model_type -> transformers' native class
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
KEYS = frozenset({f.name for f in dataclasses.fields(ModelArgs)} | HF_ONLY)
MTP_SKIP = ("DeepSeek-V3's multi-token-prediction layers (num_mtp_layers): greedy decoding runs without them, as "
            "transformers' DeepseekV3ForCausalLM does; neither the engine nor the oracle reads them")
# DeepSeek-V4's compressor fields (transformers' DeepseekV4Config): a config of this family states them only as a
# V4-style config under no model_type of its own, whose screened projections are then read as it states them
COMPRESSOR_FIELDS = ("compress_rates", "compress_ratios")
SCREENED_FIELDS = ("hidden_size", "head_dim", "index_head_dim", "index_n_heads", "q_lora_rank")


def parameters(a: ModelArgs) -> int:
    """Parameters of transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: embedding, MLA, dense and MoE
    layers, the head."""
    h, heads, layers = a.hidden_size, a.num_attention_heads, a.num_hidden_layers
    bias = int(a.attention_bias)
    kv_a = a.kv_lora_rank + a.qk_rope_head_dim
    q = (h * heads * a.qk_head_dim if a.q_lora_rank is None
         else (h + bias + 1) * a.q_lora_rank + a.q_lora_rank * heads * a.qk_head_dim)
    attention = (q + (h + bias) * kv_a + a.kv_lora_rank + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
                 + heads * a.v_head_dim * h + bias * h)

    def mlp(inter: int) -> int:
        return 3 * h * inter + int(a.mlp_bias) * (2 * inter + h)

    moe = a.n_routed_experts * (3 * h * a.moe_intermediate_size + h) + mlp(a.moe_intermediate_size * (a.n_shared_experts or 0))
    dense = min(a.first_k_dense_replace, layers)
    embed = a.vocab_size * h
    return (embed + layers * (attention + 2 * h) + dense * mlp(a.intermediate_size) + (layers - dense) * moe + h
            + (0 if a.tie_word_embeddings else embed))


def saved_state(model, tied: bool) -> dict:
    """transformers' state dict with its packed expert tensors (gate_up_proj [n, 2I, H], gate first; down_proj
    [n, H, I]) cut into the per-expert tensors of the original checkpoints; a tied lm_head is left out."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        elif not (tied and name == "lm_head.weight"):
            out[name] = t
    return out


def audit(a: ModelArgs) -> dict:
    """The kernel audit's shapes: the K of every projection the engine's kernels see (hidden_size, kv_lora_rank,
    the output projection's heads * v_head_dim, the experts' and the dense MLP's down, q_lora_rank, the shared
    experts' down), the vocabulary and the routed experts (hidden, moe_intermediate, n_routed_experts, experts per
    token; None without them). Every kernel kernels/audit.py covers applies: nothing more is left uncovered."""
    ks = [a.hidden_size, a.kv_lora_rank, a.num_attention_heads * a.v_head_dim, a.moe_intermediate_size,
          a.intermediate_size]
    if a.q_lora_rank:
        ks.append(a.q_lora_rank)
    if a.n_shared_experts:
        ks.append(a.moe_intermediate_size * a.n_shared_experts)
    experts = ((a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok)
               if a.n_routed_experts else None)
    return {"k": sorted(set(ks)), "vocab": a.vocab_size, "experts": experts, "options": {}, "not_covered": {}}


def layout(a: ModelArgs, dtype) -> dict:
    """bench.floor.Layout's fields (engine.model.Transformer on the meta device; router gates fp32, as the engine
    keeps them). The cache a row reads at P positions: every layer's latent cache, P x (kv_lora_rank +
    qk_rope_head_dim)."""
    from evident.engine.model import MoE, Transformer
    from evident.engine.tensors import on_meta

    with on_meta():
        model = Transformer(a)
    size = lambda name, p: p.numel() * (4 if name.endswith(".gate.weight") else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    experts = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    table = 0 if a.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    per_position = a.num_hidden_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * dtype.itemsize
    return dict(weights=sum(size(n, p) for n, p in params.items()) - routed - table, per_row=0,
                row=a.hidden_size * dtype.itemsize,
                expert=[sum(size(n, p) for n, p in next(iter(m.experts.values())).named_parameters())
                        for m in experts],
                top_k=a.num_experts_per_tok, n_experts=a.n_routed_experts,
                cache_row=lambda positions: positions * per_position,
                head=a.vocab_size * a.hidden_size * dtype.itemsize,
                screen=a.vocab_size * (a.hidden_size + 8))


def overlap_fields(hf_config: dict) -> dict | None:
    """None: an MLA attention has no compressor. A config stating the compressor fields (COMPRESSOR_FIELDS) is
    screened as it states them; ValueError where it leaves one of the screened projections' fields out."""
    if all(hf_config.get(f) is None for f in COMPRESSOR_FIELDS):
        return None
    missing = [f for f in SCREENED_FIELDS if hf_config.get(f) is None]
    if missing:
        raise ValueError(f"checkpoint.config has compressor fields but not {', '.join(missing)}: the screened "
                         "shapes cannot be derived")
    return {f: hf_config[f] for f in SCREENED_FIELDS}


FAMILY = Family(
    name="DeepSeek-V2/V3", architectures=ARCHITECTURES, args=ModelArgs.from_hf, tiny="tiny", keys=KEYS,
    problems=lambda config: [], parameters=parameters, saved_state=saved_state, pads_values=True, mtp_skip=MTP_SKIP,
    audit=audit, layout=layout, overlap_fields=overlap_fields, own_layer=None)
