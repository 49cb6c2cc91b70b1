"""kernels/route.py (the MoE router of the graph decode step) against an independent reference (torch softmax,
top-k by a Python sort on (-score, index)) on fresh random inputs: ids and weights for both weightings, the
shared slots, the remap, exact ties, batch independence, the fallbacks and shape errors; and the same for the group
routings (DeepSeek-V2's group_limited_greedy, DeepSeek-V3's noaux_tc) against a reference that ranks groups and
experts by Python sorts too, plus ties between groups and the bias's part.

Without a GPU the kernels run through the Triton interpreter (tests/conftest.py) on small ragged shapes: E=10
is three expert blocks, the last one partly masked; D=40 is one column split and D=300 two, the second masked.
The group routings at E=12 in groups of 3 and of 4. With a GPU, at DeepSeek-V2-Lite's shape (and V2's), plus
CUDA-graph capture and replay; the group routings at DeepSeek-V3's, Moonlight's and V2's shapes.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from evident.kernels import route as rt

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (D, E, k)
LITE, SMALL, SPLIT = (2048, 64, 6), (40, 10, 3), (300, 10, 3)
MATCH = [(s, dt, B) for s in (LITE, (5120, 160, 6)) for dt in DTYPES for B in (1, 8, 16)] if CUDA else \
    [(SMALL, dt, B) for dt in DTYPES for B in (1, 5)] + [(SPLIT, torch.bfloat16, 5)]
ROWS = LITE if CUDA else SMALL
SCALING = 2.5  # not 1, so a missing scaling shows


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs each run
    return g


def problem(B, D, E, dtype, gen):
    """x [B, D] in dtype, the fp32 gate [E, D]; logits of about unit size, never zeros."""
    x = torch.randn(B, D, generator=gen, device=DEV).to(dtype)
    return x, torch.randn(E, D, generator=gen, device=DEV) * D**-0.5


def reference(x, w, k, norm, scaling, shared=0):
    """Built here, not from kernels/route.py: (ids, weights, scores) with ids chosen by a Python sort."""
    scores = torch.softmax(x.float() @ w.float().T, dim=-1).cpu()
    E = w.shape[0]
    ids, weights = [], []
    for s in scores:
        top = sorted(range(E), key=lambda e: (-s[e].item(), e))[:k]
        v = s[top]
        v = v / (v.sum() + 1e-20) if norm and k > 1 else v * scaling
        ids.append(top + list(range(E, E + shared)))
        weights.append(torch.cat([v, torch.ones(shared)]))
    return torch.tensor(ids, dtype=torch.int64), torch.stack(weights), scores


def assert_routes(got, want, k, rel=1e-5):
    """Equal ids slot by slot, except that rounding may swap experts whose reference scores agree to `rel`;
    the weights agree to fp32 rounding (a swapped pair's weights are equally close)."""
    (ids, wts), (ref_ids, ref_wts, scores) = got, want
    ids, wts = ids.cpu(), wts.cpu()
    torch.testing.assert_close(wts, ref_wts, rtol=rel, atol=1e-6)
    for b, s in torch.nonzero(ids != ref_ids).tolist():
        assert s < k, (b, s, ids[b], ref_ids[b])  # shared slots are never swapped
        a, r = scores[b, ids[b, s]].item(), scores[b, ref_ids[b, s]].item()
        assert abs(a - r) <= rel * r, (b, s, ids[b], ref_ids[b], a, r)


@pytest.mark.parametrize("shape,dtype,B", MATCH, ids=lambda v: str(v).removeprefix("torch."))
def test_add_norm_route_is_the_norm_then_the_router_in_one_launch(shape, dtype, B, gen):
    """add_norm_route against kernels/norm.py's add_rms_norm then route on its x: h' and x as the norm makes them (to
    fp32 rounding of the mean of squares: one rounding step of the dtype at most, rarely), the routes the reference's
    on the x it made; its counter is back at zero after each launch, so a second launch through it routes the same;
    an input the kernel does not admit (a strided delta) takes the two calls."""
    from evident.kernels import norm as nm

    D, E, k = shape
    h, w = problem(B, D, E, dtype, gen)
    delta = torch.randn(B, D, generator=gen, device=DEV).to(dtype)
    norm_w = (torch.rand(D, generator=gen, device=DEV) + 0.5).to(dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    h2, x, ids, wts = rt.add_norm_route(h, delta, norm_w, 1e-6, w, k, True, SCALING, counter=counter)
    want_h, want_x = nm.add_rms_norm(h, delta, norm_w, 1e-6)
    assert torch.equal(h2, want_h)  # the residual sum: no reduction in it
    step = torch.finfo(dtype).eps * 2 * want_x.float().abs().max().item()
    assert (x.float() - want_x.float()).abs().max().item() <= step
    assert counter.item() == 0
    assert_routes((ids, wts), reference(x, w, k, True, SCALING), k)
    again = rt.add_norm_route(h, delta, norm_w, 1e-6, w, k, True, SCALING, counter=counter)
    for a, b in zip(again, (h2, x, ids, wts)):
        assert torch.equal(a, b)
    strided = torch.stack([delta, delta], dim=-1)[..., 0]
    apart = rt.add_norm_route(h, strided, norm_w, 1e-6, w, k, True, SCALING)
    two = nm.add_rms_norm(h, strided, norm_w, 1e-6)
    assert torch.equal(apart[0], two[0]) and torch.equal(apart[1], two[1])
    assert_routes(apart[2:], reference(two[1], w, k, True, SCALING), k)


def test_add_norm_route_publishes_x_at_batch_1_only(gen):
    """With ``ready``: 1 after the one launch at batch 1 (h' and x published to the next launch before its end,
    kernels/pdl.py's publish), the results the same bits as without it; 0 after the two calls above batch 1 (nothing
    published early), whatever it held before."""
    D, E, k = ROWS
    for B, published in ((1, 1), (5, 0)):
        h, w = problem(B, D, E, torch.bfloat16, gen)
        delta = torch.randn(B, D, generator=gen, device=DEV).to(torch.bfloat16)
        norm_w = (torch.rand(D, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
        ready = torch.full((1,), 1 - published, dtype=torch.int32, device=DEV)
        got = rt.add_norm_route(h, delta, norm_w, 1e-6, w, k, True, SCALING, shared=2, ready=ready)
        assert ready.item() == published, B
        for a, b in zip(got, rt.add_norm_route(h, delta, norm_w, 1e-6, w, k, True, SCALING, shared=2)):
            assert torch.equal(a, b)


def test_one_launch_and_two_select_the_same(gen, monkeypatch):
    """The selection by the last logits program (batch 1 in the decode step) and by a launch of its own (above it)
    give the same bits from the same x; with the norm in the launch, the routes are those of the x it made (which may
    differ from norm.py's by a rounding step: another order of the sum of squares)."""
    D, E, k = ROWS
    h, w = problem(5, D, E, torch.bfloat16, gen)
    delta = torch.randn(5, D, generator=gen, device=DEV).to(torch.bfloat16)
    norm_w = (torch.rand(D, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    two = rt.route(h, w, k, True, SCALING)
    monkeypatch.setattr(rt, "ONE_LAUNCH_ROWS", 16)
    one = rt.route(h, w, k, True, SCALING)
    fused = rt.add_norm_route(h, delta, norm_w, 1e-6, w, k, True, SCALING)
    monkeypatch.setattr(rt, "ONE_LAUNCH_ROWS", 1)
    apart = rt.route(fused[1], w, k, True, SCALING)
    for a, b in zip([*one, *fused[2:]], [*two, *apart]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "scaled"])
@pytest.mark.parametrize("shape,dtype,B", MATCH, ids=lambda v: str(v).removeprefix("torch."))
def test_route_matches_reference(shape, dtype, B, norm, gen):
    D, E, k = shape
    x, w = problem(B, D, E, dtype, gen)
    assert rt.route_reason(x, w, k) is None
    ids, wts = rt.route(x, w, k, norm, SCALING)
    assert ids.shape == wts.shape == (B, k) and ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert ids.is_contiguous() and wts.is_contiguous() and ids.device == x.device
    want = reference(x, w, k, norm, SCALING)
    assert_routes((ids, wts), want, k)
    assert (wts[:, :-1] >= wts[:, 1:]).all()  # descending scores, slot by slot
    if norm:
        torch.testing.assert_close(wts.sum(-1), torch.ones(B, device=DEV))
    if B > 1:  # rows differ, and so do their routes: nothing was mixed between rows
        assert not torch.equal(wts[0], wts[1])


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "scaled"])
def test_one_expert_is_scaled_not_normalised(norm, gen):
    """norm_topk_prob applies only when top_k > 1 (as in the engine's MoE.route)."""
    D, E, _ = ROWS
    x, w = problem(3, D, E, torch.bfloat16, gen)
    got = rt.route(x, w, 1, norm, SCALING)
    assert_routes(got, reference(x, w, 1, norm, SCALING), 1)
    assert (got[1] != 1).all()  # scaled by 2.5, not divided by itself


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "scaled"])
def test_shared_slots_and_remap(norm, gen):
    D, E, k = ROWS
    B, shared = 4, 2
    x, w = problem(B, D, E, torch.bfloat16, gen)
    plain = rt.route(x, w, k, norm, SCALING)
    ids, wts = rt.route(x, w, k, norm, SCALING, shared=shared)
    assert ids.shape == wts.shape == (B, k + shared)
    assert_routes((ids, wts), reference(x, w, k, norm, SCALING, shared), k)
    # the routed slots are the call without shared slots, bitwise; the shared ones E + j with weight 1
    assert torch.equal(ids[:, :k], plain[0]) and torch.equal(wts[:, :k], plain[1])
    assert torch.equal(ids[:, k:].cpu(), torch.arange(E, E + shared).expand(B, shared))
    assert torch.equal(wts[:, k:].cpu(), torch.ones(B, shared))
    # expert parallelism: half the experts on this rank (local ids 0..), the rest -1; a shared one too
    perm = torch.randperm(E + shared, generator=gen, device=DEV)
    remap = torch.full((E + shared,), -1, dtype=torch.int64, device=DEV)
    remap[perm[: (E + shared) // 2]] = torch.arange((E + shared) // 2, device=DEV)
    rids, rwts = rt.route(x, w, k, norm, SCALING, shared=shared, remap=remap)
    assert torch.equal(rids, remap[ids]) and torch.equal(rwts, wts)
    assert (rids == -1).any() and (rids >= 0).any()
    ref_ids, ref_wts = rt.route_reference(x, w, k, norm, SCALING, shared, remap)
    assert ref_ids.dtype == torch.int64 and torch.equal(ref_ids[:, k:], rids[:, k:])
    torch.testing.assert_close(ref_wts, rwts, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_ties_pick_the_lowest_index(k, gen):
    """Integer-valued inputs sum exactly in any order, so equal gate rows give bitwise equal logits and scores.
    Rows 2, 5 and 8 are equal and, against x row 0 (all ones), the largest: k=2 takes 2 and 5, not 8."""
    D, E = 40, 10
    B = 6
    x = torch.randint(-2, 3, (B, D), generator=gen, device=DEV).to(torch.bfloat16)
    x[0] = 1
    w = torch.randint(-2, 3, (E, D), generator=gen, device=DEV).float() / 16  # each logit at most 5
    w[2] = w[5] = w[8] = 0.25  # 10 against x row 0; random rows meet them and others tie among themselves
    w[9] = w[0]
    for norm in (True, False):
        ids, wts = rt.route(x, w, k, norm, SCALING)
        ref_ids, ref_wts, _ = reference(x, w, k, norm, SCALING)
        assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)  # exactly: no rounding to excuse a swap
        torch.testing.assert_close(wts.cpu(), ref_wts, rtol=1e-5, atol=1e-6)
        assert ids[0, :3].tolist() == [2, 5, 8][:k]  # row 0: the tied experts, lowest index first
        assert (wts[0, :min(k, 3)] == wts[0, 0]).all()  # tied experts, equal weights, bitwise
        assert torch.equal(rt.route_reference(x, w, k, norm, SCALING)[0].cpu(), ref_ids)  # the torch path too


def test_a_tie_at_the_last_slot():
    """Two experts tie for the last slot (the 4th): the lower index takes it."""
    D, E = 40, 10
    x = torch.ones(1, D, device=DEV)
    w = torch.full((E, D), -1 / 16, device=DEV)
    w[2], w[5], w[8] = 0.25, 0.125, 0.0625
    w[9] = w[3] = 0  # next best after 2, 5, 8; tied: 3 before 9
    ids, wts = rt.route(x, w, 4, False, 1.0)
    assert ids[0].tolist() == [2, 5, 8, 3] and torch.equal(ids[0], rt.route_reference(x, w, 4, False, 1.0)[0][0])
    assert (wts[0, :-1] > wts[0, 1:]).all()


def test_rows_do_not_depend_on_the_batch(gen):
    """Row b of a batch is bitwise the row routed alone: each row's sums are the same code whatever B is."""
    D, E, k = ROWS
    B = 16 if CUDA else 5
    x, w = problem(B, D, E, torch.bfloat16, gen)
    ids, wts = rt.route(x, w, k, False, SCALING, shared=1)
    for b in range(B):
        one = rt.route(x[b:b + 1], w, k, False, SCALING, shared=1)
        assert torch.equal(ids[b], one[0][0]) and torch.equal(wts[b], one[1][0]), b


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, on NaN under the interpreter
def test_nan_rows_still_give_ids_in_range(gen):
    """A NaN in x makes the row's scores NaN; its ids stay in [0, E) (the first k, as the torch path)."""
    D, E, k = ROWS
    x, w = problem(3, D, E, torch.float32, gen)
    x[1, 3] = float("nan")
    ids, wts = rt.route(x, w, k, True, SCALING)
    assert ids[1].tolist() == list(range(k)) and torch.isnan(wts[1]).all()
    assert torch.equal(rt.route_reference(x, w, k, True, SCALING)[0][1], ids[1])
    assert_routes((ids[::2], wts[::2]), reference(x[::2], w, k, True, SCALING), k)


def test_inadmissible_inputs_fall_back(gen, monkeypatch):
    D, E, k = ROWS
    x, w = problem(4, D, E, torch.float32, gen)
    want = rt.route(x, w, k, True, SCALING)

    def close(got):
        assert_routes(got, reference(x, w, k, True, SCALING), k)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)

    xt = x.t().contiguous().t()  # the same values, column-major
    assert "contiguous" in rt.route_reason(xt, w, k)
    close(rt.route(xt, w, k, True, SCALING))
    assert "contiguous" in rt.route_reason(x, w.t().contiguous().t(), k)
    assert "dtype" in rt.route_reason(x.double(), w, k)
    close(rt.route(x.double(), w, k, True, SCALING))
    assert "remap" in rt.route_reason(x, w, k, 0, torch.arange(E, dtype=torch.int32, device=DEV))
    ids, _ = rt.route(x, w, k, True, SCALING, remap=torch.arange(E, dtype=torch.int32, device=DEV) + 1)
    assert ids.dtype == torch.int64 and torch.equal(ids, rt.route_reference(x, w, k, True, SCALING)[0] + 1)
    big = torch.randn(rt.MAX_B + 1, D, generator=gen, device=DEV)
    assert "B=" in rt.route_reason(big, w, k)
    ids, wts = rt.route(big, w, k, False, SCALING)
    assert_routes((ids, wts), reference(big, w, k, False, SCALING), k)
    # a CPU tensor outside the interpreter is not admitted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in rt.route_reason(x.cpu(), w.cpu(), k)


def assert_refused(x, w, k, bad):
    """Each change to a valid call is a ValueError in route, route_reference and route_reason alike."""
    for change in bad:
        args = dict(x=x, gate_weight=w, top_k=k, norm_topk_prob=True, scaling=SCALING) | change
        for call in (rt.route, rt.route_reference):
            with pytest.raises(ValueError):
                call(**args)
        with pytest.raises(ValueError):
            rt.route_reason(**{name: v for name, v in args.items() if name not in ("norm_topk_prob", "scaling")})


def test_shape_errors_are_errors_not_fallbacks(gen):
    D, E, k = ROWS
    x, w = problem(3, D, E, torch.float32, gen)
    bad = [
        dict(top_k=E + 1),  # more experts than there are
        dict(top_k=0),
        dict(x=x[:, :-1]),  # D mismatch
        dict(x=x[0]),  # not [B, D]
        dict(gate_weight=w[None]),  # not [E, D]
        dict(shared=-1),
        dict(shared=1, remap=torch.arange(E, device=DEV)),  # remap must cover E + shared ids
        dict(remap=torch.arange(E, device=DEV).float()),
    ]
    assert_refused(x, w, k, bad)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("B", [1, 8])
def test_cuda_graph_replay_is_bitwise(B, gen):
    from evident.kernels.graphs import capture
    D, E, k = LITE
    x, w = problem(B, D, E, torch.bfloat16, gen)
    remap = torch.arange(E + 2, device=DEV).flip(0)

    def step():
        return rt.route(x, w, k, False, SCALING, shared=2, remap=remap)

    graph, (ids, wts) = capture(step)  # warmed up on a side stream, then captured
    for _ in range(3):  # fresh inputs into the captured buffers
        x.copy_(problem(B, D, E, torch.bfloat16, gen)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        assert torch.equal(ids, want[0]) and torch.equal(wts, want[1])
        assert_routes((remap[ids[:, :k]].clone(), wts[:, :k]), reference(x, w, k, False, SCALING), k)


# ---- the group routings: DeepSeek-V2's group_limited_greedy and DeepSeek-V3's noaux_tc ----------------------

# (D, E, n_group, topk_group, k, method): on a GPU V3's, Moonlight's and V2's shapes; without one E=12 in groups of
# 3 and of 4, two groups kept for k=3, so that the restriction changes the choice
GROUPED = [(7168, 256, 8, 4, 8, "noaux_tc"), (2048, 64, 1, 1, 6, "noaux_tc"),
           (5120, 160, 8, 3, 6, "group_limited_greedy")] if CUDA else \
    [(40, 12, g, 2, 3, m) for m in ("group_limited_greedy", "noaux_tc") for g in (4, 3)]
# (shape, dtype, B, norm). On the CPU each routing with each group size and each weighting, not every triple: the
# weights are made after the choice, of the experts it chose
GROUP_MATCH = [(s, dt, B, norm) for s in GROUPED for dt in (torch.bfloat16, torch.float32) for B in (1, 8, 16)
               for norm in (True, False)] if CUDA \
    else [(s, torch.bfloat16, 5, norm) for s, norm in zip(GROUPED, (True, False, False, True))]


def group_weights(method, v, norm, k, scaling):
    if method == "noaux_tc":
        return (v / (v.sum() + 1e-20) if norm else v) * scaling
    return v / (v.sum() + 1e-20) if norm and k > 1 else v * scaling


def group_reference(x, w, k, norm, scaling, method, n_group, topk_group, bias=None, shared=0):
    """Built here, not from kernels/route.py: (ids, weights, choice, scores), groups and experts chosen by Python
    sorts on (-value, index); choice is what the experts were ranked by (outside the kept groups 0 for
    group_limited_greedy, -inf for noaux_tc), scores what the weights are made of."""
    logits = (x.float() @ w.float().T).cpu()
    E = w.shape[0]
    G = E // n_group
    if method == "noaux_tc":
        scores = torch.sigmoid(logits)
        choice = scores + bias.float().cpu()
    else:
        scores = torch.softmax(logits, dim=-1)
        choice = scores.clone()
    ids, weights = [], []
    for s, c in zip(scores, choice):
        rank = []
        for g in range(n_group):
            v = c[g * G:(g + 1) * G]
            o = sorted(range(G), key=lambda i: (-v[i].item(), i))
            rank.append((v[o[0]] + v[o[1]]).item() if method == "noaux_tc" else v[o[0]].item())
        kept = sorted(range(n_group), key=lambda g: (-rank[g], g))[:topk_group]
        out = torch.tensor([e // G not in kept for e in range(E)])
        c.masked_fill_(out, float("-inf") if method == "noaux_tc" else 0.0)
        if method != "noaux_tc":
            s.masked_fill_(out, 0.0)
        top = sorted(range(E), key=lambda e: (-c[e].item(), e))[:k]
        ids.append(top + list(range(E, E + shared)))
        weights.append(torch.cat([group_weights(method, s[top], norm, k, scaling), torch.ones(shared)]))
    return torch.tensor(ids, dtype=torch.int64), torch.stack(weights), choice, scores


def assert_group_routes(got, want, k, norm, scaling, method, rel=1e-5):
    """As assert_routes, with the near-equal swaps judged by the choice; the weights are checked against the
    reference's formula at the kernel's own picks (a swap under noaux_tc swaps different unbiased scores)."""
    (ids, wts), (ref_ids, _, choice, scores) = got, want
    ids, wts = ids.cpu(), wts.cpu()
    for b, s in torch.nonzero(ids != ref_ids).tolist():
        assert s < k, (b, s, ids[b], ref_ids[b])
        a, r = choice[b, ids[b, s]].item(), choice[b, ref_ids[b, s]].item()
        assert abs(a - r) <= rel * abs(r), (b, s, ids[b], ref_ids[b], a, r)
    want_wts = torch.stack([torch.cat([group_weights(method, scores[b, ids[b, :k]], norm, k, scaling),
                                       torch.ones(ids.shape[1] - k)]) for b in range(ids.shape[0])])
    torch.testing.assert_close(wts, want_wts, rtol=rel, atol=1e-6)


def group_problem(B, D, E, n_group, topk_group, method, dtype, gen):
    """problem() plus a bias, and row 0 pointed at topk_group + 1 experts of as many groups with logits 10, 9, ...:
    greedy would take them all, a group routing cannot."""
    x, w = problem(B, D, E, dtype, gen)
    x0 = x[0].float()
    for j in range(min(topk_group + 1, n_group)):
        w[j * (E // n_group) + j % (E // n_group)] = (10 - j) * x0 / x0.dot(x0)
    bias = torch.randn(E, generator=gen, device=DEV) * 0.01 if method == "noaux_tc" else None
    return x, w, bias


@pytest.mark.parametrize("shape,dtype,B,norm", GROUP_MATCH, ids=lambda v: ("norm" if v else "scaled")
                         if isinstance(v, bool) else str(v).removeprefix("torch."))
def test_group_routings_match_reference(shape, dtype, B, norm, gen):
    D, E, n_group, topk_group, k, method = shape
    shared = 2
    x, w, bias = group_problem(B, D, E, n_group, topk_group, method, dtype, gen)
    args = (method, n_group, topk_group, bias)
    assert rt.route_reason(x, w, k, shared, None, *args) is None
    ids, wts = rt.route(x, w, k, norm, SCALING, shared, None, *args)
    assert ids.shape == wts.shape == (B, k + shared) and ids.dtype == torch.int64 and wts.dtype == torch.float32
    want = group_reference(x, w, k, norm, SCALING, *args, shared=shared)
    assert_group_routes((ids, wts), want, k, norm, SCALING, method)
    if n_group > topk_group:  # row 0: the groups changed the choice (against all experts in one group)
        plain = group_reference(x[:1], w, k, norm, SCALING, method, 1, 1, bias)[0]
        assert not torch.equal(want[0][0, :k], plain[0]) and not torch.equal(ids[0, :k].cpu(), plain[0])
    # expert parallelism: the remap of the same routes, bitwise
    remap = torch.randperm(E + shared, generator=gen, device=DEV) - (E + shared) // 2
    remap[remap < 0] = -1
    rids, rwts = rt.route(x, w, k, norm, SCALING, shared, remap, *args)
    assert torch.equal(rids, remap[ids]) and torch.equal(rwts, wts)


@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
def test_group_ties_pick_the_lowest_group(method, gen):
    """Two rows of x whose logits are exact in any summation order (ones, then ones on the first half; the weights
    multiples of 1/16, one weight in each half set so that the rows' logits are those below), two random rows.
    - Row 0: groups 1, 2 and 3 (of 3 experts) tie, by their best expert and by their top-2 sum: logits 10 and 5
      (experts 3, 4; 6, 7; 9, 10) and a third below; two groups are kept, 1 and 2, so k=3 takes 3, 6 and then 4 of
      the tie 4 = 7, not 9.
    - Row 1: group 0 has its largest twice (experts 1 and 2, logit 2), so under noaux_tc its top-2 sum is twice that
      score and beats group 2's (logits 1 and 0); a sum that took the largest once, and the next value below it,
      would keep group 2 instead. k=3 takes 3, then 1 of the tie 1 = 2.
    Ties are set only in the exact rows: in the random ones, gate rows equal by construction would tie only as far as
    each matmul's summation order lets them (CI's CPU BLAS once split such a tie, and the reference kept group 3
    over group 1). Two groups whose sums tie there by chance would be ranked by the last bit of each
    implementation's sigmoid, which no contract fixes."""
    D, E, n_group, topk_group, k = 40, 12, 4, 2, 3
    x = torch.randn(4, D, generator=gen, device=DEV).to(torch.bfloat16)
    x[0], x[1] = 1, (torch.arange(D, device=DEV) < D // 2).to(x.dtype)
    w = torch.randint(-2, 3, (E, D), generator=gen, device=DEV).float() / 16
    row0 = torch.tensor([-2.5, 0, 0, 10, 5, -2.5, 10, 5, -2.5, 10, 5, -2.5], device=DEV)
    row1 = torch.tensor([-4, 2, 2, 3, 0, -3, 1, 0, -3, -1, -2, -3], device=DEV, dtype=torch.float32)
    w[:, 0] += row1 - w[:, :D // 2].sum(1)  # every sum and difference exact: multiples of 1/16 below 2^20
    w[:, D // 2] += row0 - row1 - w[:, D // 2:].sum(1)
    bias = torch.zeros(E, device=DEV) if method == "noaux_tc" else None
    args = (method, n_group, topk_group, bias)
    for norm in (True, False):
        ids, wts = rt.route(x, w, k, norm, SCALING, 0, None, *args)
        ref_ids, ref_wts, _, _ = group_reference(x, w, k, norm, SCALING, *args)
        assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)  # exactly: no rounding to excuse a swap
        torch.testing.assert_close(wts.cpu(), ref_wts, rtol=1e-5, atol=1e-6)
        assert ids[:2].tolist() == [[3, 6, 4], [3, 1, 2]]
        assert torch.equal(rt.route_reference(x, w, k, norm, SCALING, 0, None, *args)[0].cpu(), ref_ids)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "scaled"])
def test_the_bias_steers_the_choice_not_the_weights(norm, gen):
    """noaux_tc: a bias of 10 on row 0's least likely expert puts it first in every row; its weight is its
    unbiased sigmoid score."""
    D, E, n_group, topk_group, k = 40, 12, 4, 2, 3
    x, w = problem(4, D, E, torch.float32, gen)
    bias = torch.zeros(E, device=DEV)
    s = torch.sigmoid(x.float() @ w.float().T)
    low = s[0].argmin().item()
    assert low not in rt.route(x, w, k, norm, SCALING, 0, None, "noaux_tc", n_group, topk_group, bias)[0][0]
    bias[low] = 10
    ids, wts = rt.route(x, w, k, norm, SCALING, 0, None, "noaux_tc", n_group, topk_group, bias)
    assert (ids[:, 0] == low).all()
    own = s[:, low] / (s.gather(1, ids).sum(1) + 1e-20) if norm else s[:, low]
    torch.testing.assert_close(wts[:, 0], own * SCALING, rtol=1e-5, atol=1e-6)
    assert_group_routes((ids, wts), group_reference(x, w, k, norm, SCALING, "noaux_tc", n_group, topk_group, bias),
                        k, norm, SCALING, "noaux_tc")


@triton.jit
def _sum_units_kernel(v, out, N: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out, rt._sum_units(tl.load(v + i, mask=i < N, other=0.0)))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, on NaN under the interpreter
def test_selection_sums_do_not_depend_on_the_lanes_order(gen):
    """The selection's sums (the softmax's, the picked scores') give the same bits whatever order the lanes come in
    (Triton lays them out per kernel, and the selection runs in two kernels), within fp32 rounding of the true sum;
    NaN stays NaN. A plain float sum of these orders differs (checked: the test can see an order-dependent sum)."""
    v = torch.rand(160, generator=gen, device=DEV) ** 8  # many sizes, as a softmax's
    v[7] = 1.0
    sums, plain = set(), set()
    out = torch.empty(1, device=DEV)
    for _ in range(8):
        lanes = v[torch.randperm(160, generator=gen, device=DEV)].contiguous()
        _sum_units_kernel[(1,)](lanes, out, N=160, BLOCK=256)
        sums.add(out.item())
        plain.add(float(np.add.accumulate(lanes.cpu().numpy())[-1]))  # fp32, one lane after another
    assert len(sums) == 1 and len(plain) > 1, (sums, plain)
    assert abs(sums.pop() - v.double().sum().item()) <= 2**-23 * v.double().sum().item()
    v[3] = float("nan")
    _sum_units_kernel[(1,)](v, out, N=160, BLOCK=256)
    assert out.isnan().all()


@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
def test_group_rows_do_not_depend_on_the_batch(method, gen):
    D, E, n_group, topk_group, k, _ = GROUPED[-1]
    B = 16 if CUDA else 4
    x, w, _ = group_problem(B, D, E, n_group, topk_group, method, torch.bfloat16, gen)
    bias = torch.randn(E, generator=gen, device=DEV) * 0.1 if method == "noaux_tc" else None
    args = (method, n_group, topk_group, bias)
    ids, wts = rt.route(x, w, k, True, SCALING, 1, None, *args)
    for b in range(B):
        one = rt.route(x[b:b + 1], w, k, True, SCALING, 1, None, *args)
        assert torch.equal(ids[b], one[0][0]) and torch.equal(wts[b], one[1][0]), b


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
def test_group_nan_rows_still_give_ids_in_range(method, gen):
    """A NaN row ranks every group and expert as +inf: the lowest groups, their lowest experts (as the torch path)."""
    D, E, n_group, topk_group, k = 40, 12, 4, 2, 3
    x, w = problem(3, D, E, torch.float32, gen)
    x[1, 3] = float("nan")
    args = (method, n_group, topk_group, torch.zeros(E, device=DEV) if method == "noaux_tc" else None)
    ids, wts = rt.route(x, w, k, True, SCALING, 0, None, *args)
    assert ids[1].tolist() == [0, 1, 2] and torch.isnan(wts[1]).all()
    assert torch.equal(rt.route_reference(x, w, k, True, SCALING, 0, None, *args)[0][1], ids[1])


def test_group_shape_errors_and_fallbacks(gen):
    D, E, k = 40, 12, 3
    x, w = problem(3, D, E, torch.float32, gen)
    bias = torch.zeros(E, device=DEV)
    ok = dict(method="noaux_tc", n_group=4, topk_group=2, bias=bias)
    bad = [dict(method="topk"), dict(method="group_limited_greedy", n_group=5, topk_group=1),
           ok | dict(n_group=0), ok | dict(topk_group=0), ok | dict(topk_group=5), ok | dict(top_k=7),
           ok | dict(bias=None), ok | dict(bias=torch.zeros(E + 1, device=DEV)), ok | dict(bias=bias[None]),
           ok | dict(n_group=12, topk_group=3)]  # groups of one expert have no top 2
    assert_refused(x, w, k, bad)
    # k = 6 experts of 2 groups of 3 is allowed, and so is any bias for the methods that have none
    assert rt.route_reason(x, w, 6, 0, None, "group_limited_greedy", 4, 2, torch.zeros(1)) is None
    # the bias must be contiguous fp32 on the device; more than MAX_GROUPS groups: the torch path
    want = rt.route_reference(x, w, k, True, SCALING, 0, None, **ok)
    for other, why in [(bias.to(torch.bfloat16), "bias"), (torch.zeros(2 * E, device=DEV)[::2], "bias"),
                       (bias.cpu() if CUDA else None, "devices")]:
        if other is not None:
            assert why in rt.route_reason(x, w, k, 0, None, "noaux_tc", 4, 2, other)
            assert torch.equal(rt.route(x, w, k, True, SCALING, 0, None, "noaux_tc", 4, 2, other)[0], want[0])
    E = 2 * (rt.MAX_GROUPS + 1)
    x, w = problem(3, D, E, torch.float32, gen)
    assert "n_group" in rt.route_reason(x, w, k, 0, None, "group_limited_greedy", E // 2, 2)
    got = rt.route(x, w, k, False, SCALING, 0, None, "group_limited_greedy", E // 2, 2)
    torch.testing.assert_close(got[1], rt.route_reference(x, w, k, False, SCALING, 0, None, "group_limited_greedy",
                                                          E // 2, 2)[1], rtol=0, atol=0)
