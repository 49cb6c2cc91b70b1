"""Kernel benchmark on a GPU: gemv_fused at the DeepSeek-V4 C4 auxiliary shape against the baselines
measured in the same run, and the block-shape variants behind the chosen constants.

    python -m evident.kernels.bench [--variants]

Times are medians in µs of CUDA-graph replays timed with CUDA events (no host launch cost counted):
- streamed: calls back to back, each on its own copy of the weights (8 copies, over 2x the L2), so every
  call reads its weights from HBM as in a decode step; the figure set against the HBM floor;
- marginal: what one more call adds to such a stream, (48 calls - 16 calls) / 32: the graph's launch and
  the stream's ramp-up cancel out, as in a decode step of hundreds of kernels;
- cold: one call per replay after an L2 scrub (reading 2x the L2); includes the graph launch, ~3.4 µs
  for a one-element kernel on an H200;
- warm: 20 calls back to back on the same weights (partly served by the L2).
Every variant is checked bitwise against gemv_exact per segment before it is timed. Prints a table last.

    python -m evident.kernels.bench --skinny [--variants]

times kernels/skinny.py instead, at batch 8 on DeepSeek-V2-Lite's projections (q + kv_a joined, o_proj)
against cuBLAS (F.linear, one launch a projection) in the same run, streamed and marginal as above, with and
without programmatic dependent launch, each checked against an fp64 reference first.

    python -m evident.kernels.bench --head [--variants]

times kernels/head.py's one launch at batch 1 (DeepSeek-V2-Lite's vocabulary) against the four it replaces, and its
screened two (``head_pick_screened``), streamed as above, its pick first checked against pick_batch's of its own
logits and the screened pick against it.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from . import argmax, gemv, hbm, head, pdl, skinny
from .graphs import capture

K, SIZES = 4096, [2048, 512, 64]
OUT_DTYPES = [torch.float32, torch.float32, torch.float16]
VARIANTS = [(bn, nw) for bn in (1, 2, 4, 8) for nw in (1, 2, 4)]
# kernels/skinny.py at batch 8: DeepSeek-V2-Lite's q + kv_a (one joined weight) and o_proj, K = 2048, bf16
SKINNY_M, SKINNY_SHAPES = 8, {"q + kv_a": [3072, 576], "o_proj": [2048]}
SKINNY_KNOBS = ("BLOCK_N", "BLOCK_K", "STAGES", "NUM_WARPS")
SKINNY_VARIANTS = [(16, 256, 4, 4), (64, 128, 4, 4), (32, 128, 6, 4), (64, 256, 3, 4)]  # no spills on sm_90
# kernels/head.py at batch 1: DeepSeek-V2-Lite's vocabulary projection; variants as (ROWS, NUM_WARPS)
HEAD_V, HEAD_K = 102400, 2048
HEAD_VARIANTS = [(4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (2, 1)]
SCREEN_VARIANTS = [(8, 4), (16, 4), (16, 8), (32, 8), (4, 1)]  # head.py's screen: (ROWS, warps)


def screened_rows(x: torch.Tensor, screen) -> int:
    """The rows kernels/head.py's screen leaves to check in full for x, from its bounds in torch (a close account:
    fp64 here, the kernel's sums in fp32)."""
    a = ((screen.q.double() - 128) @ x[0].double()) * screen.scale.double()
    e = x[0].double().norm() * screen.bound.double()
    t = torch.topk(a - e, 2).values[1]
    return int(((a + e) >= t).sum())


def graph_us(fn, calls: int = 20) -> float:
    """Median µs per call over replays of a graph of ``calls`` back-to-back calls (weights stay in L2)."""
    return triton.testing.do_bench(capture(fn, calls)[0].replay, return_mode="median") * 1e3 / calls


