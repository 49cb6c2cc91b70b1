"""Stage `overlap`: A/B screen of the auxiliary GEMVs, split on the main stream vs fused on a side stream.

Variant A: the split GEMVs (one `gemv_exact` per segment) and then the main-stream GEMM of another
projection (`F.linear`, K -> `gemm_n`, M=1), all on the main stream. Variant B: the fused GEMV
(`gemv_fused` over the joined weight) on an auxiliary stream, overlapped with the same GEMM on the main
stream and joined back (main waits on aux) before the consumer. Both end with the same consumer on the
main stream: one kernel that packs the bytes of every output into a result buffer.

1. Bitwise: for each of `overlap.inputs` freshly drawn input sets (new GEMV input, GEMM input and weights,
   seeded), every output of A equals B's bit for bit; on CUDA, A's graph replay also equals an eager run
   of A. A mismatch is recorded (verdict `bitwise_mismatch`, the gate fails the run after sealing); the
   stage itself still succeeds, so the evidence is written and sealed.
2. Timing (CUDA only): both variants captured as CUDA graphs, replayed `trials` times per envelope: `warm`
   (back to back) and `scrubbed` (a write of >= 2x the L2 size before each trial). A and B interleave
   (ABBA), so drift hits both. CUDA events on the main stream around each replay: the graph joins the aux
   stream back before its end, so the end event covers the aux work. The trials run in BLOCKS blocks, each
   queued behind a sleep kernel so the host is ahead of the GPU; a variant's noise is the spread of its
   block medians (as bench's is the spread of its repeat medians), and B is called faster or slower only
   beyond benchstats.NOISE.
Without CUDA the bitwise part runs through the Triton interpreter on small shapes (CPU_SHAPES) and
timing is recorded as not measured, with the reason; overlap/timings.csv then holds the header only.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workflow import benchstats
from workflow.environment import resolve_device
from workflow.evidence import Stage, read_config, write_bytes, write_text

# Interpreter shapes: K spans two BLOCK_K slices (the contract's fixed K order), and the joined rows fit
# one interpreter program (64 rows), which costs the most per launch; one segment per configured segment.
CPU_SHAPES = {"K": 2048, "segments": [32, 16, 8, 4], "gemm_n": 48}
CPU_REASON = "no CUDA device: the Triton interpreter ran the bitwise part on small shapes"
SEED = 0  # input set i is drawn from a generator seeded SEED + i
BLOCKS = 5  # timing blocks per envelope; a variant's noise is the spread of its block medians
FLUSH_FACTOR = 2  # the scrub writes FLUSH_FACTOR x the L2 size before each scrubbed trial
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep ahead of each block, so the host queues the block in time
ENVELOPES = ("warm", "scrubbed")
VARIANTS = ("A", "B")
CSV_HEADER = "envelope,block,trial,variant,us\n"
VERDICTS = ("b_faster", "no_claim", "b_slower", "bitwise_mismatch", "not_measured")
DESCRIPTION = {
    "A": "split GEMVs (gemv_exact per segment) serially on the main stream, then the GEMM on the main stream",
    "B": "fused GEMV (gemv_fused) on an aux stream overlapped with the GEMM on the main stream, "
         "joined (main waits on aux) before the consumer",
    "consumer": "one kernel on the main stream packing every output's bytes into a result buffer",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- statistics and verdicts (pure) ----------------------------------------------------------

def variant_stats(us: list[float], blocks: int = BLOCKS) -> dict:
    """Median, spread and noise of one variant's trials (µs, in trial order).

    The trials are cut into `blocks` consecutive blocks (np.array_split, as the timing loop cuts them);
    `spread` = (max - min) / median of the block medians. Noisy when fewer than benchstats.MIN_REPEATS
    blocks or spread > benchstats.NOISE: a noisy variant makes no claim. Bad samples raise BenchError.
    """
    s = benchstats.stats(us)  # validates: finite, positive, non-empty
    arr = np.asarray(us, dtype=float)
    parts = np.array_split(arr, min(blocks, arr.size))
    medians = [float(np.median(p)) for p in parts]
    spread = (max(medians) - min(medians)) / float(np.median(medians))
    if len(parts) < benchstats.MIN_REPEATS:
        reason = f"only {len(parts)} block(s); at least {benchstats.MIN_REPEATS} are needed to measure noise"
    elif spread > benchstats.NOISE:
        reason = f"block median spread {spread:.4f} > {benchstats.NOISE}"
    else:
        reason = None
    p10, p90 = np.percentile(arr, [10, 90])
    return {"count": s["count"], "median_us": s["p50"], "p10_us": float(p10), "p90_us": float(p90),
            "min_us": s["min"], "max_us": s["max"], "mean_us": s["avg"], "block_medians_us": medians,
            "spread": float(spread), "noisy": reason is not None, "noise_reason": reason}


def envelope_claim(a: dict, b: dict) -> dict:
    """"B faster"/"B slower" on the medians, or "no directional claim" with the reasons.

    A claim needs neither variant noisy and |B - A| / A strictly above benchstats.NOISE. change_pct is
    (B - A) / A in percent (negative: B faster) and is reported even when noise blocks the claim.
    """
    reasons = [f"{name} noisy ({s['noise_reason']})" for name, s in (("A", a), ("B", b)) if s["noisy"]]
    ratio = b["median_us"] / a["median_us"]
    change = (ratio - 1.0) * 100.0
    if not reasons and abs(change) / 100.0 <= benchstats.NOISE:
        reasons.append(f"difference within noise ({change:+.2f}%, claims need more than ±{benchstats.NOISE * 100:g}%)")
    claim = "no directional claim" if reasons else ("B faster" if change < 0 else "B slower")
    return {"claim": claim, "ratio_b_over_a": ratio, "change_pct": change,
            "threshold_pct": benchstats.NOISE * 100, "reason": "; ".join(reasons) or None}


def overall_verdict(inputs: int, equal: int, envelopes: dict | None, not_measured: str | None = None) -> tuple[str, str]:
    """(verdict, reason): bitwise first, then timing. `b_faster`/`b_slower` only when every envelope
    claims it; anything else that was measured is `no_claim`."""
    if equal != inputs:
        return "bitwise_mismatch", f"{inputs - equal} of {inputs} input sets gave outputs of A and B that differ"
    if envelopes is None:
        return "not_measured", not_measured or "timing not measured"
    claims = {env: e["claim"] for env, e in envelopes.items()}
    if claims and all(c == "B faster" for c in claims.values()):
        return "b_faster", "B faster than A beyond the noise in every envelope (" + ", ".join(claims) + ")"
    if claims and all(c == "B slower" for c in claims.values()):
        return "b_slower", "B slower than A beyond the noise in every envelope (" + ", ".join(claims) + ")"
    return "no_claim", "; ".join(f"{env}: {e['claim']}" + (f" ({e['reason']})" if e["reason"] else "")
                                 for env, e in envelopes.items())


# --- the problem: static buffers, both variants, the consumer --------------------------------

class Problem:
    """Static buffers the variants read (graphs capture these addresses; fresh inputs are copied in).

    A's segment weights are row views of B's joined weight: the same bytes, so A and B read the same data.
    """

    def __init__(self, K: int, sizes: list[int], out_dtypes: list[torch.dtype], gemm_n: int,
                 dtype: torch.dtype, device: str):
        self.K, self.sizes, self.out_dtypes, self.gemm_n, self.dtype, self.device = K, sizes, out_dtypes, gemm_n, dtype, device
        self.x = torch.empty(K, dtype=dtype, device=device)
        self.w = torch.empty(sum(sizes), K, dtype=dtype, device=device)
        self.parts = list(self.w.split(sizes))
        self.xg = torch.empty(K, dtype=dtype, device=device)
        self.wg = torch.empty(gemm_n, K, dtype=dtype, device=device)
        self.names = [f"segment{i}" for i in range(len(sizes))] + ["gemm"]
        dts = out_dtypes + [dtype]
        nbytes = [n * torch.empty(0, dtype=d).element_size() for n, d in zip(sizes + [gemm_n], dts)]
        self.slices = list(zip(np.cumsum([0] + nbytes[:-1]).tolist(), np.cumsum(nbytes).tolist(), dts))

    def draw(self, i: int) -> None:
        """Input set i: fresh x, GEMM input and weights (randn, weights scaled by K^-1/2), seeded SEED + i."""
        g = torch.Generator(device=self.device).manual_seed(SEED + i)
        for buf, scale in ((self.x, 1.0), (self.xg, 1.0), (self.w, self.K ** -0.5), (self.wg, self.K ** -0.5)):
            buf.copy_(torch.randn(buf.shape, generator=g, device=self.device) * scale)

    def result(self) -> torch.Tensor:
        return torch.empty(self.slices[-1][1], dtype=torch.uint8, device=self.device)

    def unpack(self, res: torch.Tensor) -> list[torch.Tensor]:
        return [res[a:b].clone().view(d) for a, b, d in self.slices]


def consume(outs: list[torch.Tensor], res: torch.Tensor) -> None:
    """The consumer: one kernel on the current stream reading every output, packing its bytes into res."""
    torch.cat([o.reshape(-1).view(torch.uint8) for o in outs], out=res)


def variant_a(gemv, p: Problem) -> list[torch.Tensor]:
    outs = [gemv.gemv_exact(p.x, w, d) for w, d in zip(p.parts, p.out_dtypes)]
    return outs + [F.linear(p.xg, p.wg)]


def variant_b(gemv, p: Problem, aux=None) -> list[torch.Tensor]:
    if aux is None:  # CPU: no streams, same calls
        return list(gemv.gemv_fused(p.x, p.w, p.sizes, p.out_dtypes)) + [F.linear(p.xg, p.wg)]
    main = torch.cuda.current_stream()
    aux.wait_stream(main)  # fork: the fused GEMV sees this set's inputs
    with torch.cuda.stream(aux):
        segs = list(gemv.gemv_fused(p.x, p.w, p.sizes, p.out_dtypes))
    y = F.linear(p.xg, p.wg)
    main.wait_stream(aux)  # join before the consumer
    return segs + [y]


def capture(fn, res: torch.Tensor, warm_iters: int = 3):
    """Warm fn up eagerly on a side stream (Triton compiles, cuBLAS picks), then capture fn + consumer."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_iters):
            consume(fn(), res)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        consume(fn(), res)
    return g


