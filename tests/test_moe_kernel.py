"""The routed-experts kernels (kernels/moe.py) against their torch reference on fresh random inputs, the
batch-invariance contract (a row at batch 8 is bitwise the row at batch 1), the fallbacks and shape errors.

Without a GPU these run through the Triton interpreter (tests/conftest.py) on small, ragged shapes (one with
K above BLOCK_K, so the K loop and its masked tail run); with one, at DeepSeek-V2-Lite's shape, plus CUDA-graph
capture and replay.
"""
import pytest
import torch

from kernels import moe
from kernels.bench import capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (D, I, E, k): DeepSeek-V2-Lite on a GPU. On the CPU ragged shapes: one K slice, and K above BLOCK_K in both
# kernels (the K loop and its masked tail); the interpreter is slow, so the long one runs in one dtype only.
FULL, SMALL, LONG = (2048, 1408, 64, 6), (96, 40, 8, 3), (530, 520, 4, 2)
MATCH = [(FULL, dt, B) for dt in DTYPES for B in (1, 3, 8)] if CUDA else \
    [(SMALL, dt, B) for dt in DTYPES for B in (1, 3, 8)] + [(LONG, torch.bfloat16, 8)]
ROWS = FULL if CUDA else SMALL
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # fp32 sums; h rounds once


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


@pytest.mark.parametrize("same_rows", [True, False], ids=["shared-experts", "distinct-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if CUDA else [torch.bfloat16])
def test_rows_equal_batch_one(same_rows, dtype, gen):
    """Row b of a batch of 8 equals the same row alone, bitwise: how many tokens share an expert, and where the
    row sits in its group, never changes its sums."""
    D, I, E, k = ROWS
    x, w13, w2, ids, weights = problem(8, D, I, E, k, dtype, gen, same_rows)
    h = moe.experts_gate_up(x, w13, ids)
    y = moe.experts_down(h, w2, ids)
    out = moe.moe_experts(x, w13, w2, ids, weights)
    for b in range(1 if same_rows else 8):  # identical rows: one batch-1 call answers for all eight
        one = slice(b, b + 1)
        h1 = moe.experts_gate_up(x[one], w13, ids[one])
        y1 = moe.experts_down(h1, w2, ids[one])
        out1 = moe.moe_experts(x[one], w13, w2, ids[one], weights[one])
        for r in range(8) if same_rows else [b]:
            assert torch.equal(h[r], h1[0]) and torch.equal(y[r], y1[0]) and torch.equal(out[r], out1[0]), (b, r)


def test_repeated_experts_in_a_row_are_still_right(gen):
    """ids should be distinct per row, but a row repeating an expert makes groups larger than the tile; they are
    split, with the same sums."""
    D, I, E, k = SMALL
    x, w13, w2, _, weights = problem(3, D, I, E, k, torch.float32, gen)
    ids = torch.tensor([[1] * k, [1] * k, [2] + [1] * (k - 1)], device=DEV)
    out = moe.moe_experts(x, w13, w2, ids, weights)
    assert rel_err(out, moe.moe_reference(x, w13, w2, ids, weights)) < 1e-5
    for b in range(3):
        assert torch.equal(out[b], moe.moe_experts(x[b:b + 1], w13, w2, ids[b:b + 1], weights[b:b + 1])[0])


def test_inadmissible_inputs_fall_back(gen, monkeypatch):
    D, I, E, k = SMALL
    B = moe.MAX_B + 1
    x, w13, w2, ids, weights = problem(B, D, I, E, k, torch.bfloat16, gen)
    assert "B=" in moe.moe_reason(x, w13, w2, ids)
    assert torch.equal(moe.moe_experts(x, w13, w2, ids, weights), moe.moe_reference(x, w13, w2, ids, weights))
    assert torch.equal(moe.experts_gate_up(x, w13, ids), moe._gate_up_torch(x, w13, ids))
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
    for same_rows in (True, False, False):  # fresh inputs, new ids, into the captured buffers
        for t, new in zip((x, w13, w2, ids, weights), problem(B, D, I, E, k, torch.bfloat16, gen, same_rows)):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@pytest.mark.parametrize("n", [1, 6, 48, 96, 200])
def test_route_is_torch_s_stable_sort(n):
    """The one-program sort the kernels group pairs with: ties keep their order (a group's tokens ascend)."""
    ids = torch.randint(0, 8 if n > 6 else 3, (n,), device=DEV)
    got, want = moe._route(ids), torch.sort(ids, stable=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
