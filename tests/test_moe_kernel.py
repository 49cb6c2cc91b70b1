"""The routed-experts kernels (kernels/moe.py) against torch references on fresh random inputs: both kernels (the
one-row kernel at B = 1, the tensor-core one at B >= 2), identical rows bitwise identical within a call, groups
larger than the tensor-core tile, ids of -1 (pairs computed on another device), the route, the fallbacks and
shape errors.

Without a GPU these run through the Triton interpreter (tests/conftest.py) on small, ragged shapes (one with
K above the K blocks, so the K loop and its masked tail run); with one, at DeepSeek-V2-Lite's shape, plus
CUDA-graph capture and replay.
"""
import pytest
import torch
import triton
import triton.language as tl

from evident.kernels import moe, pdl
from evident.kernels.graphs import capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (D, I, E, k): DeepSeek-V2-Lite on a GPU. On the CPU ragged shapes: one K slice, and K above the K blocks in
# both kernels (the K loop and its masked tail); the interpreter is slow, so the long one runs in one dtype only,
# each dtype meets both kernels (B = 1 and 3), and B = 8 (the tensor-core kernel again) runs in bfloat16 only.
FULL, SMALL, LONG = (2048, 1408, 64, 6), (96, 40, 8, 3), (530, 520, 4, 2)
MATCH = [(FULL, dt, B) for dt in DTYPES for B in (1, 3, 8)] if CUDA else \
    [(SMALL, dt, B) for dt in DTYPES for B in (1, 3)] + [(SMALL, torch.bfloat16, 8)] + \
    [(LONG, torch.bfloat16, B) for B in (1, 8)]
ROWS = FULL if CUDA else SMALL
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # fp32 sums; h rounds once


@triton.jit
def _now():
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.full([1], 0, tl.int32)], dtype=tl.int64,
                                  is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit
