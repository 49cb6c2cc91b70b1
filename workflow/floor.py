"""The floor of a decode step: the bytes it must read over the read bandwidth measured on the same device
(kernels/hbm.py).

A step reads every weight once, but only the batch's embedding rows and the routed experts its rows chose, each
once however many rows chose it, plus the cache (`Layout.step`). Identical rows choose the same k experts a MoE
layer: the profile stage sets that floor (`floor`) against the captured steps' kernel time. Rows of different
prompts choose more: the bench stage counts the experts actually chosen at each decode step (workflow/replay.py)
and sets that floor against the cell's steady TPOT (`bench_floor`).

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

import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

BANDWIDTH_KEY = "read_bandwidth_GBps"  # the bandwidth a floor was set at, in a floor's record
SCREEN_READ = "the vocabulary projection read through its int8 screen"  # a floor that counts the screen says so
BANDWIDTH_MIB, CPU_BANDWIDTH_MIB = 1024, 64  # the buffer read_bandwidth reads: a CPU's floor shows the machinery only


def screened_basis(screened: bool) -> str:
    """What a floor's basis adds where the step picked through the screen (Layout.step)."""
    return f"; {SCREEN_READ} (kernels/head.py), as this path's step reads it" if screened else ""


@dataclass
class Layout:
    """What a decode step of a model reads, by part, from its config alone (a model on the meta device holds no
    memory): `step` adds it up for one step's rows and experts."""
    weights: int  # read once a step whatever the batch: every weight but the routed experts and the embedding table
    per_row: int  # read once a row beside them: a DeepSeek-V4 hash layer's tid2eid row (k int64 ids a layer)
    row: int  # one row's embedding row
    expert: list[int]  # one routed expert's bytes, per MoE layer in layer order
    top_k: int
    n_experts: int
    cache_row: Callable[[int], int]  # the cache one row reads at P positions
    head: int = 0  # the vocabulary projection's weight, within `weights`
    screen: int = 0  # its int8 screen's bytes (kernels/head.py: a byte an element, a scale and a bound a row)

    def step(self, positions: list[int], experts: list[Collection[int]] | None = None, ranks: int = 1,
             screened: bool = False) -> dict:
        """The least a step of rows at `positions` reads: the weights once, each row's embedding row and cache, and
        the routed experts: per MoE layer those the rows chose (`experts`: their union a layer), each read once
        however many rows chose it; None: top_k a layer, as identical rows choose. Over `ranks` expert-parallel
        ranks (the engine's contiguous shards: engine.parallel.ExpertParallel.experts) the busiest rank's: every
        rank reads the weights and the cache, and the chosen experts of its own shard. `screened`: the step picks
        through the vocabulary projection's screen (the engine's graph path at batch 1), which it reads in place of
        the projection's weight (the few rows it then reads in full are not counted: a floor stays below)."""
        if experts is None:
            chosen = sum(self.top_k * e for e in self.expert)
        else:
            shard = self.n_experts // ranks
            chosen = max(sum(sum(1 for e in ids if e // shard == r) * b for ids, b in zip(experts, self.expert))
                         for r in range(ranks))
        batch = len(positions)
        weights = self.weights + batch * self.per_row - (self.head - self.screen if screened else 0)
        rows, cache = batch * self.row, sum(self.cache_row(p) for p in positions)
        return {"weights": weights, "chosen_experts": chosen, "embedding_rows": rows, "cache": cache,
                "total": weights + chosen + rows + cache}


def layout(ckpt: Path, dtype: torch.dtype) -> Layout:
    """The Layout of the checkpoint's model in `dtype`. Router gates are fp32, as the engine keeps them."""
    import torch

    from evident.engine.config import V4, load_args
    from evident.engine.model import MoE, Transformer

    args = load_args(str(ckpt))
    if args.model_type == V4:
        return v4_layout(args, dtype)
    with torch.device("meta"):
        model = Transformer(args)
    size = lambda name, p: p.numel() * (4 if name.endswith(".gate.weight") else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    experts = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    table = 0 if args.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    per_position = args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * dtype.itemsize
    return Layout(weights=sum(size(n, p) for n, p in params.items()) - routed - table, per_row=0,
                  row=args.hidden_size * dtype.itemsize,
                  expert=[sum(size(n, p) for n, p in next(iter(m.experts.values())).named_parameters())
                          for m in experts],
                  top_k=args.num_experts_per_tok, n_experts=args.n_routed_experts,
                  cache_row=lambda positions: positions * per_position,
                  head=args.vocab_size * args.hidden_size * dtype.itemsize,
                  screen=args.vocab_size * (args.hidden_size + 8))


def v4_layout(args, dtype: torch.dtype) -> Layout:
    """The Layout of a DeepSeek-V4 model (engine.deepseek_v4.V4Transformer, on the meta device): the tensors the
    engine keeps in fp32 (engine.v4_checkpoint.FP32: norms, sinks, position biases, hyper-connections, the router)
    at 4 bytes, the rest in `dtype`; the cache by `cache_bytes` (module docstring)."""
    import torch

    from evident.engine.deepseek_v4 import V4Transformer
    from evident.engine.v4_checkpoint import FP32

    with torch.device("meta"):
        model = V4Transformer(args)
    size = lambda name, t: t.numel() * (4 if FP32.search(name) else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    bias = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    table = 0 if args.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    return Layout(weights=sum(size(n, p) for n, p in params.items()) - routed - table
                  + sum(4 * b.numel() for b in bias.values()),
                  per_row=sum(t == "hash_moe" for t in args.mlp_layer_types) * args.num_experts_per_tok * 8,
                  row=args.hidden_size * dtype.itemsize,
                  expert=[3 * args.hidden_size * args.moe_intermediate_size * dtype.itemsize] * args.num_hidden_layers,
                  top_k=args.num_experts_per_tok, n_experts=args.n_routed_experts,
                  cache_row=lambda positions: cache_bytes(args, positions, dtype.itemsize))


def step_bytes(ckpt: Path, dtype: torch.dtype, batch: int, positions: int, screened: bool = False) -> dict:
    """The least a decode step of `batch` identical rows at `positions` reads, by part (Layout.step)."""
    return layout(ckpt, dtype).step([positions] * batch, screened=screened)


def cache_bytes(args, positions: int, itemsize: int) -> int:
    """The cache one DeepSeek-V4 row reads in a decode step at `positions` (module docstring)."""
    from evident.engine.config import CSA, SLIDING

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


def bandwidth(device: str) -> float:
    """The read bandwidth a floor on `device` is set at, bytes/s (kernels.hbm.read_bandwidth)."""
    from evident.kernels.hbm import read_bandwidth

    return read_bandwidth(device, BANDWIDTH_MIB if device.startswith("cuda") else CPU_BANDWIDTH_MIB)


def floor(ckpt: Path, dtype: str, batch: int, steps: int, prompt_tokens: int, device: str,
          kernel_us_per_step: float | None, screened: bool) -> dict:
    """The floor of `steps` captured decode steps of `batch` rows after a `prompt_tokens` prefill, in `dtype` (a
    name), against their kernel time per step (None: not measured); `screened`: the steps picked through the
    vocabulary projection's screen (Layout.step)."""
    from evident.workflow.checkpoints import DTYPES

    parts = step_bytes(ckpt, DTYPES[dtype], batch, prompt_tokens + (steps + 1) // 2, screened)
    bw = bandwidth(device)
    out = {"bytes": parts, BANDWIDTH_KEY: bw / 1e9, "floor_us": parts["total"] / bw * 1e6,
           "kernel_us_per_step": kernel_us_per_step,
           "basis": "every weight read once, the batch's embedding rows, top_k routed experts a MoE layer (identical "
                    "rows route alike) and the cache (MLA: the latent cache; DeepSeek-V4: sliding window, "
                    "compressed and indexer entries, the compressors' pooled windows: workflow/floor.py) at the "
                    "captured steps' middle position, over the measured read bandwidth (kernels/hbm.py)"
                    + screened_basis(screened),
           "vocabulary_screened": screened}
    if kernel_us_per_step:
        out["floor_fraction"] = out["floor_us"] / kernel_us_per_step
    return out


def bench_floor(lay: Layout, steps: list[tuple[list[int], list[Collection[int]]]], bandwidth: float,
                tpot_p50_ms: float, ranks: int = 1, screened: bool = False) -> dict:
    """The floor of a bench cell's steady decode steps, each given as (every row's cache positions, the experts
    the rows chose a MoE layer), over `bandwidth` bytes/s, against its steady TPOT p50: per step its bytes
    (Layout.step), their mean by part, the floor in ms (mean, min, max over the steps) and floor / TPOT."""
    per_step = [lay.step(positions, experts, ranks, screened) for positions, experts in steps]
    unique = [len(ids) for _, experts in steps for ids in experts]
    ms = [b["total"] / bandwidth * 1e3 for b in per_step]
    floor_ms = statistics.fmean(ms)
    return {
        "basis": "per steady decode step: every weight read once, each row's embedding row and cache (its own "
                 "positions), and the routed experts the rows chose a MoE layer, each once (their union), from a "
                 "teacher-forced replay of each row (workflow/replay.py); over the measured read bandwidth "
                 "(kernels/hbm.py)" + (f"; the busiest of {ranks} expert-parallel ranks, each reading the weights, the "
                                       "cache and its own shard's chosen experts" if ranks > 1 else "")
                 + screened_basis(screened),
        "vocabulary_screened": screened,
        BANDWIDTH_KEY: bandwidth / 1e9, "steps": len(per_step), "ranks": ranks,
        "unique_experts": {"mean": statistics.fmean(unique), "min": min(unique), "max": max(unique),
                           "top_k": lay.top_k, "experts": lay.n_experts, "moe_layers": len(lay.expert)}
        if unique else None,
        "bytes": {k: statistics.fmean(b[k] for b in per_step) for k in per_step[0]},
        "step_bytes": [b["total"] for b in per_step],
        "floor_ms": floor_ms, "floor_ms_min": min(ms), "floor_ms_max": max(ms),
        "tpot_p50_ms": tpot_p50_ms, "floor_fraction": floor_ms / tpot_p50_ms,
    }