# --- bitwise -----------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())


def bitwise(gemv, p: Problem, inputs: int, cuda: bool, aux=None) -> tuple[dict, tuple | None]:
    """Every output of A and B compared bit for bit on `inputs` fresh input sets (and graph A vs eager A).

    Returns the record and, on CUDA, the captured graphs (A, B) for the timing part."""
    per_output = dict.fromkeys(p.names, 0)
    equal = graph_eager = 0
    mismatched, first = [], None
    res_a, res_b, res_e = p.result(), p.result(), p.result()
    graphs = None
    if cuda:
        p.draw(0)
        graphs = (capture(lambda: variant_a(gemv, p), res_a), capture(lambda: variant_b(gemv, p, aux), res_b))
    for i in range(inputs):
        p.draw(i)
        if cuda:
            res_a.fill_(0x00)  # different sentinels: a consumer that did not run cannot compare equal
            res_b.fill_(0xFF)
            graphs[0].replay()
            graphs[1].replay()
            consume(variant_a(gemv, p), res_e)
            torch.cuda.synchronize()
            graph_eager += bool(torch.equal(res_a, res_e))
        else:
            consume(variant_a(gemv, p), res_a)
            consume(variant_b(gemv, p), res_b)
        same = [bool(torch.equal(res_a[lo:hi], res_b[lo:hi])) for lo, hi, _ in p.slices]
        for name, ok in zip(p.names, same):
            per_output[name] += ok
        if all(same):
            equal += 1
        else:
            mismatched.append(i)
            if first is None:
                ua, ub = p.unpack(res_a), p.unpack(res_b)
                first = {"input": i, "outputs": {n: {"elements_differ": int((_bits(x) != _bits(y)).sum()),
                                                     "max_abs_diff": _max_abs_diff(x, y)}
                                                 for n, ok, x, y in zip(p.names, same, ua, ub) if not ok}}
        if (i + 1) % 16 == 0 or i + 1 == inputs:
            print(f"[overlap] bitwise {i + 1}/{inputs}: {equal} equal"
                  + (f", graph A = eager A {graph_eager}" if cuda else ""), flush=True)
    return {
        "inputs": inputs, "all_outputs_equal": equal, "per_output_equal": per_output,
        "mismatched_inputs": mismatched[:100], "first_mismatch": first, "seed": SEED,
        "compared": "bytes of every output (" + ", ".join(p.names) + ") of A against B, per input set",
        "graph_equal_eager": graph_eager if cuda else None,
        "graph_equal_eager_reason": None if cuda else "no CUDA graphs on the CPU: both variants ran eagerly",
    }, graphs


