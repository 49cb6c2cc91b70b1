"""Each kernel against its torch reference on fresh random inputs, and the bitwise contracts.

Without a GPU these run through the Triton interpreter (tests/conftest.py) on small, ragged shapes; with
one they run compiled at the engine's full shapes, plus CUDA-graph capture and replay.
"""
import pytest
import torch

from evident.kernels import argmax as am
from evident.kernels import gemv, pdl
from evident.kernels.graphs import capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
LOW = [torch.float16, torch.bfloat16]
# (K, N): ragged everywhere on the CPU; the DeepSeek-V4 C4 auxiliary and DeepSeek-V2-Lite shapes on a GPU
SHAPES = [(4096, 2624), (2048, 2112), (1408, 2048), (10944, 2048)] if CUDA else [(100, 7), (1024, 9), (1500, 33)]
SEGMENTS = ([2048, 512, 64], [torch.float32, torch.float32, torch.float16]) if CUDA else \
    ([24, 8, 3], [torch.float32, torch.float32, torch.float16])
FUSED_K = 4096 if CUDA else 1300
VOCAB = [102400, 129280, 7] if CUDA else [5000, 4097, 7]
# Where blocks of 256 are the boundaries (pick_batch chunked below; head_pick's groups of 4 programs of 64 rows under
# the interpreter), the CPU's smaller vocabularies of the same shapes: 1928 = 7 x 256 + 136 ends as 5000 = 19 x 256
# + 136 (full merge chunks of 4), 1025 = 4 x 256 + 1 as 4097 = 16 x 256 + 1 (a last chunk of one block of one row)
VOCAB_256 = VOCAB if CUDA else [1928, 1025, 7]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def fresh(*shape, dtype=torch.float16, gen=None):
    """Fresh random values (never zeros: they hide unwritten outputs)."""
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs each run; printed on failure through the assertion messages
    return g


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("K,N", SHAPES)
def test_gemv_exact_matches_reference(K, N, dtype, gen):
    x, w = fresh(K, dtype=dtype, gen=gen), fresh(N, K, dtype=dtype, gen=gen)
    assert gemv.gemv_reason(x, w) is None
    ref = torch.mv(w.double(), x.double())
    for out_dtype in (torch.float32, dtype):
        y = gemv.gemv_exact(x, w, out_dtype)
        assert y.dtype == out_dtype and y.shape == (N,) and torch.isfinite(y).all()
        # fp32 accumulation of exact products: only the final cast rounds
        tol = 1e-5 if out_dtype == torch.float32 else 1e-2
        assert rel_err(y, ref) < tol, (K, N, dtype, out_dtype)
    # deterministic: the same inputs give the same bits
    assert torch.equal(gemv.gemv_exact(x, w, torch.float32), gemv.gemv_exact(x, w, torch.float32))


@pytest.mark.parametrize("dtype", LOW)
def test_gemv_fused_bitwise_equals_split(dtype, gen):
    sizes, out_dtypes = SEGMENTS
    x, w = fresh(FUSED_K, dtype=dtype, gen=gen), fresh(sum(sizes), FUSED_K, dtype=dtype, gen=gen)
    assert gemv.fused_reason(x, w, sizes, out_dtypes) is None
    fused = gemv.gemv_fused(x, w, sizes, out_dtypes)
    for part, d, y in zip(w.split(sizes), out_dtypes, fused):
        assert y.dtype == d
        assert torch.equal(y, gemv.gemv_exact(x, part, d))


def test_gemv_fused_segment_boundaries_inside_a_block(gen):
    """Segments of 1, 5 and 2 rows share blocks; each lands in its own output."""
    sizes, dts = [1, 5, 2], [torch.float16, torch.float32, torch.bfloat16]
    x, w = fresh(300, gen=gen), fresh(8, 300, gen=gen)
    for part, d, y in zip(w.split(sizes), dts, gemv.gemv_fused(x, w, sizes, dts)):
        assert torch.equal(y, gemv.gemv_exact(x, part, d))


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
def test_gemm_per_token_rows_equal_m1(dtype, gen):
    K, N = SHAPES[-1]
    for M in (1, 3, 8, gemv.MAX_M):
        x, w = fresh(M, K, dtype=dtype, gen=gen), fresh(N, K, dtype=dtype, gen=gen)
        y = gemv.gemm_per_token(x, w)
        assert y.shape == (M, N)
        for m in range(M):
            assert torch.equal(y[m], gemv.gemv_exact(x[m], w)), (M, m)


