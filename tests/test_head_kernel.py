"""kernels/head.py: the batch-1 vocabulary projection, pick, next input and advance in one launch, against the
projection in fp64 and pick_batch's contract on the kernel's own logits (ties and NaNs across its programs' groups).

Without a GPU these run through the Triton interpreter on small vocabularies; with one, at the engine's.
"""
import pytest
import torch

from evident.kernels import head
from test_kernels import CUDA, DEV, VOCAB_256, fresh, gen, rel_err, torch_pick  # noqa: F401  (gen: a fixture)

K = 2048 if CUDA else 96
# The screen's second launch under the interpreter: 4 checking programs, each scanning its span of rows SCAN at a
# time. At the engine's SCAN (1024) a span first takes two scans at 4097 rows; at 256 (the ``scans`` fixture) at
# 1025, the second as ragged (64 rows of a span of 320, as of 1088), in a quarter of the programs.
SCREENED = VOCAB_256[1:]


def launch(x, w, start=5):
    counts = torch.zeros(head.counts_for(w.shape[0]), dtype=torch.int32, device=DEV)
    nxt = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    lengths = torch.full((3,), start, dtype=torch.int64, device=DEV)
    assert head.head_reason(x, w, counts, nxt, lengths) is None
    out = head.head_pick(x, w, counts, nxt, lengths, fallback=None)
    return out, counts, nxt, lengths


DTYPES, CASES = [torch.bfloat16, torch.float32], ["plain", "tie", "nan"]
# (case, V, dtype). On the CPU the larger vocabularies take each case in one dtype, the dtypes in turn (each case and
# each vocabulary meets both): the groups and chunks that ties and NaNs fall across are the vocabulary's, the logits'
# rounding is the dtype's, and neither changes the other
PICKS = [(c, V, dt) for c in CASES for V in VOCAB_256 for dt in DTYPES] if CUDA else \
    [(c, V, DTYPES[(i + j) % 2]) for i, c in enumerate(CASES) for j, V in enumerate(VOCAB_256[:2])] + \
    [(c, VOCAB_256[2], dt) for c in CASES for dt in DTYPES]