# --- timing (CUDA) -------------------------------------------------------------------------------

def timing(graphs, trials: int, warmup: int) -> tuple[dict, list[list]]:
    """Per-trial µs of each graph replay, warm and scrubbed; A and B interleaved ABBA."""
    dev = torch.cuda.current_device()
    l2 = int(torch.cuda.get_device_properties(dev).L2_cache_size)
    flush = torch.empty(max(FLUSH_FACTOR * l2, 1 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    blocks = np.array_split(np.arange(trials), min(BLOCKS, trials))
    rows, samples = [], {env: {v: [] for v in VARIANTS} for env in ENVELOPES}
    for env in ENVELOPES:
        events = []
        for b, block in enumerate(blocks):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # the GPU waits while the host queues the whole block
            for t in block.tolist():
                for v in (VARIANTS if t % 2 == 0 else VARIANTS[::-1]):
                    if env == "scrubbed":
                        flush.zero_()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs[VARIANTS.index(v)].replay()
                    end.record()  # on the main stream after the graph's join: covers the aux work too
                    events.append((b, t, v, start, end))
        torch.cuda.synchronize()
        for b, t, v, start, end in events:
            us = start.elapsed_time(end) * 1e3
            samples[env][v].append(us)
            rows.append([env, b, t, v, us])
        print(f"[overlap] {env}: A median {np.median(samples[env]['A']):.2f} us, "
              f"B median {np.median(samples[env]['B']):.2f} us ({trials} trials each)", flush=True)
    envelopes = {}
    for env in ENVELOPES:
        a, b = variant_stats(samples[env]["A"]), variant_stats(samples[env]["B"])
        envelopes[env] = {"A": a, "B": b, **envelope_claim(a, b)}
    meta = {"timer": "cuda_events on the main stream around each graph replay", "trials": trials, "warmup": warmup,
            "blocks": len(blocks), "order": "ABBA (A first on even trials, B first on odd)", "l2_bytes": l2,
            "flush_bytes": int(flush.numel()), "scrub": f"flush.zero_() of {FLUSH_FACTOR}x L2 before each scrubbed trial",
            "noise": benchstats.NOISE}
    return {"measured": True, "reason": None, **meta, "envelopes": envelopes}, rows


# --- plot ------------------------------------------------------------------------------------

def plot(screen: dict, rows: list[list], path: Path) -> Path:
    """Box plots of A and B per envelope (CUDA), or a panel saying what was checked (CPU).
    Bare Figure on Agg, PNG "Software" chunk stripped: same input, same bytes (as benchstats.plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bw = screen["bitwise"]
    head = f"bitwise: {bw['all_outputs_equal']}/{bw['inputs']} input sets equal; verdict {screen['verdict']}"
    timing_ = screen["timing"]
    if not timing_["measured"]:
        fig = Figure(figsize=(7, 2.5))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.axis("off")
        sh = screen["shapes"]
        ax.text(0.5, 0.75, "Overlap A/B screen: " + head, ha="center", va="center", fontsize=10)
        ax.text(0.5, 0.5, f"K={sh['K']} -> {'+'.join(map(str, sh['segments']))} beside GEMM K={sh['K']} -> "
                f"{sh['gemm_n']} ({sh['source']} shapes)", ha="center", va="center", fontsize=9)
        ax.text(0.5, 0.25, f"timing: {timing_['reason']}", ha="center", va="center", fontsize=9)
    else:
        fig = Figure(figsize=(10, 4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(ENVELOPES))
        for ax, env in zip(axes, ENVELOPES):
            data = [[r[4] for r in rows if r[0] == env and r[3] == v] for v in VARIANTS]
            ax.boxplot(data, showfliers=False, whis=(10, 90))
            ax.set_xticks([1, 2], ["A: split, main", "B: fused, aux"])
            e = timing_["envelopes"][env]
            for x, v in enumerate(VARIANTS, start=1):
                ax.annotate(f"{e[v]['median_us']:.1f}", (x, e[v]["median_us"]), textcoords="offset points",
                            xytext=(18, 0), fontsize=8, va="center")
            ax.set_ylabel("graph replay (µs), whiskers p10/p90")
            ax.set_title(f"{env}: {e['claim']} (B/A {e['ratio_b_over_a']:.3f})", fontsize=10)
            ax.set_ylim(bottom=0)  # a zoomed axis would draw a 3% difference as a gulf
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle("Overlap A/B screen — " + head, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, metadata={"Software": None})
    return write_bytes(path, buf.getvalue())


# --- the stage -------------------------------------------------------------------------------

def _kernels(device: str):
    """Import the kernels after the device is known: the interpreter switch is read at decoration time."""
    if device == "cpu":
        if "kernels.gemv" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("kernels.gemv was imported before TRITON_INTERPRET=1 was set; run the CPU screen "
                               "in a fresh process")
        os.environ["TRITON_INTERPRET"] = "1"
    import kernels.gemv as gemv

    return gemv


def shapes_of(cfg: dict, cuda: bool) -> dict:
    segs, dts = list(cfg["segments"]), list(cfg["segment_dtypes"])
    if len(segs) != len(dts):
        raise ValueError(f"overlap.segments {segs} and overlap.segment_dtypes {dts} differ in length")
    if cuda:
        shape = {"source": "config", "K": cfg["K"], "segments": segs, "gemm_n": cfg["gemm_n"], "reason": None}
    else:
        shape = {"source": "cpu-small", **CPU_SHAPES, "segments": CPU_SHAPES["segments"][:len(segs)],
                 "reason": CPU_REASON, "configured": {"K": cfg["K"], "segments": segs, "gemm_n": cfg["gemm_n"]}}
    return {**shape, "joined_n": sum(shape["segments"]), "segment_dtypes": dts, "dtype": cfg["dtype"]}


def run(evidence: Path) -> dict:
    config = read_config(evidence / "config.yaml")
    cfg = config["overlap"]
    device = resolve_device(config["device"])
    cuda = device.startswith("cuda")
    shapes = shapes_of(cfg, cuda)
    params = {"device": device, "inputs": cfg["inputs"], "trials": cfg["trials"] if cuda else 0,
              "warmup": cfg["warmup"] if cuda else 0, "shape_source": shapes["source"], "K": shapes["K"],
              "segments": shapes["segments"], "segment_dtypes": shapes["segment_dtypes"], "gemm_n": shapes["gemm_n"],
              "dtype": shapes["dtype"]}
    with Stage(evidence, "overlap", params=params) as st:
        gemv = _kernels(device)
        import triton

        p = Problem(shapes["K"], shapes["segments"], [DTYPES[d] for d in shapes["segment_dtypes"]],
                    shapes["gemm_n"], DTYPES[shapes["dtype"]], device)
        print(f"[overlap] {device}: K={p.K} -> {'+'.join(map(str, p.sizes))} ({', '.join(shapes['segment_dtypes'])}) "
              f"beside GEMM K={p.K} -> {p.gemm_n}, {cfg['inputs']} input sets"
              + ("" if cuda else f"; {CPU_REASON}"), flush=True)
        aux = torch.cuda.Stream() if cuda else None
        with torch.inference_mode():
            bits, graphs = bitwise(gemv, p, cfg["inputs"], cuda, aux)
            if cuda:
                timed, rows = timing(graphs, cfg["trials"], cfg["warmup"])
            else:
                timed, rows = {"measured": False, "reason": CPU_REASON, "envelopes": None}, []
        verdict, reason = overall_verdict(bits["inputs"], bits["all_outputs_equal"], timed["envelopes"], timed["reason"])
        screen = {
            "device": device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "shapes": shapes,
            "variants": DESCRIPTION,
            "bitwise": bits,
            "timing": timed,
            "timings_csv": "one row per timed replay" if cuda else "header only: timing not measured",
            "verdict": verdict,
            "verdict_reason": reason,
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                         "triton_interpret": not cuda},
        }
        st.write_json("overlap/screen.json", screen)
        st.add_file(write_text(evidence / "overlap/timings.csv",
                               CSV_HEADER + "".join(f"{e},{b},{t},{v},{us:.4f}\n" for e, b, t, v, us in rows)))
        st.add_file(plot(screen, rows, evidence / "plots/overlap.png"))
        st.tags["overlap.verdict"] = verdict
        st.metrics["bitwise_inputs"] = bits["inputs"]
        st.metrics["bitwise_equal"] = bits["all_outputs_equal"]
        if cuda:
            st.metrics["graph_equal_eager"] = bits["graph_equal_eager"]
            for env, e in timed["envelopes"].items():
                st.metrics[f"{env}_a_median_us"] = e["A"]["median_us"]
                st.metrics[f"{env}_b_median_us"] = e["B"]["median_us"]
                st.metrics[f"{env}_b_over_a"] = e["ratio_b_over_a"]
        print(f"[overlap] verdict {verdict}: {reason}", flush=True)
    return screen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evidence", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        run(args.evidence)
    except (ValueError, RuntimeError, benchstats.BenchError) as e:
        sys.exit(f"[overlap] error: {e}")


if __name__ == "__main__":
    main()
