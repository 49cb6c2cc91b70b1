"""Overlap A/B experiment: two variants of the same work compared bit for bit on fresh inputs, then timed.

A screen is what a factory returns (``Screen``: draw the inputs, run A, run B on optional side streams); the
built-in one, ``c4_screen``, puts the auxiliary GEMVs split on the main stream (A) against fused on a side stream
(B), and a campaign's own screens (`screens:`) come from factories in the user's code. Every screen runs here the
same way:

1. ``bitwise``: on each of ``inputs`` input sets (``draw(i)`` writes set i in place into the tensors A and B read),
   every output of A against B's bit for bit; on CUDA also A's graph replay against an eager run of A. Both
   variants end with the same consumer on the main stream: one kernel that packs the bytes of every output into
   a result buffer.
2. ``timing`` (CUDA only): both variants' graphs replayed ``trials`` times per envelope, ``warm`` (back to back)
   and ``scrubbed`` (a write of >= 2x the L2 size before each trial). A and B interleave (ABBA), so drift hits
   both. CUDA events on the main stream around each replay: B joins its side streams back before it returns, so
   the end event covers their work. The trials run in BLOCKS blocks, each queued behind a sleep kernel so the host
   is ahead of the GPU; the caller measures a variant's noise as the spread of its block medians.
Without CUDA the variants run eagerly (no side streams, no graphs); the built-in one through the Triton
interpreter on CPU_SHAPES.

The built-in's variants (``c4_screen``): A runs the split GEMVs (one ``gemv_exact`` per segment) and then the
main-stream GEMM of another projection (``F.linear``, K -> gemm_n, M=1), all on the main stream. B runs the fused
GEMV (``gemv_fused`` over the joined weight) on an auxiliary stream, overlapped with the same GEMM on the main
stream and joined back (main waits on aux). Its kernels module is an argument (``kernels.gemv``, imported by the
caller once TRITON_INTERPRET is settled: the switch is read when Triton decorates the kernels); dtypes are torch
dtypes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .graphs import capture

# Interpreter shapes: K spans two BLOCK_K slices (the contract's fixed K order), and the joined rows fit one
# interpreter program (64 rows), which costs the most per launch; one segment per screened segment.
CPU_SHAPES = {"K": 2048, "segments": [32, 16, 8, 4], "gemm_n": 48}
SEED = 0  # input set i is drawn from a generator seeded SEED + i
BLOCKS = 5  # timing blocks per envelope; a variant's noise is the spread of its block medians
FLUSH_FACTOR = 2  # the scrub writes FLUSH_FACTOR x the L2 size before each scrubbed trial
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep ahead of each block, so the host queues the block in time
CAPTURE_WARMUP = 3  # eager runs of each variant on a side stream before its capture
ENVELOPES = ("warm", "scrubbed")
VARIANTS = ("A", "B")
CONSUMER = "one kernel on the main stream packing every output's bytes into a result buffer"
DESCRIPTION = {
    "A": "split GEMVs (gemv_exact per segment) serially on the main stream, then the GEMM on the main stream",
    "B": "fused GEMV (gemv_fused) on an aux stream overlapped with the GEMM on the main stream, "
         "joined (main waits on aux) before the consumer",
    "consumer": CONSUMER,
}


class ScreenError(ValueError):
    """A factory's screen breaks the contract (``Screen``); the message names the screen and what to change."""


class Screen(NamedTuple):
    """What a screen factory returns: ``factory(device) -> Screen(draw, a, b, streams, names, variants)``, device
    being "cpu" or "cuda" (a plain tuple ``(draw, a, b[, streams])`` is read the same).

    draw(i): writes input set i (fresh values, seeded from i) in place into the tensors A and B read. On a GPU
        both variants run as CUDA graphs captured on those tensors, so an input set is copied in, never rebound.
    a(): variant A on the current stream; returns its outputs, a sequence of tensors.
    b(*streams): variant B; returns the same outputs (count, shapes, dtypes) as A. On a GPU it gets ``streams``
        side streams (torch.cuda.Stream): it forks them from the current stream and joins them back before it
        returns (a CUDA graph capture refuses unjoined work); on the CPU it gets None for each.
    streams: how many side streams B takes (0: none).
    names: a name per output (default output0, output1, ...).
    variants: what A and B are, in words: {"A": ..., "B": ...}.
    """
    draw: Callable[[int], None]
    a: Callable[[], Sequence[torch.Tensor]]
    b: Callable[..., Sequence[torch.Tensor]]
    streams: int = 0
    names: Sequence[str] | None = None
    variants: dict | None = None


