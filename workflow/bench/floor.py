"""The floor of a decode step: the bytes it must read over the read bandwidth measured on the same device
(kernels/hbm.py).

A step reads every weight once, but only the batch's embedding rows and the routed experts its rows chose, each
once however many rows chose it, plus the cache (`Layout.step`). Identical rows choose the same k experts a MoE
layer: the profile stage sets that floor (`floor`) against the captured steps' kernel time. Rows of different
prompts choose more: the bench stage counts the experts actually chosen at each decode step (workflow/bench/replay.py)
and sets that floor against the cell's steady TPOT (`bench_floor`).

A prefill (`prefill_floor`) reads every weight once, the experts its prompts' tokens chose (their union a MoE layer),
their embedding rows, and writes their cache; it also does 2 FLOPs a parameter a token, and attention's: its floor is
the larger of the bytes over the read bandwidth and the FLOPs over a matrix product's measured rate, against TTFT.

The cache a step reads, per row, at P positions, and what else a row reads beside its embedding row (`per_row`), are
the model family's to say (its `layout`, workflow/models/families/: the cache of each kind of layer, a hash-routed
layer's table row).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from evident.workflow.models import families

if TYPE_CHECKING:  # torch only names the dtype here: the floor loads without it
    import torch

BANDWIDTH_KEY = "read_bandwidth_GBps"  # the bandwidth a floor was set at, in a floor's record
FLOP_RATE_KEY = "matmul_TFLOPs"  # the FLOP rate a prefill's floor was set at (kernels.hbm.matmul_rate)
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
    per_row: int  # read once a row beside them (a hash-routed layer's table row: the family's layout)
    row: int  # one row's embedding row
    expert: list[int]  # one routed expert's bytes, per MoE layer in layer order
    top_k: int
    n_experts: int
    cache_row: Callable[[int], int]  # the cache one row reads at P positions
    head: int = 0  # the vocabulary projection's weight, within `weights`
    screen: int = 0  # its int8 screen's bytes (kernels/head.py: a byte an element, a scale and a bound a row)
    itemsize: int = 2  # bytes a weight in the model's dtype: the FLOPs of a prefill count parameters
    attention: int = 0  # FLOPs of one causal (query, key) pair over every layer (q.k and p.v); 0: not counted

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
    """The Layout of the checkpoint's model in `dtype`, as its family lays it out (families.Family.layout)."""
    return layout_of(*families.load(ckpt), dtype)


def layout_of(family, args, dtype: torch.dtype) -> Layout:
    """The Layout of a family's model of `args` in `dtype` (`layout`, without a checkpoint: tools/device_prefill.py)."""
    # MLA, unabsorbed (the fewest FLOPs): q.k over qk_head_dim and p.v over v_head_dim, every head and layer.
    # DeepSeek-V4's windows and compressed entries bound its pairs otherwise: not counted, so the floor stays below.
    mla = all(hasattr(args, k) for k in ("qk_head_dim", "v_head_dim", "num_attention_heads"))
    attention = (2 * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * args.num_hidden_layers
                 if mla else 0)
    return Layout(**family.layout(args, dtype), itemsize=dtype.itemsize, attention=attention)


def step_bytes(ckpt: Path, dtype: torch.dtype, batch: int, positions: int, screened: bool = False) -> dict:
    """The least a decode step of `batch` identical rows at `positions` reads, by part (Layout.step)."""
    return layout(ckpt, dtype).step([positions] * batch, screened=screened)


def bandwidth(device: str) -> float:
    """The read bandwidth a floor on `device` is set at, bytes/s (kernels.hbm.read_bandwidth)."""
    from evident.kernels.hbm import read_bandwidth

    return read_bandwidth(device, BANDWIDTH_MIB if device.startswith("cuda") else CPU_BANDWIDTH_MIB)


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """The FLOP rate a prefill's floor on `device` is set at, FLOP/s (kernels.hbm.matmul_rate: a matrix product of
    the model's dtype)."""
    from evident.kernels.hbm import matmul_rate as rate

    return rate(device, dtype)


