"""Routed-experts benchmark on a GPU: moe_experts at DeepSeek-V2-Lite's shape (D=2048, I=1408, E=64, k=6, bf16)
against moe_reference and the HBM floor, for B=1 and B=8 (all rows alike, as in the engine's benchmark, and
distinct rows).

    python -m kernels.moe_bench [--variants]

Medians in µs of CUDA-graph replays timed with CUDA events (kernels/bench.py's helpers):
- streamed: 10 calls back to back, each routed to other experts (B=1 and alike rows cycle through disjoint
  expert sets), so every call reads its experts from HBM, as layer after layer of a decode step does;
- cold: one call after an L2 read-scrub, graph launch included (~3.4 µs for a one-element kernel on an H200);
- warm: the same call 20 times (its experts partly served by the L2).
floor: the unique experts' bytes of a call at 4.25 TB/s (the H200's copy bandwidth, KERNELS.md). Each case is
checked first: relative error against moe_reference, and each row of the batch bitwise equal to the row alone.
--variants also times other block shapes (BLOCK_N, DOWN_BLOCK_N, NUM_WARPS, BLOCK_K) of the kernels.
Prints a table last.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from . import moe
from .bench import cold_us, graph_us

D, I, E, K = 2048, 1408, 64, 6
BANDWIDTH = 4.25e12
CALLS = 10
CASES = [("B=1", 1, True), ("B=8 alike rows", 8, True), ("B=8 distinct rows", 8, False)]
# (BLOCK_N, DOWN_BLOCK_N, NUM_WARPS, BLOCK_K); the first is the module's
VARIANTS = [(1, 1, 1, 512), (2, 2, 1, 512), (1, 2, 1, 512), (2, 4, 1, 512), (1, 1, 2, 512), (1, 1, 1, 256),
            (1, 1, 1, 1024), (4, 4, 4, 512)]


def routings(B: int, alike: bool, gen: torch.Generator) -> list[torch.Tensor]:
    """CALLS ids [B, K]: alike rows cycle through disjoint expert sets (no call finds its experts in the L2 from
    the previous few), distinct rows are drawn at random."""
    if alike:
        perm = torch.randperm(E, generator=gen, device="cuda")
        sets = [perm[(c * K) % (E - E % K):][:K] for c in range(CALLS)]
        return [s.expand(B, K).contiguous() for s in sets]
    return [torch.rand(B, E, generator=gen, device="cuda").argsort(-1)[:, :K].contiguous() for _ in range(CALLS)]


def check(x, w13, w2, ids, wts) -> tuple[float, bool]:
    """(relative error against moe_reference, every row bitwise equal to the row alone)."""
    out = moe.moe_experts(x, w13, w2, ids, wts)
    ref = moe.moe_reference(x, w13, w2, ids, wts)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    rows = all(torch.equal(out[b], moe.moe_experts(x[b:b + 1], w13, w2, ids[b:b + 1], wts[b:b + 1])[0])
               for b in range(len(x)))
    return err, rows


def case_rows(label: str, B: int, alike: bool, w13, w2, gen, with_reference: bool) -> list[tuple]:
    x = torch.randn(1 if alike else B, D, generator=gen, device="cuda").to(w13.dtype).expand(B, D).contiguous()
    wts = torch.rand(B, K, generator=gen, device="cuda")
    ids = routings(B, alike, gen)
    expert_bytes = 3 * I * D * w13.element_size()
    floor = sum(len(torch.unique(i)) for i in ids) / CALLS * expert_bytes / BANDWIDTH * 1e6
    err, rows = check(x, w13, w2, ids[0], wts)
    out = []
    fns = [("moe_experts", moe.moe_experts)] + ([("moe_reference", moe.moe_reference)] if with_reference else [])
    for name, fn in fns:
        n = itertools.count()
        streamed = graph_us(lambda: fn(x, w13, w2, ids[next(n) % CALLS], wts), calls=CALLS)
        cold = cold_us(lambda: fn(x, w13, w2, ids[0], wts))
        warm = graph_us(lambda: fn(x, w13, w2, ids[0], wts))
        ours = name == "moe_experts"
        out.append((f"{label}: {name}", streamed, cold, warm, floor, streamed / floor,
                    f"{err:.1e}" if ours else "-", ("yes" if rows else "NO") if ours else "-"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", action="store_true", help="also time other block shapes of the kernels")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, generator=gen, device="cuda") * D**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
    chosen = (moe.BLOCK_N, moe.DOWN_BLOCK_N, moe.NUM_WARPS, moe.BLOCK_K)
    table = []
    for variant in ([chosen] + [v for v in VARIANTS if v != chosen]) if args.variants else [chosen]:
        moe.BLOCK_N, moe.DOWN_BLOCK_N, moe.NUM_WARPS, moe.BLOCK_K = variant
        tag = "" if variant == chosen else f" {variant}"
        for label, B, alike in CASES:
            table += case_rows(label + tag, B, alike, w13, w2, gen, with_reference=variant == chosen)
    moe.BLOCK_N, moe.DOWN_BLOCK_N, moe.NUM_WARPS, moe.BLOCK_K = chosen
    print(f"\nD={D} I={I} E={E} k={K} bf16; floor = unique experts' bytes at {BANDWIDTH / 1e12:.2f} TB/s; "
          f"variants as (BLOCK_N, DOWN_BLOCK_N, NUM_WARPS, BLOCK_K), chosen {chosen}")
    print(f"{'case':58} {'streamed':>8} {'cold':>8} {'warm':>8} {'floor':>8} {'x floor':>7} {'rel err':>8} "
          "rows=B1  (us, medians)")
    for name, streamed, cold, warm, floor, ratio, err, rows in table:
        print(f"{name:58} {streamed:8.2f} {cold:8.2f} {warm:8.2f} {floor:8.2f} {ratio:7.2f} {err:>8} {rows}")


if __name__ == "__main__":
    main()
