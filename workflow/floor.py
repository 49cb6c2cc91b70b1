"""The floor of a decode step: the bytes it must read over the copy bandwidth measured on the same device.

A step reads every weight once, but only the batch's embedding rows and the k routed experts a MoE layer that
identical rows choose, plus the latent cache; the profile stage sets this against the captured steps' kernel time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from workflow.checkpoints import DTYPES


def step_bytes(ckpt: Path, dtype: torch.dtype, batch: int, positions: int) -> dict:
    """The least a decode step of `batch` identical rows reads, by part, from the checkpoint's config alone (a
    model on the meta device holds no memory). Router gates are fp32, as the engine keeps them."""
    from engine.config import ModelArgs
    from engine.model import MoE, Transformer

    args = ModelArgs.load(str(ckpt))
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
                    "rows route alike) and the latent cache at the captured steps' middle position, over the "
                    "measured device-to-device copy bandwidth"}
    if kernel_us_per_step:
        out["floor_fraction"] = out["floor_us"] / kernel_us_per_step
    return out