def floor(ckpt: Path, dtype: str, batch: int, steps: int, prompt_tokens: int, device: str,
          kernel_us_per_step: float | None, screened: bool) -> dict:
    """The floor of `steps` captured decode steps of `batch` rows after a `prompt_tokens` prefill, in `dtype` (a
    name), against their kernel time per step (None: not measured); `screened`: the steps picked through the
    vocabulary projection's screen (Layout.step)."""
    from evident.workflow.models.checkpoints import DTYPES

    parts = step_bytes(ckpt, DTYPES[dtype], batch, prompt_tokens + (steps + 1) // 2, screened)
    bw = bandwidth(device)
    out = {"bytes": parts, BANDWIDTH_KEY: bw / 1e9, "floor_us": parts["total"] / bw * 1e6,
           "kernel_us_per_step": kernel_us_per_step,
           "basis": "every weight read once, the batch's embedding rows, top_k routed experts a MoE layer (identical "
                    "rows route alike) and the cache (MLA: the latent cache; DeepSeek-V4: sliding window, "
                    "compressed and indexer entries, the compressors' pooled windows: workflow/bench/floor.py) at the "
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
                 "teacher-forced replay of each row (workflow/bench/replay.py); over the measured read bandwidth "
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


def prefill_floor(lay: Layout, prompts: list[list[int]], experts: list[Collection[int]], bandwidth: float,
                  flop_rate: float, ttft_p50_ms: float, ranks: int = 1) -> dict:
    """The floor of a cell's prefill (its TTFT: every row's prompt to its first token): the larger of its bytes over
    `bandwidth` and its FLOPs over `flop_rate`, against the TTFT p50. Bytes: every weight once, the routed experts
    the prompts' tokens chose (`experts`: their union a MoE layer, each read once), the prompts' distinct tokens'
    embedding rows and the cache each row writes (Layout.step at its prompt's length). FLOPs: 2 a parameter a token
    (the routed experts' top_k a MoE layer; the vocabulary projection only at each row's last position, the one its
    first token is picked from) and attention's causal pairs (Layout.attention). Over `ranks` expert-parallel ranks:
    the busiest rank's bytes, the routed FLOPs spread evenly."""
    parts = lay.step([len(p) for p in prompts], experts, ranks)
    parts["embedding_rows"] = len({t for p in prompts for t in p}) * lay.row
    parts["total"] = sum(v for k, v in parts.items() if k != "total")
    tokens = sum(map(len, prompts))
    dense = (lay.weights - lay.head) / lay.itemsize
    routed = lay.top_k * sum(lay.expert) / lay.itemsize / ranks
    flops = (2 * tokens * (dense + routed) + 2 * len(prompts) * lay.head / lay.itemsize
             + lay.attention * sum(len(p) * (len(p) + 1) // 2 for p in prompts))
    bytes_ms, flops_ms = parts["total"] / bandwidth * 1e3, flops / flop_rate * 1e3
    unique = [len(ids) for ids in experts]
    floor_ms = max(bytes_ms, flops_ms)
    return {
        "basis": "the prefill of the cell's rows to their first token: the larger of (every weight read once, the "
                 "routed experts the prompts' tokens chose a MoE layer, each once (their union, from a teacher-forced "
                 "replay of each row: workflow/bench/replay.py), the distinct prompt tokens' embedding rows and the "
                 "cache written) over the measured read bandwidth (kernels/hbm.py read_bandwidth) and (2 FLOPs a "
                 "parameter a prompt token, top_k routed experts a MoE layer, the vocabulary projection at each "
                 "row's last position only, and attention's causal (query, key) pairs"
                 + ("" if lay.attention else ": not counted for this family") + ") over a measured matrix "
                 "product's rate (kernels/hbm.py matmul_rate, an n x n product in the model's dtype)"
                 + (f"; the busiest of {ranks} expert-parallel ranks" if ranks > 1 else ""),
        "rows": len(prompts), "prompt_tokens": tokens, "ranks": ranks,
        "unique_experts": {"mean": statistics.fmean(unique), "min": min(unique), "max": max(unique),
                           "top_k": lay.top_k, "experts": lay.n_experts, "moe_layers": len(lay.expert)}
        if unique else None,
        "bytes": parts, "flops": flops,
        BANDWIDTH_KEY: bandwidth / 1e9, FLOP_RATE_KEY: flop_rate / 1e12,
        "bytes_ms": bytes_ms, "flops_ms": flops_ms, "bound": "bytes" if bytes_ms >= flops_ms else "flops",
        "floor_ms": floor_ms, "ttft_p50_ms": ttft_p50_ms, "ttft_over_floor": ttft_p50_ms / floor_ms,
    }
