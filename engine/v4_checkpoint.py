"""DeepSeek-V4 checkpoints into the engine's V4Transformer.

A checkpoint may name its tensors as DeepSeek ships them (``layers.0.attn.wq_a.weight``, ``embed.weight``,
``layers.0.ffn.experts.3.w1.weight``; what transformers' ``save_pretrained`` writes, with or without ``model.``)
or as transformers' modules do (``layers.0.self_attn.q_a_proj.weight``, packed ``mlp.experts.gate_up_proj``).
``RENAMES`` are transformers' own renamings of the first into the second (its ``conversion_mapping``), in its order;
each is a no-op on a name already in the second form. The per-expert w1 (gate), w3 (up) and w2 (down) are stacked
as transformers stacks them. The multi-token-prediction module (``mtp.*``) is not read.
"""
from __future__ import annotations

import re

import torch

from .config import CheckpointError, V4Args
from .deepseek_v4 import V4Transformer
from .tensors import mtp_tensor, on_meta, read_tensors, seated

RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
# kept in fp32 whatever the model's dtype: transformers' _keep_in_fp32_modules_strict, and the router (fp32 here)
FP32 = re.compile(r"(norm\.weight|\.sinks|position_bias|_hc\.(fn|base|scale)|^hc_head\.\w+|mlp\.gate\.weight"
                  r"|e_score_correction_bias)$")
INTEGER = re.compile(r"mlp\.gate\.tid2eid$")


def files_of(where: dict) -> str:
    return ", ".join(sorted(set(where.values())))


def engine_name(name: str) -> str:
    key = name[len("model."):] if name.startswith("model.") else name
    for pattern, to in RENAMES:
        key = pattern.sub(to, key)
    return key


def load_v4(ckpt_dir: str, args: V4Args, device, dtype: torch.dtype) -> V4Transformer:
    with on_meta():
        model = V4Transformer(args)
    expected = {k: v for k, v in model.state_dict().items() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    tensors, where = read_tensors(ckpt_dir, lambda n: mtp_tensor(n, args))
    sd, src, experts = {}, {}, {}
    for name, t in tensors.items():
        if mtp_tensor(name, args):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # DeepSeek's released V4 weights are FP8 + scales
            raise CheckpointError(f"{where[name]}: tensor {name!r} is {t.dtype}: FP8 checkpoints are not read here "
                                  "(dequantize to bf16 first)")
        key = engine_name(name)
        if args.tie_word_embeddings and key == "lm_head.weight":
            continue
        m = _EXPERT.match(key)
        if m and int(m.group(2)) < args.n_routed_experts:
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = (t, name)
            continue
        sd[key], src[key] = t, name
    for prefix, parts in experts.items():  # stacked as transformers' MergeModulelist + Concatenate
        n = args.n_routed_experts
        missing = [f"{prefix}.{e}.{w}.weight" for e in range(n) for w in ("w1", "w2", "w3") if (e, w) not in parts]
        if missing:
            raise CheckpointError(f"{where[parts[next(iter(parts))][1]]}: missing tensor {missing[0]!r}")
        I, D = args.moe_intermediate_size, args.hidden_size
        for (e, w), (t, name) in parts.items():
            if tuple(t.shape) != ((D, I) if w == "w2" else (I, D)):
                raise CheckpointError(f"{where[name]}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                      f"{(D, I) if w == 'w2' else (I, D)}")
        if f"{prefix}.gate_up_proj" in sd or f"{prefix}.down_proj" in sd:
            raise CheckpointError(f"{files_of(where)}: {prefix} holds both packed and per-expert tensors")
        sd[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "w1"][0], parts[e, "w3"][0]]) for e in range(n)])
        sd[f"{prefix}.down_proj"] = torch.stack([parts[e, "w2"][0] for e in range(n)])
        src[f"{prefix}.gate_up_proj"] = src[f"{prefix}.down_proj"] = parts[0, "w1"][1]
    files = files_of(where) or ckpt_dir
    for k in expected:
        if k not in sd:
            raise CheckpointError(f"{files}: missing tensor {k!r} (transformers' name, without 'model.')")
    for k, t in list(sd.items()):
        file = where[src[k]]
        if k not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {src[k]!r}")
        if t.shape != expected[k].shape:
            raise CheckpointError(f"{file}: tensor {src[k]!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(expected[k].shape)}")
        if INTEGER.search(k):
            if t.is_floating_point() or t.numel() and not 0 <= int(t.min()) <= int(t.max()) < args.n_routed_experts:
                raise CheckpointError(f"{file}: tensor {src[k]!r} must hold expert ids in 0..{args.n_routed_experts - 1}")
            sd[k] = t.to(device=device, dtype=torch.long, copy=True)
            continue
        if not t.is_floating_point():
            raise CheckpointError(f"{file}: tensor {src[k]!r} has non-float dtype {t.dtype}")
        sd[k] = t.to(device=device, dtype=torch.float32 if FP32.search(k) else dtype, copy=True)
    return seated(model, sd, args)