def checked(made, what: str) -> Screen:
    """A factory's return value as a Screen, or ScreenError naming ``what`` (the screen) and the fix."""
    if not isinstance(made, tuple) or not 3 <= len(made) <= len(Screen._fields):
        raise ScreenError(f"{what}: the factory returned {type(made).__name__}"
                          + (f" of {len(made)} items" if isinstance(made, tuple) else "")
                          + "; return kernels.overlap.Screen(draw, a, b, streams=0) (or a tuple (draw, a, b[, streams]))")
    s = Screen(*made)
    bad = [f for f in ("draw", "a", "b") if not callable(getattr(s, f))]
    if bad:
        raise ScreenError(f"{what}: {', '.join(bad)} must be callable (draw(i) fills input set i, a() and b(*streams) "
                          "return the outputs)")
    if isinstance(s.streams, bool) or not isinstance(s.streams, int) or s.streams < 0:
        raise ScreenError(f"{what}: streams is {s.streams!r}; it is how many side streams b takes, an integer >= 0")
    if s.names is not None and (isinstance(s.names, str) or not all(isinstance(n, str) for n in s.names)):
        raise ScreenError(f"{what}: names is {s.names!r}; give a list of strings, one per output, or None")
    if s.variants is not None and not (isinstance(s.variants, dict) and set(s.variants) <= set(VARIANTS)):
        raise ScreenError(f"{what}: variants is {s.variants!r}; give {{'A': 'what A does', 'B': 'what B does'}}")
    return s


class Problem:
    """The built-in screen's static buffers (graphs capture these addresses; fresh inputs are copied in).

    A's segment weights are row views of B's joined weight: the same bytes, so A and B read the same data.
    """

    def __init__(self, K: int, sizes: list[int], out_dtypes: list[torch.dtype], gemm_n: int,
                 dtype: torch.dtype, device: str):
        self.K, self.sizes, self.out_dtypes, self.device = K, sizes, out_dtypes, device
        self.x = torch.empty(K, dtype=dtype, device=device)
        self.w = torch.empty(sum(sizes), K, dtype=dtype, device=device)
        self.parts = list(self.w.split(sizes))
        self.xg = torch.empty(K, dtype=dtype, device=device)
        self.wg = torch.empty(gemm_n, K, dtype=dtype, device=device)
        self.names = [f"segment{i}" for i in range(len(sizes))] + ["gemm"]

    fixed = False  # weights given (a model's own layer): input sets draw the inputs only

    def load(self, w: torch.Tensor, wg: torch.Tensor) -> None:
        """A model's own weights: the joined auxiliary rows [sum(sizes), K] and the GEMM's [gemm_n, K], kept for
        every input set."""
        if tuple(w.shape) != tuple(self.w.shape) or tuple(wg.shape) != tuple(self.wg.shape):
            raise ValueError(f"weights {tuple(w.shape)} and {tuple(wg.shape)} do not match the screened shapes "
                             f"{tuple(self.w.shape)} and {tuple(self.wg.shape)}")
        self.w.copy_(w)
        self.wg.copy_(wg)
        self.fixed = True

    def draw(self, i: int) -> None:
        """Input set i: fresh x, GEMM input and (unless fixed) weights (randn, weights scaled by K^-1/2), seeded
        SEED + i."""
        g = torch.Generator(device=self.device).manual_seed(SEED + i)
        bufs = [(self.x, 1.0), (self.xg, 1.0)] + ([] if self.fixed else [(self.w, self.K ** -0.5), (self.wg, self.K ** -0.5)])
        for buf, scale in bufs:
            buf.copy_(torch.randn(buf.shape, generator=g, device=self.device) * scale)


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


