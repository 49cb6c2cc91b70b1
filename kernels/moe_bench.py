"""Routed-experts benchmark on a GPU: moe_experts at DeepSeek-V2-Lite's shape (D=2048, I=1408, E=64, k=6, bf16)
against moe_reference and the HBM floor, for B=1 (the one-row kernel) and B=8 (the tensor-core kernel; all rows
alike, as in the engine's benchmark, and distinct rows).

    python -m evident.kernels.moe_bench [--variants]

Medians in µs of CUDA-graph replays timed with CUDA events (kernels/bench.py's helpers):
- streamed: 10 calls back to back, each routed to other experts (B=1 and alike rows cycle through disjoint
  expert sets), so every call reads its experts from HBM, as layer after layer of a decode step does;
- cold: one call after an L2 read-scrub, graph launch included (~3.4 µs for a one-element kernel on an H200);
- warm: the same call 20 times (its experts partly served by the L2);
- kernels: the device time of the two experts kernels of a call (gate_up + down, CUPTI through torch.profiler,
  eager calls streamed as above), without the route sort and the weighted sum.
floor: the unique experts' bytes of a call at the read bandwidth measured first (kernels/hbm.py). Each case is
checked first: relative error against moe_reference, and (alike rows) every row bitwise equal to row 0.
--variants also times other block shapes: of the one-row kernel (BLOCK_N, DOWN_BLOCK_N, NUM_WARPS, BLOCK_K) at
B=1, of the tensor-core kernel (DOT_BLOCK_N, DOT_DOWN_BLOCK_N, DOT_BLOCK_K, DOT_WARPS, DOT_STAGES) at B=8.
Prints a table last.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from . import hbm, moe
from .bench import cold_us, graph_us

D, I, E, K = 2048, 1408, 64, 6
CALLS = 10
CASES = [("B=1", 1, True), ("B=8 alike rows", 8, True), ("B=8 distinct rows", 8, False)]
ROW_KNOBS = ("BLOCK_N", "DOWN_BLOCK_N", "NUM_WARPS", "BLOCK_K")
ROW_VARIANTS = [(2, 2, 1, 512), (1, 2, 1, 512), (1, 1, 2, 512), (1, 1, 1, 1024)]
DOT_KNOBS = ("DOT_BLOCK_N", "DOT_DOWN_BLOCK_N", "DOT_BLOCK_K", "DOT_WARPS", "DOT_STAGES")
# all compile for sm_90 without spills, within the shared memory (checked offline with Triton's ptxas)
DOT_VARIANTS = [(64, 64, 128, 4, 4), (32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 6),
                (128, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (16, 32, 256, 4, 3)]


def routings(B: int, alike: bool, gen: torch.Generator) -> list[torch.Tensor]:
    """CALLS ids [B, K]: alike rows cycle through disjoint expert sets (no call finds its experts in the L2 from
    the previous few), distinct rows are drawn at random."""
    if alike:
        perm = torch.randperm(E, generator=gen, device="cuda")
        sets = [perm[(c * K) % (E - E % K):][:K] for c in range(CALLS)]
        return [s.expand(B, K).contiguous() for s in sets]
    return [torch.rand(B, E, generator=gen, device="cuda").argsort(-1)[:, :K].contiguous() for _ in range(CALLS)]


def check(x, w13, w2, ids, wts, alike: bool) -> tuple[float, str]:
    """(relative error against moe_reference, for alike rows whether every row is bitwise row 0)."""
    out = moe.moe_experts(x, w13, w2, ids, wts)
    ref = moe.moe_reference(x, w13, w2, ids, wts)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    same = all(torch.equal(out[b], out[0]) for b in range(len(x)))
    return err, ("yes" if same else "NO") if alike and len(x) > 1 else "-"


def kernels_us(fn, ids: list[torch.Tensor]) -> float:
    """Device µs per call of the experts kernels (both launches), eager calls streamed through ids."""
    from torch.profiler import ProfilerActivity, profile  # CUPTI's profiler: loaded only to time kernels

    fn(ids[0])
    torch.cuda.synchronize()
    rounds = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in range(rounds * CALLS):
            fn(ids[c % CALLS])
        torch.cuda.synchronize()
    names = ("_row_kernel", "_dot_kernel")
    ours = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and any(n in e.name for n in names)]
    return sum(ours) / (rounds * CALLS)


def case_rows(label: str, B: int, alike: bool, w13, w2, gen, with_reference: bool, bw: float) -> list[tuple]:
    x = torch.randn(1 if alike else B, D, generator=gen, device="cuda").to(w13.dtype).expand(B, D).contiguous()
    wts = torch.rand(1 if alike else B, K, generator=gen, device="cuda").expand(B, K).contiguous()  # alike rows: alike
    ids = routings(B, alike, gen)
    expert_bytes = 3 * I * D * w13.element_size()
    floor = sum(len(torch.unique(i)) for i in ids) / CALLS * expert_bytes / bw * 1e6
    err, rows = check(x, w13, w2, ids[0], wts, alike)
    out = []
    fns = [("moe_experts", moe.moe_experts)] + ([("moe_reference", moe.moe_reference)] if with_reference else [])
    for name, fn in fns:
        n = itertools.count()
        streamed = graph_us(lambda: fn(x, w13, w2, ids[next(n) % CALLS], wts), calls=CALLS)
        cold = cold_us(lambda: fn(x, w13, w2, ids[0], wts))
        warm = graph_us(lambda: fn(x, w13, w2, ids[0], wts))
        ours = name == "moe_experts"
        kern = kernels_us(lambda i: fn(x, w13, w2, i, wts), ids) if ours else float("nan")
        out.append((f"{label}: {name}", streamed, cold, warm, kern, floor, streamed / floor,
                    f"{err:.1e}" if ours else "-", rows if ours else "-"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", action="store_true", help="also time other block shapes of the kernels")
    args = ap.parse_args(argv)
    bw = hbm.read_bandwidth("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, generator=gen, device="cuda") * D**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, generator=gen, device="cuda") * I**-0.5).to(torch.bfloat16)
    chosen = {name: getattr(moe, name) for name in ROW_KNOBS + DOT_KNOBS}
    table = []
    for label, B, alike in CASES:
        table += case_rows(label, B, alike, w13, w2, gen, with_reference=True, bw=bw)
    if args.variants:
        for knobs, variants, cases in ((ROW_KNOBS, ROW_VARIANTS, CASES[:1]), (DOT_KNOBS, DOT_VARIANTS, CASES[1:])):
            for variant in variants:
                for name, value in zip(knobs, variant):
                    setattr(moe, name, value)
                for label, B, alike in cases:
                    table += case_rows(f"{label} {variant}", B, alike, w13, w2, gen, with_reference=False, bw=bw)
                for name in knobs:
                    setattr(moe, name, chosen[name])
    print(f"\nD={D} I={I} E={E} k={K} bf16; floor = unique experts' bytes at {bw / 1e12:.2f} TB/s read; "
          f"variants of B=1 as {ROW_KNOBS}, of B=8 as {DOT_KNOBS}; chosen {chosen}")
    print(f"{'case':58} {'streamed':>8} {'cold':>8} {'warm':>8} {'kernels':>8} {'floor':>8} {'x floor':>7} "
          f"{'rel err':>8} alike=  (us, medians)")
    for name, streamed, cold, warm, kern, floor, ratio, err, rows in table:
        print(f"{name:58} {streamed:8.2f} {cold:8.2f} {warm:8.2f} {kern:8.2f} {floor:8.2f} {ratio:7.2f} {err:>8} "
              f"{rows}")


if __name__ == "__main__":
    main()