def test_rejected_inputs_fall_back_and_keep_contracts(gen, monkeypatch):
    x, w = fresh(64, gen=gen), fresh(10, 64, gen=gen)
    # a transposed (non-contiguous) weight, fp64, a too-long K, too many segments, too many rows
    wt = fresh(64, 10, gen=gen).t()
    assert "contiguous" in gemv.gemv_reason(x, wt)
    assert torch.allclose(gemv.gemv_exact(x, wt, torch.float32), gemv.gemv_reference(x, wt, torch.float32))
    assert "dtype" in gemv.gemv_reason(x.double(), w.double())
    assert gemv.gemv_exact(x.double(), w.double()).dtype == torch.float64
    big_k = gemv.MAX_K + 1
    assert "K=" in gemv.gemv_reason(fresh(big_k, gen=gen), fresh(2, big_k, gen=gen))
    sizes = [2, 2, 2, 2, 2]
    dts = [torch.float32] * 5
    assert "segments" in gemv.fused_reason(x, w, sizes, dts)
    for part, y in zip(w.split(sizes), gemv.gemv_fused(x, w, sizes, dts)):
        assert torch.equal(y, gemv.gemv_exact(x, part, torch.float32))  # fallback: gemv_exact per segment
    xs = fresh(gemv.MAX_M + 1, 64, gen=gen)
    assert "M=" in gemv.per_token_reason(xs, w)
    y = gemv.gemm_per_token(xs, w)
    assert all(torch.equal(y[m], gemv.gemv_exact(xs[m], w)) for m in range(len(xs)))  # fallback: per row
    # a CPU tensor outside the interpreter is not admitted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in gemv.gemv_reason(x.cpu(), w.cpu())


def test_shape_errors_are_errors_not_fallbacks(gen):
    x, w = fresh(64, gen=gen), fresh(10, 64, gen=gen)
    with pytest.raises(ValueError, match="expected x"):
        gemv.gemv_exact(fresh(65, gen=gen), w)
    with pytest.raises(ValueError, match="segments"):
        gemv.gemv_fused(x, w, [4, 5], [torch.float32] * 2)


def torch_pick(logits):
    """The reference, built here: torch.argmax, and top1 - top2 of torch.topk over the fp32 logits."""
    top2 = torch.topk(logits.float(), 2, dim=-1).values
    return torch.argmax(logits, dim=-1), top2[:, 0] - top2[:, 1]


PICK_DTYPES = [torch.bfloat16, torch.float32, torch.float16]
# (chunked, V, dtype). On the CPU the chunked vocabularies take one dtype each, the dtypes in turn: the blocks and
# chunks that ties and NaNs fall across are the vocabulary's, and every dtype is read as fp32 before any comparison
PICKS = [(False, V, dt) for V in VOCAB for dt in PICK_DTYPES] + \
    ([(True, V, dt) for V in VOCAB_256 for dt in PICK_DTYPES] if CUDA else
     [(True, V, dt) for V, dt in zip(VOCAB_256, PICK_DTYPES)])


