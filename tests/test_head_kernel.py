"""kernels/head.py: the batch-1 vocabulary projection, pick, next input and advance in one launch, against the
projection in fp64 and pick_batch's contract on the kernel's own logits (ties and NaNs across its programs' groups).

Without a GPU these run through the Triton interpreter on small vocabularies; with one, at the engine's.
"""
import pytest
import torch

from kernels import head
from test_kernels import CUDA, DEV, VOCAB, fresh, gen, rel_err, torch_pick  # noqa: F401  (gen: a fixture)

K = 2048 if CUDA else 96


def launch(x, w, start=5):
    counts = torch.zeros(head.counts_for(w.shape[0]), dtype=torch.int32, device=DEV)
    nxt = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    lengths = torch.full((3,), start, dtype=torch.int64, device=DEV)
    assert head.head_reason(x, w, counts, nxt, lengths) is None
    out = head.head_pick(x, w, counts, nxt, lengths, fallback=None)
    return out, counts, nxt, lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", VOCAB)
@pytest.mark.parametrize("case", ["plain", "tie", "nan"])
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