def _late_copy(src, dst, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """dst = src, DELAY_NS after this launch has let the next one start (a writer slower than its reader)."""
    pdl.wait(PDL)
    start = _now()
    while _now() - start < DELAY_NS:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs each run
    return g


def problem(B, D, I, E, k, dtype, gen, same_rows=False):
    """Fresh random x, w13, w2, distinct expert ids per row and fp32 weights (never zeros)."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)
    x = rand(1 if same_rows else B, D).expand(B, D).contiguous()
    w13, w2 = rand(E, 2 * I, D, scale=D**-0.5), rand(E, D, I, scale=I**-0.5)
    rows = 1 if same_rows else B
    ids = torch.rand(rows, E, generator=gen, device=DEV).argsort(-1)[:, :k].expand(B, k).contiguous()
    weights = torch.rand(rows, k, generator=gen, device=DEV).expand(B, k).contiguous() + 0.1
    return x, w13, w2, ids, weights


def naive(x, w13, w2, ids, weights):
    """An independent reference, pair by pair: (h, y, out) with h and y 0 for -1 pairs, out over the others."""
    B, k = ids.shape
    inter = w13.shape[1] // 2
    h = torch.zeros(B, k, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(B, k, w2.shape[1], device=x.device)
    out = torch.zeros(B, w2.shape[1], device=x.device)
    for b in range(B):
        for s in range(k):
            e = int(ids[b, s])
            if e < 0:
                continue
            gu = w13[e].float() @ x[b].float()
            h[b, s] = (torch.nn.functional.silu(gu[:inter]) * gu[inter:]).to(x.dtype)
            y[b, s] = w2[e].float() @ h[b, s].float()
            out[b] += weights[b, s].float() * y[b, s]
    return h, y, out


@pytest.mark.parametrize("shape,dtype,B", MATCH, ids=lambda v: str(v).removeprefix("torch."))
def test_kernels_match_reference(shape, dtype, B, gen):
    D, I, E, k = shape
    x, w13, w2, ids, weights = problem(B, D, I, E, k, dtype, gen)
    assert moe.moe_reason(x, w13, w2, ids, weights) is None
    h = moe.experts_gate_up(x, w13, ids)
    assert h.shape == (B, k, I) and h.dtype == dtype and torch.isfinite(h).all()
    assert rel_err(h, moe._gate_up_torch(x, w13, ids)) < TOL[dtype]
    y = moe.experts_down(h, w2, ids)
    assert y.shape == (B, k, D) and y.dtype == torch.float32
    assert rel_err(y, moe._down_torch(h, w2, ids)) < 1e-5  # the same h: only fp32 sum order differs
    out = moe.moe_experts(x, w13, w2, ids, weights)
    assert out.shape == (B, D) and out.dtype == torch.float32
    assert rel_err(out, moe.moe_reference(x, w13, w2, ids, weights)) < TOL[dtype], (B, dtype)
    # the weighted sum rounds each product before adding, as the torch path does: bitwise given the same y
    assert torch.equal(out, moe._combine_torch(y, weights))
    if CUDA:  # deterministic (under the interpreter numpy is)
        assert torch.equal(out, moe.moe_experts(x, w13, w2, ids, weights))


def alike_rows(case, gen, dtype):
    """(x, w13, w2, ids, weights, classes): each class lists rows with the same x, ids and weights."""
    D, I, E, k = ROWS
    if case == "alike-8":  # the benchmark's batch: every row the same prompt
        x, w13, w2, ids, weights = problem(8, D, I, E, k, dtype, gen, same_rows=True)
        return x, w13, w2, ids, weights, [list(range(8))]
    if case == "repeats-16":  # MAX_B rows, each choosing expert 1 twice: a group of 32 pairs, two G-tiles
        x, w13, w2, ids, weights = problem(moe.MAX_B, D, I, E, k, dtype, gen, same_rows=True)
        ids[:, 1] = ids[:, 0]
        return x, w13, w2, ids, weights, [list(range(moe.MAX_B))]
    # some rows alike, at different places of their groups, among distinct rows
    x, w13, w2, ids, weights = problem(5, D, I, E, k, dtype, gen)
    for t in (x, ids, weights):
        t[2], t[4] = t[0], t[0]
    return x, w13, w2, ids, weights, [[0, 2, 4]]


@pytest.mark.parametrize("case", ["alike-8", "repeats-16", "some-alike-5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if CUDA else [torch.bfloat16])
def test_identical_rows_are_bitwise_identical(case, dtype, gen):
    """Rows of one call with the same input and experts give the same bits, whatever their place in a tile or
    which tile of a large group they fall in (the decode pipeline's parity gate checks this); and are right."""
    x, w13, w2, ids, weights, classes = alike_rows(case, gen, dtype)
    route = moe.route(ids)
    h = moe.experts_gate_up(x, w13, ids, route=route)
    y = moe.experts_down(h, w2, ids, route=route)
    out = moe.moe_experts(x, w13, w2, ids, weights)
    for rows in classes:
        for r in rows[1:]:
            assert torch.equal(h[r], h[rows[0]]) and torch.equal(y[r], y[rows[0]]), (case, r)
            assert torch.equal(out[r], out[rows[0]]), (case, r)
    assert rel_err(out, naive(x, w13, w2, ids, weights)[2]) < TOL[dtype]


def test_groups_larger_than_the_tile_are_right(gen):
    """ids should be distinct per row, but a row repeating an expert, or MAX_B rows on one expert, make groups
    larger than G: they are split into G-tiles. Every row chooses expert 1 twice, row 0 three times: 33 pairs."""
    D, I, E, k = SMALL
    x, w13, w2, ids, weights = problem(moe.MAX_B, D, I, E, k, torch.float32, gen)
    ids[:, 2] = torch.where(ids[:, 2] == 1, ids[:, 0], ids[:, 2])  # slot 2: another expert, but in row 0
    ids[:, :2], ids[0, 2] = 1, 1
    assert (ids == 1).sum() == 2 * moe.G + 1
    _, y, out = naive(x, w13, w2, ids, weights)
    assert rel_err(moe.experts_down(moe.experts_gate_up(x, w13, ids), w2, ids), y) < 1e-5
    assert rel_err(moe.moe_experts(x, w13, w2, ids, weights), out) < 1e-5
    one = moe.moe_experts(x[:1], w13, w2, ids[:1], weights[:1])  # B = 1: the one-row kernel
    assert rel_err(one, out[:1]) < 1e-5


@pytest.mark.parametrize("B", [1, 2, 5])
def test_pairs_of_minus_one_are_not_computed(B, gen):
    """ids of -1 (computed on another device): y's rows are 0.0, out sums the other slots, valid h and y rows
    are right, in the kernels and the torch path alike. The experts no valid pair chose (0 and E-1 among them:
    where -1 would land clamped or wrapped) hold NaN: a -1 pair reading any weights would show."""
    D, I, E, k = SMALL
    x, w13, w2, ids, weights = problem(B, D, I, E, k, torch.bfloat16, gen)
    ids = torch.randint(1, E - 1, (B, k), generator=gen, device=DEV)  # repeats are fine; 0 and E-1 unused
    ids[torch.rand(B, k, generator=gen, device=DEV) < 0.4] = -1
    ids[0, 0], ids[0, -1] = -1, 3  # at least one of each, in row 0 (never the all -1 row below)
    if B > 1:
        ids[B // 2] = -1  # a row computed entirely elsewhere
    unused = torch.ones(E, dtype=torch.bool, device=DEV)
    unused[ids[ids >= 0]] = False
    w13[unused], w2[unused] = float("nan"), float("nan")
    here = ids >= 0
    h_ref, y_ref, out_ref = naive(x, w13, w2, ids, weights)
    route = moe.route(ids)  # None at B = 1

    def check(h, y, out):  # bf16 h: one rounding may differ from naive's by an ulp
        tol = TOL[torch.bfloat16]
        assert rel_err(h[here], h_ref[here]) < tol
        assert rel_err(y, y_ref) < tol and torch.equal(y[~here], torch.zeros_like(y[~here]))
        assert rel_err(out, out_ref) < tol and torch.isfinite(out).all()
        if B > 1:
            assert torch.equal(out[B // 2], torch.zeros_like(out[B // 2]))

    assert moe.moe_reason(x, w13, w2, ids, weights) is None
    h = moe.experts_gate_up(x, w13, ids, route=route)
    y = moe.experts_down(h, w2, ids, route=route)
    check(h, y, moe.moe_experts(x, w13, w2, ids, weights))
    assert rel_err(y, moe._down_torch(h, w2, ids)) < 1e-5  # the same h: only fp32 sum order differs
    # the torch path (int32 ids are not admitted) and its pieces honour -1 alike
    assert "int64" in moe.moe_reason(x, w13, w2, ids.int())
    h32 = moe.experts_gate_up(x, w13, ids.int())
    check(h32, moe.experts_down(h32, w2, ids.int()), moe.moe_experts(x, w13, w2, ids.int(), weights))
    check(moe._gate_up_torch(x, w13, ids), y_ref, moe.moe_reference(x, w13, w2, ids, weights))


def test_route_argument(gen):
    """A route sorted once serves both calls and gives the same bits as sorting in each; a route of other ids'
    shape is an error."""
    D, I, E, k = SMALL
    x, w13, w2, ids, weights = problem(3, D, I, E, k, torch.bfloat16, gen)
    route = moe.route(ids)
    h = moe.experts_gate_up(x, w13, ids, route=route)
    assert torch.equal(h, moe.experts_gate_up(x, w13, ids))
    assert torch.equal(moe.experts_down(h, w2, ids, route=route), moe.experts_down(h, w2, ids))
    assert torch.equal(moe.moe_experts(x, w13, w2, ids, weights, route=route),
                       moe.moe_experts(x, w13, w2, ids, weights))
    with pytest.raises(ValueError, match="route"):
        moe.experts_gate_up(x, w13, ids, route=moe.route(ids[:2]))
    with pytest.raises(ValueError, match="route"):
        moe.experts_down(h, w2, ids, route=route[:1])


# under the interpreter both dtypes take the kernel's fp32 products (F32), so one shows the tiles and the search
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32], ids=str)
def test_a_prefill_s_rows_beyond_max_b_take_the_tensor_core_kernel(dtype, gen):
    """A prefill's B x L tokens: more rows than a decode step's MAX_B, groups of many G-tiles, whose later leaders
    find their group's start by binary search."""
    D, I, E, k = SMALL
    x, w13, w2, ids, weights = problem(3 * moe.MAX_B + 1, D, I, E, k, dtype, gen)
    ids = torch.where(ids == E - 1, ids[:, :1], ids)
    ids[:, 0] = E - 1  # every row chooses the last expert once: 49 pairs (four tiles) from the 98th sorted pair on
    assert moe.moe_reason(x, w13, w2, ids, weights) is None
    _, y, out = naive(x, w13, w2, ids, weights)
    assert rel_err(moe.experts_down(moe.experts_gate_up(x, w13, ids), w2, ids), y) < TOL[dtype]
    assert rel_err(moe.moe_experts(x, w13, w2, ids, weights), out) < TOL[dtype]


def test_inadmissible_inputs_fall_back(gen, monkeypatch):
    D, I, E, k = SMALL
    B = moe.MAX_PAIRS // k + 1  # more sorted pairs than the grid holds
    x, ids = torch.empty(B, D, device=DEV), torch.zeros(B, k, dtype=torch.long, device=DEV)
    w13, w2 = torch.empty(E, 2 * I, D, device=DEV), torch.empty(E, D, I, device=DEV)
    assert "pairs" in moe.moe_reason(x, w13, w2, ids)
    x, w13, w2, ids, weights = problem(3, D, I, E, k, torch.bfloat16, gen)
    assert "int64" in moe.moe_reason(x, w13, w2, ids.int())
    assert torch.equal(moe.moe_experts(x, w13, w2, ids.int(), weights),
                       moe.moe_reference(x, w13, w2, ids.int(), weights))
    assert torch.equal(moe.experts_gate_up(x, w13, ids.int()), moe._gate_up_torch(x, w13, ids.int()))
    # non-contiguous weights: the torch path, close to the kernel on a contiguous copy
    x, w13, w2, ids, weights = problem(3, D, I, E, k, torch.float32, gen)
    w13t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in moe.gate_up_reason(x, w13t, ids)
    assert "contiguous" in moe.moe_reason(x, w13t, w2, ids)
    want = moe.moe_experts(x, w13, w2, ids, weights)
    assert rel_err(moe.moe_experts(x, w13t, w2, ids, weights), want) < 1e-5
    h = moe.experts_gate_up(x, w13, ids)
    ht = h.transpose(0, 1).contiguous().transpose(0, 1)
    assert "contiguous" in moe.down_reason(ht, w2, ids)
    assert rel_err(moe.experts_down(ht, w2, ids), moe.experts_down(h, w2, ids)) < 1e-5
    # dtype mismatch, int32 ids, fp64
    assert "dtype" in moe.moe_reason(x, w13.half(), w2.half(), ids)
    assert torch.equal(moe.moe_experts(x, w13.half(), w2.half(), ids, weights),
                       moe.moe_reference(x, w13.half(), w2.half(), ids, weights))
    assert "int64" in moe.moe_reason(x, w13, w2, ids.int())
    assert rel_err(moe.moe_experts(x, w13, w2, ids.int(), weights), want) < 1e-5
    assert moe.moe_experts(x.double(), w13.double(), w2.double(), ids, weights).dtype == torch.float32
    # a CPU tensor outside the interpreter is not admitted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in moe.moe_reason(x.cpu(), w13.cpu(), w2.cpu(), ids.cpu())


@pytest.mark.parametrize("published", [1, 0])
def test_shared_slots_started_early_compute_the_same(published, gen):
    """At B = 1 with ``shared``, the last S slots are the stack's last S experts, read with no id, their programs first
    in the grid and started once the router has published x (ready 1) or after its end (ready 0): h the same bits as
    the plain launch's either way, written into the buffer given."""
    D, I, E, k = ROWS
    S = 2
    x, w13, _, _, _ = problem(1, D, I, E + S, k, torch.bfloat16, gen)
    routed = torch.randperm(E, generator=gen, device=DEV)[:k]
    ids = torch.cat([routed, torch.arange(E, E + S, device=DEV)])[None]
    plain = moe.experts_gate_up(x, w13, ids)
    out = torch.full_like(plain, float("nan"))
    ready = torch.tensor([published], dtype=torch.int32, device=DEV)
    got = moe.experts_gate_up(x, w13, ids, shared=(ready, S), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, plain)


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU")
def test_shared_slots_started_early_read_this_step_s_x_in_a_graph(gen):
    """The router's launch, then gate_up with its shared slots started early, captured in a CUDA graph (the decode
    step's order, under programmatic dependent launch) and replayed on a fresh residual each time: h the same bits as
    gate_up's after the router's end. A shared slot that read x before the router published it would read the last
    replay's x."""
    from evident.kernels import route

    D, I, E, k = FULL
    S = 2
    _, w13, _, _, _ = problem(1, D, I, E + S, k, torch.bfloat16, gen)
    h, delta = torch.randn(2, 1, D, generator=gen, device=DEV).to(torch.bfloat16)
    norm_w = (torch.rand(D, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    gate = torch.randn(E, D, generator=gen, device=DEV) * D**-0.5
    counter, ready = torch.zeros(2, 1, dtype=torch.int32, device=DEV)
    out = torch.empty(1, k + S, I, dtype=torch.bfloat16, device=DEV)  # made before the router's launch

    def step():
        _, x, ids, _ = route.add_norm_route(h, delta, norm_w, 1e-6, gate, k, True, 1.0, shared=S, counter=counter,
                                            ready=ready)
        return x, ids, moe.experts_gate_up(x, w13, ids, shared=(ready, S), out=out)

    graph, (x, ids, got) = capture(step)
    for _ in range(20):
        h.copy_(torch.randn(1, D, generator=gen, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, moe.experts_gate_up(x, w13, ids))


@pytest.mark.parametrize("B", [1, 2])  # the one launch, and the norm then the router
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_router_marks_h_unwritten(B, dtype, gen):
    """``h_reset``: the router fills the experts' h buffer with moe.sentinel's bits on each path, so that a down
    started early (``experts_down``'s early) sees every row as unwritten until this step's gate_up writes it; without
    ready (whose publication the fill precedes) it is an error."""
    from evident.kernels import route

    D, I, E, k = ROWS
    h, delta = (torch.randn(2, B, D, generator=gen, device=DEV)).to(dtype)
    norm_w = torch.ones(D, dtype=dtype, device=DEV)
    gate = torch.randn(E, D, generator=gen, device=DEV)
    buf = torch.randn(B, k + 1, I, generator=gen, device=DEV).to(dtype)
    bits = moe.sentinel(dtype)
    ready = torch.zeros(1, dtype=torch.int32, device=DEV)
    route.add_norm_route(h, delta, norm_w, 1e-6, gate, k, True, 1.0, shared=1, ready=ready, h_reset=(buf, bits))
    as_int = buf.view({2: torch.int16, 4: torch.int32}[buf.itemsize])
    assert bool((as_int == bits).all()) and bool(buf.isnan().all())
    with pytest.raises(ValueError, match="needs ready"):
        route.add_norm_route(h, delta, norm_w, 1e-6, gate, k, True, 1.0, shared=1, h_reset=(buf, bits))


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU")
def test_down_started_early_waits_for_h_written_late(gen):
    """Down started early (``early``) after a launch that lets it start at once and writes h only 100 µs later, into a
    buffer marked unwritten, captured in a CUDA graph (so no host time lies between the launches) and replayed: down's
    programs find the marks, wait for that launch's end, and y is the same bits as down's on h written beforehand. A
    down that went on without waiting would read the marks (NaN)."""
    D, I, E, k = FULL
    x, w13, w2, ids, _ = problem(1, D, I, E, k, torch.bfloat16, gen)
    h = moe.experts_gate_up(x, w13, ids)
    want = moe.experts_down(h, w2, ids)
    late = torch.empty_like(h)

    def step():
        late.view(torch.int16).fill_(moe.sentinel(h.dtype))
        _late_copy[(triton.cdiv(h.numel(), 1024),)](h, late, h.numel(), DELAY_NS=100_000, BLOCK=1024,
                                                    **pdl.flags(h.device))
        return moe.experts_down(late, w2, ids, early=1)

    graph, got = capture(step)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(late, h) and torch.equal(got, want)


def test_shape_errors_are_errors_not_fallbacks(gen):
    D, I, E, k = SMALL
    x, w13, w2, ids, weights = problem(3, D, I, E, k, torch.float32, gen)
    bad = [
        lambda: moe.experts_gate_up(x[:, :-1], w13, ids),  # D mismatch
        lambda: moe.experts_gate_up(x, w13[:, :-1], ids),  # odd 2I
        lambda: moe.experts_gate_up(x, w13, ids[:2]),  # ids for another batch
        lambda: moe.experts_gate_up(x, w13, ids.float()),  # float ids
        lambda: moe.experts_down(torch.ones(3, k + 1, I, device=DEV), w2, ids),  # h for other slots
        lambda: moe.experts_down(torch.ones(3, k, I + 1, device=DEV), w2, ids),  # I mismatch
        lambda: moe.moe_experts(x, w13, w2[:, :-1], ids, weights),  # w2 not [E, D, I]
        lambda: moe.moe_experts(x, w13, w2, ids, weights[:, :-1]),  # weights not [B, k]
        lambda: moe.moe_reference(x, w13, w2, ids, weights[:2]),
        lambda: moe.experts_gate_up(x, w13, ids, shared=(ids, 1)),  # early shared slots with no buffer made before
        lambda: moe.experts_gate_up(x, w13, ids, out=torch.empty(3, k, I + 1, device=DEV)),  # a buffer of other rows
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("B", [1, 8])
def test_cuda_graph_replay_is_bitwise(B, gen):
    D, I, E, k = FULL
    x, w13, w2, ids, weights = problem(B, D, I, E, k, torch.bfloat16, gen)

    def step():
        return moe.moe_experts(x, w13, w2, ids, weights)

    graph, out = capture(step)  # warmed up on a side stream, then captured
    for same_rows, minus in ((True, False), (False, False), (False, True)):  # new inputs into the captured buffers
        for t, new in zip((x, w13, w2, ids, weights), problem(B, D, I, E, k, torch.bfloat16, gen, same_rows)):
            t.copy_(new)
        if minus:  # some pairs computed elsewhere
            ids[:, ::2] = -1
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        assert rel_err(out, moe.moe_reference(x, w13, w2, ids, weights)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B,k", [(2, 1), (2, 3), (8, 6), (16, 6), (8, 25)])
def test_route_is_torch_s_stable_sort(B, k, gen):
    """The one-program sort the B >= 2 kernel groups pairs with: ties keep their order (a group's tokens
    ascend), -1 first. int32 ids, which no kernel admits, go through torch.sort. At B = 1 there is none."""
    ids = torch.randint(-1, 8 if B * k > 6 else 3, (B, k), generator=gen, device=DEV)
    want = torch.sort(ids.reshape(-1), stable=True)
    for got in (moe.route(ids), moe.route(ids.int())):
        assert got[0].dtype == got[1].dtype == torch.int64
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert moe.route(ids[:1]) is None
    with pytest.raises(ValueError):
        moe.route(ids.reshape(-1))


@pytest.mark.parametrize("B", [1, 3])
def test_swiglu_clamp(B, gen):
    """limit (DeepSeek-V4's swiglu clamp): gate at most limit, up within +-limit, in both kernels; the inputs are
    scaled so that most pre-activations pass the limit, so a kernel ignoring it is far off."""
    D, I, E, k = ROWS
    x, w13, w2, ids, weights = problem(B, D, I, E, k, torch.float32, gen)
    x = x * 8
    limit = 0.5
    gu = torch.stack([w13[ids[b]] @ x[b] for b in range(B)])  # [B, k, 2I]
    gate, up = gu[..., :I], gu[..., I:]
    want = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    h = moe.experts_gate_up(x, w13, ids, limit=limit)
    assert rel_err(h, want) < 1e-5
    assert rel_err(moe.experts_gate_up(x, w13, ids), want) > 0.5  # unclamped: the test can see the clamp
    out = moe.moe_experts(x, w13, w2, ids, weights, limit=limit)
    assert rel_err(out, moe.moe_reference(x, w13, w2, ids, weights, limit=limit)) < 1e-5