@pytest.mark.parametrize("chunked,V,dtype", PICKS, ids=lambda v: str(v).removeprefix("torch."))
def test_pick_batch_matches_torch_with_ties(dtype, V, chunked, gen, monkeypatch):
    """ids as torch.argmax (the lowest index on ties, the first NaN), margins as torch.topk's top two (0 for a repeated
    maximum, NaN beside a NaN), on fresh random logits with ties inside a block, across blocks and in the last one;
    ``chunked``: blocks of 256 merged 4 at a time, so ties and NaNs also fall across the merge's chunks."""
    if chunked:
        monkeypatch.setattr(am, "BLOCK_V", 256)
        monkeypatch.setattr(am, "MERGE_CHUNK", 4)
    B = 8
    logits = fresh(B, V, dtype=dtype, gen=gen)
    top = (logits.float().max() + 1).to(dtype).item()
    logits[0] = top  # all tied: index 0
    if V > 3:
        logits[1, [V - 1, 2, V // 2]] = top  # ties across blocks: the lowest index wins
        logits[2, V - 1] = top  # the maximum in the last, partial block
    if V > 5:
        logits[3, [5, V - 2]] = float("nan")  # NaN is the maximum, as in torch: the first NaN
    logits[4] = float("-inf")
    logits[5, 1] = top  # a single maximum: a margin above 0
    assert am.pick_reason(logits) is None
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    ids, margins = am.pick_batch(logits, fallback=None, counter=counter)
    assert counter.item() == 0  # put back by the program that merged
    assert ids.dtype == torch.int64 and margins.dtype == torch.float32
    want_ids, want_margins = torch_pick(logits)
    assert torch.equal(ids, want_ids), ids.tolist()
    assert torch.equal(margins.isnan(), want_margins.isnan())
    assert torch.equal(margins.nan_to_num(), want_margins.nan_to_num()), (margins, want_margins)
    assert margins[0].item() == 0 and margins[5].item() > 0
    if V > 3:
        assert ids[1].item() == 2 and ids[2].item() == V - 1 and margins[1].item() == 0
    ids.fill_(-1)
    again = am.pick_batch(logits, fallback=None, counter=counter)  # through the same count: a second launch merges
    assert torch.equal(again[0], want_ids) and torch.equal(again[1].nan_to_num(), margins.nan_to_num())
    assert counter.item() == 0


def test_pick_rejects_fall_back(gen):
    x = fresh(3, 50, dtype=torch.float32, gen=gen)
    fallback = lambda: "fallback"  # noqa: E731
    assert "dtype" in am.pick_reason(x.double()) and am.pick_batch(x.double(), fallback) == "fallback"
    xt = fresh(50, 3, dtype=torch.float32, gen=gen).t()
    assert "contiguous" in am.pick_reason(xt) and am.pick_batch(xt, fallback) == "fallback"
    assert "non-empty" in am.pick_reason(x[0])
    assert "outside 2..2**24" in am.pick_reason(x[:, :1])
    assert "rows" in am.pick_reason(fresh(am.MAX_ROWS + 1, 50, gen=gen))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_is_bitwise(gen):
    sizes, dts = SEGMENTS
    x, w = fresh(FUSED_K, gen=gen), fresh(sum(sizes), FUSED_K, gen=gen)
    xs, wb = fresh(8, 2048, gen=gen), fresh(2112, 2048, gen=gen)
    logits = fresh(8, 102400, dtype=torch.bfloat16, gen=gen)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)  # outside the capture: each replay must put it back

    def step():
        return (*gemv.gemv_fused(x, w, sizes, dts), gemv.gemm_per_token(xs, wb),
                *am.pick_batch(logits, fallback=None, counter=counter))

    graph, outs = capture(step)  # warmed up on a side stream, then captured
    for _ in range(3):  # fresh inputs into the captured buffers, replay, compare with eager
        for t in (x, w, xs, wb, logits):
            t.copy_(fresh(*t.shape, dtype=t.dtype, gen=gen))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU")
def test_dependent_launches_wait_for_their_input(gen):
    """Each call reads the previous call's output: under programmatic dependent launch a kernel starts before
    the previous one ends, so a missing wait would read a half-written x. Eager and graph-replayed chains must
    equal the same chain launched the ordinary way, bitwise."""
    n = 2048
    ws = [fresh(n, n, gen=gen) / n**0.5 for _ in range(12)]
    x = fresh(n, gen=gen)

    def chain():
        y = x
        for w in ws:  # y feeds the next call: a dependency through memory only
            y = gemv.gemm_per_token(gemv.gemv_exact(y, w)[None], w)[0]
        return y

    with pdl.disabled():
        want = chain()
    got = chain()
    assert torch.equal(got, want) and torch.isfinite(want).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        x.copy_(fresh(n, gen=gen))
        with pdl.disabled():
            want = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