def c4_screen(device: str, *, gemv, K: int, sizes: list[int], out_dtypes: list[torch.dtype], gemm_n: int,
              dtype: torch.dtype, weights: tuple | None = None) -> Screen:
    """The built-in screen's factory (the stage binds the campaign's shapes): the auxiliary GEMVs split (A) against
    fused on one side stream (B); ``weights`` (joined auxiliary rows, GEMM rows): a model's own, kept for every
    input set."""
    p = Problem(K, sizes, out_dtypes, gemm_n, dtype, device)
    if weights is not None:
        p.load(*(t.to(device) for t in weights))
    return Screen(p.draw, lambda: variant_a(gemv, p), lambda aux: variant_b(gemv, p, aux), streams=1,
                  names=p.names, variants={v: DESCRIPTION[v] for v in VARIANTS})


class Layout:
    """Where each output's bytes sit in a result buffer: from A's and B's first outputs, which must agree."""

    def __init__(self, outs_a, outs_b, names: Sequence[str] | None, what: str):
        spec_a, spec_b = self.spec(outs_a, what, "A"), self.spec(outs_b, what, "B")
        if spec_a != spec_b:
            raise ScreenError(f"{what}: A returns {self.show(spec_a)} but B returns {self.show(spec_b)}; both return "
                              "the same outputs (count, shapes, dtypes)")
        self.names = list(names) if names is not None else [f"output{i}" for i in range(len(spec_a))]
        if len(self.names) != len(spec_a):
            raise ScreenError(f"{what}: {len(self.names)} names for {len(spec_a)} outputs")
        nbytes = [int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=d).element_size() for d, shape in spec_a]
        self.slices = list(zip(np.cumsum([0] + nbytes[:-1]).tolist(), np.cumsum(nbytes).tolist(), [d for d, _ in spec_a]))
        self.outputs = [{"name": n, "dtype": str(d).removeprefix("torch."), "shape": list(shape)}
                        for n, (d, shape) in zip(self.names, spec_a)]

    @staticmethod
    def spec(outs, what: str, variant: str) -> list[tuple]:
        if not isinstance(outs, (list, tuple)) or not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            raise ScreenError(f"{what}: variant {variant} returned {type(outs).__name__}; it returns its outputs, a "
                              "non-empty list of tensors")
        return [(o.dtype, tuple(o.shape)) for o in outs]

    @staticmethod
    def show(spec: list[tuple]) -> str:
        return "[" + ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, s in spec) + "]"

    def result(self, device: str) -> torch.Tensor:
        return torch.empty(self.slices[-1][1], dtype=torch.uint8, device=device)

    def unpack(self, res: torch.Tensor) -> list[torch.Tensor]:
        return [res[a:b].clone().view(d) for a, b, d in self.slices]


def consume(outs: list[torch.Tensor], res: torch.Tensor) -> None:
    """The consumer: one kernel on the current stream reading every output, packing its bytes into res."""
    flat = [o.reshape(-1).view(torch.uint8) for o in outs]
    if sum(f.numel() for f in flat) != res.numel():  # outputs whose shapes changed since the first input set
        raise ScreenError(f"the outputs hold {sum(f.numel() for f in flat)} bytes, the first input set's "
                          f"{res.numel()}; a screen's outputs keep their shapes and dtypes on every input set")
    torch.cat(flat, out=res)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.bool:
        return float((a != b).any())
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())


def _streams(screen: Screen, device: str) -> list:
    return [torch.cuda.Stream() for _ in range(screen.streams)] if device.startswith("cuda") else [None] * screen.streams


def layout(screen: Screen, device: str, what: str) -> Layout:
    """A's and B's outputs on input set 0, eagerly, checked against each other: the contract's last check, made on
    every screen before any is measured. ``what`` names the screen in a ScreenError."""
    screen.draw(0)
    lay = Layout(screen.a(), screen.b(*_streams(screen, device)), screen.names, what)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return lay