@pytest.mark.parametrize("case,V,dtype", PICKS, ids=lambda v: str(v).removeprefix("torch."))
def test_head_pick_is_the_projection_then_the_pick(dtype, V, case, gen, monkeypatch):
    """logits within rounding of W x; ids and margins as torch's pick of those logits; the pick written to the next
    input, the row's length advanced once, the counts back at zero. Groups of 4 programs, so that ties and NaNs
    fall across groups and the last merge reads its groups in chunks."""
    monkeypatch.setattr(head, "GROUP", 4)
    x, w = fresh(1, K, dtype=dtype, gen=gen), fresh(V, K, dtype=dtype, gen=gen)
    tied = sorted({V - 1, V // 2, 2} if V > 3 else {V - 1, 1})
    if case == "tie":  # identical rows well above the rest: the same logit, the lowest index wins, margin 0
        w[tied] = (8 * x[0] / x[0].float().norm()).to(dtype)
    if case == "nan" and V > 5:
        w[[V - 2, 5], 3] = float("nan")  # the first NaN is the pick, the margin NaN
    (logits, ids, margins), counts, nxt, lengths = launch(x, w)
    assert logits.shape == (1, V) and logits.dtype == dtype
    ref = (w.double() @ x[0].double())[None]
    finite = ref.isfinite()
    assert rel_err(logits[finite], ref[finite]) < (1e-5 if dtype == torch.float32 else 1e-2)
    want_ids, want_margins = torch_pick(logits)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert torch.equal(margins.isnan(), want_margins.isnan())
    assert torch.equal(margins.nan_to_num(), want_margins.nan_to_num()), (margins, want_margins)
    if case == "tie":
        assert ids.item() == tied[0] and margins.item() == 0
    if case == "nan" and V > 5:
        assert ids.item() == 5 and margins.isnan().item()
    assert nxt.tolist() == [ids.item(), -1, -1] and lengths.tolist() == [6, 5, 5]
    assert not counts.any()  # each count put back by the program that merged
    again, *_ = launch(x, w)  # deterministic, through fresh counts
    assert torch.equal(again[0].view(torch.uint8), logits.view(torch.uint8)) and torch.equal(again[1], ids)  # bits


def test_head_pick_rejects_fall_back(gen):
    x, w = fresh(2, 64, gen=gen), fresh(50, 64, gen=gen)
    counts = torch.zeros(64, dtype=torch.int32, device=DEV)
    nxt, lengths = (torch.zeros(2, dtype=torch.int64, device=DEV) for _ in range(2))
    fallback = lambda: "fallback"  # noqa: E731
    assert "row" in head.head_reason(x, w, counts, nxt, lengths)
    assert head.head_pick(x, w, counts, nxt, lengths, fallback) == "fallback"
    assert not lengths.any() and not nxt.any()  # a fallback leaves the advance to the caller
    assert "counts" in head.head_reason(x[:1], w, counts[:1], nxt, lengths)
    assert "int64" in head.head_reason(x[:1], w, counts, nxt.int(), lengths)
    assert "V=1" in head.head_reason(x[:1], w[:1], counts, nxt, lengths)


@pytest.fixture
def scans(monkeypatch):
    """Scans of 256 rows under the interpreter (see SCREENED); on a GPU the engine's SCAN."""
    if not CUDA:
        monkeypatch.setattr(head, "SCAN", 256)


def screened(x, w, screen, start=5):
    nxt = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    lengths = torch.full((3,), start, dtype=torch.int64, device=DEV)
    assert head.screen_reason(x, w, screen, nxt, lengths) is None
    ids, margins = head.head_pick_screened(x, w, screen, nxt, lengths, fallback=None)
    return ids, margins, nxt, lengths


def near_ties(x, w, rows, gen, apart=1.0):
    """rows of w made one random row lifted well above the rest plus ``apart`` quantization steps of noise each:
    their logits apart by less than the screen's bound, their int8 logits in another order."""
    base = torch.randn(w.shape[1], generator=gen, device=DEV)
    base += 6 * x[0].float() / x[0].float().norm()
    step = base.abs().max() / 127
    w[rows] = (base + apart * step * torch.randn(len(rows), w.shape[1], generator=gen, device=DEV)).to(w.dtype)


def along(x):
    """s Q with s = 2**-7 and Q integers along x, its largest 127 in magnitude: a row its int8 screen holds exactly
    (in bf16 too), its logit far above random rows'."""
    Q = torch.round(100 * x[0].float() / x[0].float().abs().max())
    Q[0] = 127 if x[0, 0] >= 0 else -127
    return 2.0 ** -7 * Q


def assert_same_pick(got, want):
    ids, margins = got[:2]
    assert torch.equal(ids, want[1]), (ids, want[1])
    assert torch.equal(margins.isnan(), want[2].isnan())
    assert torch.equal(margins.nan_to_num(), want[2].nan_to_num()), (margins, want[2])


@pytest.mark.parametrize("V", SCREENED)
@pytest.mark.parametrize("case,dtype", [("plain", torch.bfloat16), ("plain", torch.float32), ("near", torch.bfloat16),
                                        ("near", torch.float32), ("tie", torch.bfloat16),
                                        ("exact_tie", torch.bfloat16), ("nan_input", torch.bfloat16)])
def test_the_screened_pick_is_head_picks_bit_for_bit(case, dtype, V, gen, scans):
    """ids and margins equal head_pick's on the same inputs (its logits' pick), the pick written and the length
    advanced once, the screen's scratch back at its start (in the plain case a second step on a smaller x, which a T
    kept from the first would wrongly leave unlisted, picks as head_pick again)."""
    x, w = fresh(1, K, dtype=dtype, gen=gen), fresh(V, K, dtype=dtype, gen=gen)
    rows = sorted({V - 1, V // 2, 2} if V > 3 else {V - 1, 1})
    if case == "tie":
        w[rows] = (8 * x[0] / x[0].float().norm()).to(dtype)
    if case == "exact_tie":  # identical rows the screen holds exactly: a bound far below a bf16 step, hi and T alike
        # (in fp32 hi stays above T: that case needs bf16)
        w.mul_(1e-3)
        w[rows] = along(x).to(dtype)
    if case == "near":
        near_ties(x, w, list(range(0, V, max(1, V // 40))), gen)
    if case == "nan_input":
        x[0, 3] = float("nan")  # every logit NaN: every row listed, the first is the pick
    screen = head.screen_of(w)
    for step in (x, x / 1000) if case == "plain" else (x,):
        want, *_ = launch(step, w)
        got = screened(step, w, screen)
        assert_same_pick(got, want)
        assert got[2].tolist() == [want[1].item(), -1, -1] and got[3].tolist() == [6, 5, 5]
        assert torch.equal(screen.state, torch.full_like(screen.state, float("-inf"))) and not screen.count.any()
    if case in ("tie", "exact_tie"):
        assert got[0].item() == rows[0] and got[1].item() == 0


def test_the_screens_bound_is_what_finds_a_row_its_int8_logits_rank_low(gen, scans):
    """The screen finds a row whose int8 logit ranks below two others' while its own is the largest: with every bound
    zeroed (the screen trusting its int8 logits) it does not. In fp32, the rows built to quantize exactly: row 0 is
    s Q (Q along x) plus a shift under half a step along x's signs (its int8 row Q again, its logit well above),
    rows 1 and 2 s Q with one element a step up where x is positive (their int8 logits above row 0's, their logits
    below)."""
    x, w = fresh(1, K, dtype=torch.float32, gen=gen), 1e-3 * fresh(VOCAB_256[0], K, dtype=torch.float32, gen=gen)
    s, base = 2.0 ** -7, along(x)  # along x: these rows' logits far above the rest's; the scale s for all three
    up = 1 + int(torch.argmax(x[0, 1:]))
    shift = 0.45 * s * torch.sign(x[0])
    shift[0] = 0
    w[0] = base + shift
    w[1] = w[2] = base
    w[1:3, up] += s
    screen = head.screen_of(w)
    want, *_ = launch(x, w)
    assert want[1].item() == 0
    assert_same_pick(screened(x, w, screen), want)
    screen.bound.zero_()
    assert screened(x, w, screen)[0].item() != 0


def test_a_weight_with_a_non_finite_value_has_no_screen(gen):
    x, w = fresh(1, 64, gen=gen), fresh(50, 64, gen=gen)
    w[7, 3] = float("inf")
    assert head.screen_of(w) is None
    nxt, lengths = (torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(2))
    assert "screen" in head.screen_reason(x, w, None, nxt, lengths)
    assert head.head_pick_screened(x, w, None, nxt, lengths, lambda: "fallback") == "fallback"
    assert "weight" in head.screen_reason(x, w[:40], head.screen_of(fresh(50, 64, gen=gen)), nxt, lengths)
