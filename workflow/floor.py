"""The floor of a decode step: the bytes it must read over the copy bandwidth measured on the same device.

A step reads every weight once, but only the batch's embedding rows and the k routed experts a MoE layer that
identical rows choose, plus the cache; the profile stage sets this against the captured steps' kernel time.

The cache a step reads, per row, at P positions (`cache_bytes`):
- DeepSeek-V2/V3 (MLA): every layer's latent cache, P x (kv_lora_rank + qk_rope_head_dim).
- DeepSeek-V4: every layer's sliding window, min(P, sliding_window) keys of head_dim (K = V: one shared head);
  a compressed layer of rate m its compressed entries so far, P // m of head_dim (a CSA layer attends to the
  indexer's index_topk of them only, min(index_topk, P // m), but its indexer scores all P // m indexer entries of
  index_head_dim); and the source tokens each compressor (and indexer) pools into the entry a window's last token
  closes: kv and gate, span x head each (span = 2m for CSA's overlapping windows, of which the pooling reads one
  half of each token's 2 x head; m for HCA), read once every m steps, counted as 1/m of them a step.
A V4 hash layer's routing reads its tid2eid row per row (k int64 ids) instead of the router's scores' top-k; the
top-k layers read the router and their score correction bias (fp32, with the weights).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from workflow.checkpoints import DTYPES


def step_bytes(ckpt: Path, dtype: torch.dtype, batch: int, positions: int) -> dict:
    """The least a decode step of `batch` identical rows reads, by part, from the checkpoint's config alone (a
    model on the meta device holds no memory). Router gates are fp32, as the engine keeps them."""
    from engine.config import V4, load_args
    from engine.model import MoE, Transformer

    args = load_args(str(ckpt))
    if args.model_type == V4:
        return v4_step_bytes(args, dtype, batch, positions)
    with torch.device("meta"):
        model = Transformer(args)
    size = lambda name, p: p.numel() * (4 if name.endswith(".gate.weight") else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    experts = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    chosen = sum(m.top_k * sum(size(n, p) for n, p in next(iter(m.experts.values())).named_parameters())
                 for m in experts)
    table = 0 if args.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    rows = batch * args.hidden_size * dtype.itemsize
    cache = args.num_hidden_layers * batch * positions * (args.kv_lora_rank + args.qk_rope_head_dim) * dtype.itemsize
    weights = sum(size(n, p) for n, p in params.items()) - routed - table
    return {"weights": weights, "chosen_experts": chosen, "embedding_rows": rows, "cache": cache,
            "total": weights + chosen + rows + cache}


def v4_step_bytes(args, dtype: torch.dtype, batch: int, positions: int) -> dict:
    """step_bytes of a DeepSeek-V4 model (engine.deepseek_v4.V4Transformer, on the meta device): the tensors the
    engine keeps in fp32 (engine.v4_checkpoint.FP32: norms, sinks, position biases, hyper-connections, the router)
    at 4 bytes, the rest in `dtype`; the cache by `cache_bytes` (module docstring)."""
    from engine.deepseek_v4 import V4Transformer
    from engine.v4_checkpoint import FP32

    with torch.device("meta"):
        model = V4Transformer(args)
    size = lambda name, t: t.numel() * (4 if FP32.search(name) else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    bias = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    expert = 3 * args.hidden_size * args.moe_intermediate_size * dtype.itemsize
    chosen = args.num_hidden_layers * args.num_experts_per_tok * expert
    table = 0 if args.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    rows = batch * args.hidden_size * dtype.itemsize
    hashed = sum(t == "hash_moe" for t in args.mlp_layer_types) * batch * args.num_experts_per_tok * 8
    weights = (sum(size(n, p) for n, p in params.items()) - routed - table + sum(4 * b.numel() for b in bias.values())
               + hashed)
    cache = batch * cache_bytes(args, positions, dtype.itemsize)
    return {"weights": weights, "chosen_experts": chosen, "embedding_rows": rows, "cache": cache,
            "total": weights + chosen + rows + cache}


def cache_bytes(args, positions: int, itemsize: int) -> int:
    """The cache one DeepSeek-V4 row reads in a decode step at `positions` (module docstring)."""
    from engine.config import CSA, SLIDING

    d, c, n = args.head_dim, args.index_head_dim, 0
    for i, kind in enumerate(args.layer_types):
        n += min(positions, args.sliding_window) * d
        if kind == SLIDING:
            continue
        m = args.ratio(i)
        entries = positions // m
        span = 2 * m if kind == CSA else m
        if kind == CSA:  # attends to the indexer's top-k entries; the indexer scores all of its own
            n += min(args.index_topk, entries) * d + entries * c + 2 * span * c / m
        else:
            n += entries * d
        n += 2 * span * d / m  # the compressor's pooled window, once every m steps
    return int(n * itemsize)


def copy_bandwidth(device: str, mib: int = 512) -> float:
    """Bytes per second of a device-to-device copy (read plus write), the median of 10 after a warm-up."""
    n = (mib << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)
    return 2 * src.numel() * 4 / sorted(times)[len(times) // 2]


def floor(ckpt: Path, dtype: str, batch: int, steps: int, prompt_tokens: int, device: str,
          kernel_us_per_step: float | None) -> dict:
    """The floor of `steps` captured decode steps of `batch` rows after a `prompt_tokens` prefill, in `dtype` (a
    name), against their kernel time per step (None: not measured)."""
    parts = step_bytes(ckpt, DTYPES[dtype], batch, prompt_tokens + (steps + 1) // 2)
    bw = copy_bandwidth(device, 512 if device.startswith("cuda") else 64)
    out = {"bytes": parts, "copy_bandwidth_GBps": bw / 1e9, "floor_us": parts["total"] / bw * 1e6,
           "kernel_us_per_step": kernel_us_per_step,
           "basis": "every weight read once, the batch's embedding rows, top_k routed experts a MoE layer (identical "
                    "rows route alike) and the cache (MLA: the latent cache; DeepSeek-V4: sliding window, "
                    "compressed and indexer entries, the compressors' pooled windows: workflow/floor.py) at the "
                    "captured steps' middle position, over the measured device-to-device copy bandwidth"}
    if kernel_us_per_step:
        out["floor_fraction"] = out["floor_us"] / kernel_us_per_step
    return out