def bitwise(screen: Screen, lay: Layout, device: str, inputs: int, label: str = "") -> tuple[dict, tuple | None]:
    """Every output of A and B compared bit for bit on `inputs` fresh input sets (and graph A vs eager A); ``lay``:
    the screen's ``layout``, ``label`` names it in the progress lines.

    Returns the record and, on CUDA, the captured graphs (A, B) for the timing part."""
    cuda = device.startswith("cuda")
    streams = _streams(screen, device)

    def run_b():
        return screen.b(*streams)

    per_output = dict.fromkeys(lay.names, 0)
    equal = graph_eager = 0
    mismatched, first = [], None
    res_a, res_b, res_e = lay.result(device), lay.result(device), lay.result(device)
    graphs = None
    if cuda:
        graphs = (capture(lambda: consume(screen.a(), res_a), warmup=CAPTURE_WARMUP)[0],
                  capture(lambda: consume(run_b(), res_b), warmup=CAPTURE_WARMUP)[0])
    for i in range(inputs):
        screen.draw(i)
        if cuda:
            res_a.fill_(0x00)  # different sentinels: a consumer that did not run cannot compare equal
            res_b.fill_(0xFF)
            graphs[0].replay()
            graphs[1].replay()
            consume(screen.a(), res_e)
            torch.cuda.synchronize()
            graph_eager += bool(torch.equal(res_a, res_e))
        else:
            consume(screen.a(), res_a)
            consume(run_b(), res_b)
        same = [bool(torch.equal(res_a[lo:hi], res_b[lo:hi])) for lo, hi, _ in lay.slices]
        for name, ok in zip(lay.names, same):
            per_output[name] += ok
        if all(same):
            equal += 1
        else:
            mismatched.append(i)
            if first is None:
                ua, ub = lay.unpack(res_a), lay.unpack(res_b)
                first = {"input": i, "outputs": {n: {"elements_differ": int((_bits(x) != _bits(y)).sum()),
                                                     "max_abs_diff": _max_abs_diff(x, y)}
                                                 for n, ok, x, y in zip(lay.names, same, ua, ub) if not ok}}
        if (i + 1) % 16 == 0 or i + 1 == inputs:
            print(f"[overlap] {label}bitwise {i + 1}/{inputs}: {equal} equal"
                  + (f", graph A = eager A {graph_eager}" if cuda else ""), flush=True)
    return {
        "inputs": inputs, "all_outputs_equal": equal, "per_output_equal": per_output,
        "mismatched_inputs": mismatched[:100], "first_mismatch": first, "seed": SEED,
        "compared": "bytes of every output (" + ", ".join(lay.names) + ") of A against B, per input set",
        "outputs": lay.outputs,
        "graph_equal_eager": graph_eager if cuda else None,
        "graph_equal_eager_reason": None if cuda else "no CUDA graphs on the CPU: both variants ran eagerly",
    }, graphs


def timing(graphs, trials: int, warmup: int, label: str = "") -> tuple[dict, list[list]]:
    """(what was timed and how, one row [envelope, block, trial, variant, µs] per replay): each graph replayed
    `trials` times per envelope, warm and scrubbed, A and B interleaved ABBA."""
    dev = torch.cuda.current_device()
    l2 = int(torch.cuda.get_device_properties(dev).L2_cache_size)
    flush = torch.empty(max(FLUSH_FACTOR * l2, 1 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    blocks = np.array_split(np.arange(trials), min(BLOCKS, trials))
    rows = []
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
                    end.record()  # on the main stream after the graph's join: covers the side streams' work too
                    events.append((b, t, v, start, end))
        torch.cuda.synchronize()
        rows += [[env, b, t, v, start.elapsed_time(end) * 1e3] for b, t, v, start, end in events]
        medians = ", ".join(f"{v} median {np.median(samples(rows, env, v)):.2f} us" for v in VARIANTS)
        print(f"[overlap] {label}{env}: {medians} ({trials} trials each)", flush=True)
    meta = {"timer": "cuda_events on the main stream around each graph replay", "trials": trials, "warmup": warmup,
            "blocks": len(blocks), "order": "ABBA (A first on even trials, B first on odd)", "l2_bytes": l2,
            "flush_bytes": int(flush.numel()),
            "scrub": f"flush.zero_() of {FLUSH_FACTOR}x L2 before each scrubbed trial"}
    return meta, rows


def samples(rows: list[list], env: str, variant: str) -> list[float]:
    """One variant's µs in one envelope, in trial order, from timing's rows."""
    return [r[4] for r in rows if r[0] == env and r[3] == variant]
