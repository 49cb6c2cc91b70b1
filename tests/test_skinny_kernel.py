"""The few-row projection kernel (kernels/skinny.py) against an fp64 reference on fresh random inputs: ragged
shapes, two segments, identical rows bitwise identical, the fallbacks and shape errors; on a GPU also under
programmatic dependent launch in a chain captured in a CUDA graph.

Without a GPU these run through the Triton interpreter (tests/conftest.py) on small ragged shapes; with one, at
DeepSeek-V2-Lite's q + kv_a shape.
"""
import pytest
import torch

from evident.kernels import pdl, skinny
from evident.kernels.graphs import capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (N, K): on the CPU one K slice, and K above BLOCK_K with a masked tail; N past one block with a ragged end
SHAPES = [(3648, 2048), (2048, 2048)] if CUDA else [(40, 48), (300, 530)]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # fp32 sums, rounded once


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs each run
    return g


def rand(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("M", [2, 5, 16])
def test_matches_fp64_reference(M, shape, dtype, gen):
    N, K = shape
    x, w = rand(M, K, gen=gen, dtype=dtype), rand(N, K, gen=gen, dtype=dtype) * K**-0.5
    y = skinny.skinny_linear(x, w, fallback=lambda: pytest.fail("an admissible input fell back"))
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel_err(y, x.double() @ w.double().T) < TOL[dtype]


def test_segments_are_the_columns_of_one_call(gen):
    N, K = SHAPES[-1]
    x, w = rand(8, K, gen=gen), rand(N, K, gen=gen)
    sizes = [N - 24, 24]  # a boundary inside a block
    parts = skinny.skinny_linear(x, w, sizes)
    whole = skinny.skinny_linear(x, w)
    assert [tuple(p.shape) for p in parts] == [(8, n) for n in sizes]
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("M", [2, 8, 16])
def test_identical_rows_give_identical_outputs(M, gen):
    N, K = SHAPES[-1]
    x = rand(1, K, gen=gen).expand(M, K).contiguous()
    y = skinny.skinny_linear(x, rand(N, K, gen=gen))
    assert all(torch.equal(y[m], y[0]) for m in range(M))


def test_inadmissible_inputs_take_the_fallback(gen):
    x, w = rand(4, 64, gen=gen), rand(32, 64, gen=gen)
    for bad_x, bad_w, why in [(x[:1], w, "M=1"), (rand(17, 64, gen=gen), w, "M=17"),
                              (x, w.float(), "differs"), (x.long(), w.long(), "dtype")]:
        assert why in skinny.skinny_reason(bad_x, bad_w)
        assert skinny.skinny_linear(bad_x, bad_w, fallback=lambda: "fallback") == "fallback"
    assert "3 segments" in skinny.skinny_reason(x, w, [8, 8, 16])
    ref = skinny.skinny_linear(x[:1], w)  # no fallback given: the torch path
    assert rel_err(ref, x[:1].double() @ w.double().T) < 1e-2


def test_wrong_shapes_raise(gen):
    x, w = rand(4, 64, gen=gen), rand(32, 64, gen=gen)
    with pytest.raises(ValueError, match="expected x"):
        skinny.skinny_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="segments"):
        skinny.skinny_linear(x, w, [16, 8])


def test_dependent_launch_flags():
    assert pdl.flags(torch.device("cpu")) == {"PDL": False}  # and under the interpreter, and before sm_90
    with pdl.disabled():
        assert not pdl.ENABLED
        with pytest.raises(RuntimeError):
            with pdl.disabled():
                raise RuntimeError("restored on the way out")
        assert not pdl.ENABLED
    assert pdl.ENABLED


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and programmatic dependent launch need a GPU")
def test_chain_under_dependent_launch_in_a_graph(gen):
    """Each call reads the previous call's output: a kernel that starts early must wait before reading x.
    Graph replays with fresh inputs equal the chain launched the ordinary way, bitwise."""
    n = 2048
    ws = [rand(n, n, gen=gen) * n**-0.5 for _ in range(12)]
    x = rand(8, n, gen=gen)

    def chain():
        y = x
        for w in ws:
            y = skinny.skinny_linear(y, w)
        return y

    graph, out = capture(chain)
    for _ in range(3):
        x.copy_(rand(8, n, gen=gen))
        with pdl.disabled():
            want = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.isfinite(want).all()
