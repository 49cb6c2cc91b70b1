"""Load HF-format DeepSeek-V2 safetensors checkpoints into the engine's Transformer.

Accepted tensor names (HF): ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight`` (dense), ``model.layers.{i}.mlp.gate.weight``,
routed experts either per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what hub checkpoints and
``save_pretrained`` write) or packed (transformers-5 ``mlp.experts.gate_up_proj`` [E, 2I, H], gate first,
and ``mlp.experts.down_proj`` [E, H, I], what ``state_dict()`` holds), ``mlp.shared_experts.*``,
``model.norm.weight``, ``lm_head.weight``. Single ``model.safetensors`` or sharded via
``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import re

import torch

from . import decode_kernels, graph_decode
from .config import V4, CheckpointError, ModelArgs, load_args
from .model import Transformer
from .parallel import ExpertParallel
from .tensors import mtp_tensor, on_meta, read_tensors, seated
from .v4_checkpoint import load_v4

_PACKED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_ROUTED = re.compile(r"^(?:model\.)?layers\.\d+\.mlp\.experts\.(\d+)\.")  # one routed expert's tensor
FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router, fp32 whatever the model's dtype


def eos_ids(ckpt_dir: str | os.PathLike) -> list[int]:
    """The checkpoint's end-of-sequence ids: generation_config.json's, else config.json's; [] when neither says."""
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(ckpt_dir, name)
        if os.path.isfile(p):
            with open(p) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return eos if isinstance(eos, list) else [eos]
    return []


def mtp_tensors(ckpt_dir: str | os.PathLike) -> list[str]:
    """The names of a checkpoint's multi-token-prediction tensors (from the file headers: no tensor data is read)."""
    args = load_args(ckpt_dir)
    return sorted(n for n in read_tensors(os.fspath(ckpt_dir), skip=lambda name: True)[0] if mtp_tensor(n, args))


def _to_engine_names(tensors: dict[str, torch.Tensor], where: dict[str, str], args: ModelArgs):
    """HF names -> engine names (drop ``model.``, unpack packed experts, drop empty/tied extras and MTP layers)."""
    out, src = {}, {}
    for name, t in tensors.items():
        if mtp_tensor(name, args):
            continue  # a multi-token-prediction layer's: not read
        file = where[name]
        key = name[len("model."):] if name.startswith("model.") else name
        if args.tie_word_embeddings and key == "lm_head.weight":
            continue  # tied to embed_tokens (as HF)
        if ".shared_experts." in key and t.numel() == 0 and not args.n_shared_experts:
            continue  # HF writes zero-size shared experts when n_shared_experts == 0
        m = _PACKED.match(key)
        if m:
            prefix, kind = m.groups()
            E, I, H = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
            want = (E, 2 * I, H) if kind == "gate_up_proj" else (E, H, I)
            if tuple(t.shape) != want:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
            for e in range(E):
                if kind == "gate_up_proj":
                    parts = {"gate_proj": t[e, :I], "up_proj": t[e, I:]}
                else:
                    parts = {"down_proj": t[e]}
                for proj, w in parts.items():
                    k = f"{prefix}.{e}.{proj}.weight"
                    out[k], src[k] = w.contiguous(), (file, name)
            continue
        out[key], src[key] = t, (file, name)
    return out, src


def enable_decode_path(model, kernels: str):
    """The decode path a stage or the server runs: `torch` ops as loaded, the Triton kernels
    (engine.decode_kernels) or the CUDA-graph step (engine.graph_decode; DeepSeek-V4's engine.v4_graph); returns the
    model."""
    if kernels == "triton":
        decode_kernels.enable(model)
    elif kernels == "graph" and model.args.model_type == V4:
        from . import v4_graph  # it imports torch._dynamo, with Triton (~1.5 s): only on this path

        v4_graph.enable(model)
    elif kernels == "graph":
        graph_decode.enable(model)
    return model


def load_model(ckpt_dir, device="cpu", dtype: torch.dtype = torch.float32,
               ep: ExpertParallel | None = None) -> Transformer:
    """Build a Transformer (a V4Transformer for DeepSeek-V4) from ``ckpt_dir`` (config.json + safetensors). Router
    gates stay fp32.

    With ``ep`` only this rank's routed experts (``ep.experts(n_routed_experts)``) are read and instantiated;
    the other ranks' expert tensors are checked by name, shape and dtype but not read (packed expert tensors
    are read whole and sliced). Everything else is replicated.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    args = load_args(ckpt_dir)
    if args.model_type == V4:
        if ep is not None:
            raise CheckpointError(f"{ckpt_dir}: DeepSeek-V4 runs on one device here (no expert parallelism)")
        return load_v4(ckpt_dir, args, device, dtype)
    with on_meta():
        model = Transformer(args, ep)
        full = model if ep is None else Transformer(args)  # the whole checkpoint is still validated
    expected = {k: v for k, v in full.state_dict().items()
                if not (args.tie_word_embeddings and k == "lm_head.weight")}
    local = model.state_dict().keys()
    shard = None if ep is None else ep.experts(args.n_routed_experts)

    def elsewhere(name: str) -> bool:  # another rank's routed expert: not read
        m = _ROUTED.match(name)
        return m is not None and int(m.group(1)) not in shard

    tensors, where = read_tensors(ckpt_dir, lambda n: mtp_tensor(n, args) or (ep is not None and elsewhere(n)))
    sd, src = _to_engine_names(tensors, where, args)
    files = ", ".join(sorted(set(where.values()))) or ckpt_dir
    for k in expected:
        if k not in sd:
            hf = k if k == "lm_head.weight" else "model." + k
            raise CheckpointError(f"{files}: missing tensor {hf!r}")
    for k, t in list(sd.items()):
        file, name = src[k]
        if k not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
        if t.shape != expected[k].shape:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[k].shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{file}: tensor {name!r} has non-float dtype {t.dtype}")
        if k not in local:  # another rank's routed expert
            del sd[k]
            continue
        # copy=True: fresh, allocator-aligned storage, so numerics do not depend on the file's tensor offsets
        sd[k] = t.to(device=device, dtype=torch.float32 if k.endswith(FP32) else dtype, copy=True)
    return seated(model, sd, args)
