"""DeepSeek-V4's graph decode path (engine/v4_graph.py) against the torch path, and its C4 auxiliary route: fused on
an auxiliary stream against apart on the main stream, bitwise (in a CUDA graph on a GPU; eagerly, through Triton's
interpreter, on the CPU)."""
from __future__ import annotations

import pytest
import torch

from test_engine_v4 import engine_of, hf_model
from test_graph_decode import slot_reused

from evident.engine import v4_graph
from evident.engine.generate import forced, generate

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
PROMPT = [5, 17, 3, 88, 41, 9, 60]


@pytest.fixture(scope="module")
def models():
    hf = hf_model("all-types")
    ref, eng = engine_of(hf).to(DEV), engine_of(hf).to(DEV)
    v4_graph.enable(eng)
    return ref, eng


def teacher_forced(model, rows=1):
    seen = []
    forced(model, [PROMPT] * rows, [list(range(12))] * rows, seen.append)
    return torch.cat(seen, 1)


def fused_spied(monkeypatch):
    """The segments of each gemv_fused call from now on (a list that fills)."""
    from evident.kernels import gemv

    calls, real = [], gemv.gemv_fused

    def spy(x, w, sizes, *a, **k):
        calls.append(list(sizes))
        return real(x, w, sizes, *a, **k)

    monkeypatch.setattr(gemv, "gemv_fused", spy)
    return calls


@pytest.fixture(scope="module")
def fused(models):
    """The graph path's teacher-forced logits with the C4 auxiliary route fused (the default), and the segments of
    each gemv_fused call that made them: made once for the two tests that read them (on a CPU the interpreter takes
    ~7 s to make them)."""
    g = models[1].graph_decode
    with pytest.MonkeyPatch.context() as mp:
        calls = fused_spied(mp)
        g.fuse(True)
        return teacher_forced(models[1]), calls


def test_graph_path_decodes_as_the_torch_path(models, fused):
    ref, eng = models
    # two rows: the skinny projections and the tensor-core experts kernel; one row (below): the fused route and the
    # one-row kernels
    assert generate(eng, [PROMPT, PROMPT[:3]], 10).tokens == generate(ref, [PROMPT, PROMPT[:3]], 10).tokens
    assert (fused[0] - teacher_forced(ref)).abs().max() < 1e-4


def test_its_step_reads_the_vocabulary_projection_whole(models):
    """DeepSeek-V4's graph step has no vocabulary screen: the floors count the projection's weight for it (the
    bench's floor asks engine.graph_decode.screened, which must answer for this path too)."""
    from evident.engine.graph_decode import screened

    assert not screened(models[1], 1)


def test_a_slot_left_idle_and_reused_leaves_every_row_as_alone(models):
    """The slot's state (window, compressor and indexer rings) emptied for the row that takes it."""
    ref, eng = models
    prompts, n = [PROMPT, PROMPT[::-1] * 2, PROMPT[:4]], 6  # 6: row 1 still steps beside the row that takes the slot
    alone = [generate(ref, [p], n).tokens[0] for p in prompts]
    assert slot_reused(eng, prompts, n) == [alone[0][:2], *alone[1:]]


def test_a_rows_reset_empties_its_state_and_only_its_own(models):
    """What an earlier sequence left in a slot (an inf would make a NaN of a masked weight 0) is gone for the next."""
    cache = models[1].new_cache(3, 16)
    state = [*cache.window, *(x for s in cache.series.values() for x in (s.kv, s.gate, s.entries))]
    for t in state:
        t.fill_(float("inf"))
    cache.lengths.fill_(5)
    cache.reset_rows([1])
    assert cache.lengths.tolist() == [5, 0, 5]
    assert all(t[1].eq(0).all() and t[[0, 2]].isinf().all() for t in state)


def test_fused_aux_route_is_bitwise_equal_to_apart_and_runs(models, fused, monkeypatch):
    _, eng = models
    logits, calls = fused
    a = eng.args
    c4 = [2 * 2 * a.head_dim, 2 * 2 * a.index_head_dim, a.index_n_heads]  # the CSA layer's three segments
    assert c4 in calls and [2 * a.head_dim] in calls  # and the HCA layer's one
    calls = fused_spied(monkeypatch)
    g = eng.graph_decode
    g.fuse(False)
    apart = teacher_forced(eng)
    g.fuse(True)
    assert torch.equal(logits, apart)
    assert not any(s in calls for s in (c4, [2 * a.head_dim]))


def test_a_cache_rounded_to_the_bucket_is_the_one_its_step_looks_up(models):
    """cache() rounds the length up (one capture and compile for many prompt lengths); step() finds the graph by
    the cache's own length, so the cache must hold the rounded one (it held the asked-for length: on the H200 every
    graph step refused its cache)."""
    g = models[1].graph_decode
    with torch.inference_mode():  # as generate asks for it: the cache is reset in place
        cache, again = g.cache(2, 40), g.cache(2, 41)
    assert cache.max_len % g.bucket == 0 and cache.max_len >= 40 and g.bucket > 1
    assert again is cache
    assert g.caches[(cache.lengths.shape[0], cache.max_len)].cache is cache