def cold_us(fn, trials: int = 300, scrub: str = "read") -> float:
    """Median µs of one call replayed from a graph right after an L2 scrub of 2x the L2: `read` leaves
    the L2 full of clean lines; `write` (do_bench's way) full of dirty ones, whose write-back to HBM
    then competes with the kernel's reads."""
    g, _ = capture(fn, 1)
    flush = torch.ones(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
    sink = torch.empty((), device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        # the GPU is busy scrubbing while the host records the events and the replay
        torch.sum(flush, 0, out=sink) if scrub == "read" else flush.fill_(1)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(torch.tensor(times).median())


def streamed_us(fn_of_w, w: torch.Tensor, copies: int = 8, calls: int = 16, prepare=None) -> float:
    """Median µs per call of a graph of calls back to back, each on its own copy of the weights (together
    over 2x the L2): every call streams its weights from HBM, as a decode step does layer after layer.
    ``prepare``: what fn_of_w gets of each copy instead of the copy (made once, before the capture)."""
    ws = [w.clone() for _ in range(copies)]
    ws = [prepare(c) for c in ws] if prepare else ws
    n = iter(range(10**9))
    return graph_us(lambda: fn_of_w(ws[next(n) % copies]), calls=calls)


def marginal_us(fn_of_w, w: torch.Tensor) -> float:
    """What one more call adds to a stream of them: (graph of 48 calls - graph of 16) / 32, per call. The
    graph's own launch and the first call's ramp-up, paid once per stream, cancel out."""
    return (48 * streamed_us(fn_of_w, w, calls=48) - 16 * streamed_us(fn_of_w, w, calls=16)) / 32


def kernel_us(fn_of_w, w: torch.Tensor, name: str, copies: int = 8, calls: int = 64) -> tuple[float, float]:
    """(device µs a call, kernels a call) of the kernels whose name holds `name` (CUPTI, via torch.profiler),
    launched eagerly one by one, each call on the next copy of the weights (together over 2x the L2, so each
    reads HBM): the kernels' own time, as Nsight reports it. Summed over a call's kernels, not a median over
    kernels: cuBLAS may split one product into a GEMV and a small reduction, and a median over both is neither."""
    from torch.profiler import ProfilerActivity, profile  # CUPTI's profiler: loaded only to time kernels

    ws = [w.clone() for _ in range(copies)]
    fn_of_w(ws[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn_of_w(ws[i % copies])
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and name in e.name]
    return (sum(times) / calls, len(times) / calls) if times else (float("nan"), 0.0)


def skinny_main(variants: bool) -> None:
    """kernels/skinny.py against cuBLAS at batch 8; prints a table."""
    bw = hbm.read_bandwidth("cuda")
    chosen = tuple(getattr(skinny, k) for k in SKINNY_KNOBS)
    rows = []
    for label, sizes in SKINNY_SHAPES.items():
        x = torch.randn(SKINNY_M, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(sum(sizes), 2048, device="cuda", dtype=torch.bfloat16) * 2048**-0.5
        floor = w.numel() * 2 / bw * 1e6
        ref = x.double() @ w.double().T
        segments = sizes if len(sizes) > 1 else None

        def row(name, fn_of_w, check=True):
            err = "-"
            if check:
                y = torch.cat(fn_of_w(w), dim=1) if segments else fn_of_w(w)
                err = f"{((y.double() - ref).norm() / ref.norm()).item():.1e}"
            streamed = streamed_us(fn_of_w, w)
            rows.append((f"{label}: {name}", streamed, marginal_us(fn_of_w, w), streamed / floor, err))

        row("F.linear per projection", lambda wi: [F.linear(x, p) for p in wi.split(sizes)], check=False)
        for variant in [chosen] + (SKINNY_VARIANTS if variants else []):
            for k, v in zip(SKINNY_KNOBS, variant):
                setattr(skinny, k, v)
            row(f"skinny {variant}{' (chosen)' if variant == chosen else ''}",
                lambda wi: skinny.skinny_linear(x, wi, segments))
        for k, v in zip(SKINNY_KNOBS, chosen):
            setattr(skinny, k, v)
        with pdl.disabled():
            row("skinny without PDL", lambda wi: skinny.skinny_linear(x, wi, segments))
    print(f"\nM={SKINNY_M} K=2048 bf16; floor = weight bytes at {bw / 1e12:.2f} TB/s; variants as {SKINNY_KNOBS}")
    print(f"{'kernel':48} {'streamed':>8} {'marginal':>8} {'x floor':>8} rel err  (us, medians)")
    for name, streamed, marginal, ratio, err in rows:
        print(f"{name:48} {streamed:8.2f} {marginal:8.2f} {ratio:8.2f} {err}")


def head_main(variants: bool) -> None:
    """kernels/head.py's one launch against the step's four (cuBLAS's projection, pick_batch, the copy into the
    inputs, the advance) at DeepSeek-V2-Lite's vocabulary, batch 1; prints a table."""
    x = torch.randn(1, HEAD_K, device="cuda").bfloat16()
    w = (torch.randn(HEAD_V, HEAD_K, device="cuda") * 0.02).bfloat16()
    counts = torch.zeros(head.counts_for(HEAD_V), dtype=torch.int32, device="cuda")
    nxt, lengths = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def apart(wi):
        ids, margins = argmax.pick_batch(F.linear(x, wi), None, counter)
        nxt.copy_(ids)
        lengths.add_(1)

    one = lambda wi: head.head_pick(x, wi, counts, nxt, lengths, None)  # noqa: E731
    logits, ids, margins = one(w)
    want, want_margin = argmax.pick_batch(logits, None, counter)
    if not (torch.equal(ids, want) and torch.equal(margins, want_margin) and nxt.item() == ids.item()
            and not counts.any()):
        raise SystemExit("head_pick's pick is not pick_batch's of its own logits")
    floor = w.numel() * 2 / hbm.read_bandwidth("cuda") * 1e6
    rows = [("cuBLAS + pick_batch + copy + add", streamed_us(apart, w, copies=6, calls=12))]
    chosen = (head.ROWS, head.NUM_WARPS)
    for r, nw in [chosen] + ([v for v in HEAD_VARIANTS if v != chosen] if variants else []):
        head.ROWS, head.NUM_WARPS = r, nw
        rows.append((f"head_pick ROWS={r} warps={nw}{' (chosen)' if (r, nw) == chosen else ''}",
                     streamed_us(one, w, copies=6, calls=12)))
    head.ROWS, head.NUM_WARPS = chosen
    screen = head.screen_of(w)
    both = lambda pair: head.head_pick_screened(x, *pair, nxt, lengths, None)  # noqa: E731
    got_ids, got_margins = both((w, screen))
    if not (torch.equal(got_ids, ids) and torch.equal(got_margins, margins)):
        raise SystemExit("head_pick_screened's pick is not head_pick's")
    listed = screened_rows(x, screen)
    chosen = (head.SCREEN_ROWS, head.SCREEN_WARPS)
    for r, nw in [chosen] + ([v for v in SCREEN_VARIANTS if v != chosen] if variants else []):
        head.SCREEN_ROWS, head.SCREEN_WARPS = r, nw
        rows.append((f"head_pick_screened ROWS={r} warps={nw}{' (chosen)' if (r, nw) == chosen else ''}",
                     streamed_us(both, w, copies=6, calls=12, prepare=lambda c: (c, head.screen_of(c)))))
    head.SCREEN_ROWS, head.SCREEN_WARPS = chosen
    rows.append(("head_pick, again", streamed_us(one, w, copies=6, calls=12)))
    rows.append(("cuBLAS + pick_batch + copy + add, again", streamed_us(apart, w, copies=6, calls=12)))
    print(f"\nV={HEAD_V} K={HEAD_K} bf16, batch 1; floor = the weight's read, {floor:.1f} us; the screen's int8 "
          f"read {floor / 2:.1f} us; rows the screen left to check in full: {listed}")
    print(f"{'launches':48} {'streamed':>8} {'x floor':>8}  (us, medians)")
    for name, us in rows:
        print(f"{name:48} {us:8.2f} {us / floor:8.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", action="store_true", help="also time block-shape variants")
    ap.add_argument("--skinny", action="store_true", help="time kernels/skinny.py at batch 8 instead")
    ap.add_argument("--head", action="store_true", help="time kernels/head.py at batch 1 instead")
    args = ap.parse_args(argv)
    if args.skinny:
        return skinny_main(args.variants)
    if args.head:
        return head_main(args.variants)
    torch.manual_seed(0)
    x = torch.randn(K, device="cuda", dtype=torch.float16)
    w = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.float16)
    bw = hbm.read_bandwidth("cuda")
    floor_us = (w.numel() + x.numel()) * 2 / bw * 1e6
    rows = []

    def row(name, fn_of_w, bitwise="-"):
        streamed = streamed_us(fn_of_w, w)
        rows.append((name, streamed, marginal_us(fn_of_w, w), cold_us(lambda: fn_of_w(w)), graph_us(lambda: fn_of_w(w)),
                     streamed / floor_us, bitwise))

    tiny = torch.ones(1, device="cuda")
    row("probe: one tiny kernel (fixed cost)", lambda wi: tiny.add_(1))
    row("F.linear joined", lambda wi: F.linear(x, wi))
    row("F.linear x3", lambda wi: [F.linear(x, p) for p in wi.split(SIZES)])
    row("gemv_exact x3", lambda wi: [gemv.gemv_exact(x, p, d) for p, d in zip(wi.split(SIZES), OUT_DTYPES)])

    def bitwise() -> str:
        ok = all(torch.equal(y, gemv.gemv_exact(x, p, d))
                 for y, p, d in zip(gemv.gemv_fused(x, w, SIZES, OUT_DTYPES), w.split(SIZES), OUT_DTYPES))
        return "yes" if ok else "NO"

    chosen = (gemv.BLOCK_N, gemv.NUM_WARPS)
    for bn, nw in (VARIANTS if args.variants else [chosen]):
        gemv.BLOCK_N, gemv.NUM_WARPS = bn, nw
        tag = " (chosen)" if (bn, nw) == chosen else ""
        row(f"gemv_fused BLOCK_N={bn} warps={nw}{tag}", lambda wi: gemv.gemv_fused(x, wi, SIZES, OUT_DTYPES), bitwise())
    gemv.BLOCK_N, gemv.NUM_WARPS = chosen
    with pdl.disabled():  # the same kernel launched the ordinary way: what programmatic dependent launch saves
        row("gemv_fused without PDL", lambda wi: gemv.gemv_fused(x, wi, SIZES, OUT_DTYPES), bitwise())
        row("F.linear joined, then gemv_fused (no PDL)",
            lambda wi: (F.linear(x, wi), gemv.gemv_fused(x, wi, SIZES, OUT_DTYPES)))
    row("F.linear joined, then gemv_fused (PDL)", lambda wi: (F.linear(x, wi), gemv.gemv_fused(x, wi, SIZES, OUT_DTYPES)))
    # the slope to 4x the rows separates per-launch cost from bandwidth
    w4 = torch.randn(4 * sum(SIZES), K, device="cuda", dtype=torch.float16)
    nan = float("nan")
    rows.append(("gemv_fused at 4x N (x4 floor)", streamed_us(lambda wi: gemv.gemv_fused(
        x, wi, [4 * n for n in SIZES], OUT_DTYPES), w4, copies=4), nan, nan, nan, nan, "-"))
    fused = lambda wi: gemv.gemv_fused(x, wi, SIZES, OUT_DTYPES)  # noqa: E731
    linear, n_linear = kernel_us(lambda wi: F.linear(x, wi), w, "")  # every kernel F.linear launches here
    with pdl.disabled():  # a kernel's duration alone: with PDL a call starts early and waits inside
        alone, _ = kernel_us(fused, w, "_rows_kernel")
    print(f"\nkernel time a call (CUPTI, eager, each call on its own weight copy): gemv_fused {alone:.2f} us, "
          f"F.linear joined {linear:.2f} us ({n_linear:g} kernels a call)")
    print(f"read bandwidth {bw / 1e12:.2f} TB/s; HBM floor for K={K}, N={sum(SIZES)} fp16: {floor_us:.2f} us")
    print(f"{'kernel':40} {'streamed':>8} {'marginal':>8} {'cold':>8} {'warm':>8} {'x floor':>8} bitwise   (us, medians)")
    for name, streamed, marginal, cold, warm, ratio, ok in rows:
        print(f"{name:40} {streamed:8.2f} {marginal:8.2f} {cold:8.2f} {warm:8.2f} {ratio:8.2f} {ok}")


if __name__ == "__main__":
    main()
