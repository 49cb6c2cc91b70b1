"""The latent-attention decode kernels (kernels/mla.py) against plain torch references on fresh random inputs:
the cache write against the engine's RMSNorm and apply_rope, the attention against an fp64 loop over each row's
live positions, both together against the graph decode step's einsum attention on a tiny model; the fallbacks
and shape errors.

Without a GPU these run through the Triton interpreter (tests/conftest.py) on small ragged shapes (a cache
length that is no multiple of the position block, an odd number of rope pairs); with one, at
DeepSeek-V2-Lite's shape and a 4096-position cache, plus CUDA-graph capture and replay with new positions.
"""
import pytest
import torch

from evident.engine.config import ModelArgs
from evident.engine.model import LatentCache, RMSNorm, Transformer, apply_rope, project_pair
from evident.kernels import _l2, mla
from evident.kernels.graphs import capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# heads, nope, rope dims, latent rank, v_head_dim, cache length
LITE = dict(H=16, NOPE=128, DR=64, R=512, V=128, L=4096)
TINY = dict(H=3, NOPE=12, DR=6, R=40, V=10, L=45)
SHAPE = LITE if CUDA else TINY
BATCHES = [1, 5, 16] if CUDA else [1, 3]
# (B, dtype) of the attention tests. On the CPU B = 3 in each dtype, B = 1 in bfloat16 only: B = 3's first row is at
# B = 1's position (L - 1), both split the cache alike, and the graph decode tests step B = 1 in fp32.
ROWS_DTYPES = [(B, dt) for dt in DTYPES for B in BATCHES] if CUDA else \
    [(3, dt) for dt in DTYPES] + [(1, torch.bfloat16)]
LAYERS, ROWS, LAYER = 2, 16 if CUDA else 4, 1
# fp32 sums throughout and one rounding at the end; the interpreter rounds to bfloat16 by truncation
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(params=["triton", "gluon"] if CUDA else ["triton"])
def core(request, monkeypatch):
    """The attention core each attention test runs: on a GPU both, Triton's and the Gluon one (which the interpreter
    cannot run), each asserted to be the one launched at these shapes."""
    monkeypatch.setattr(mla, "GLUON_CORE", request.param == "gluon")
    return request.param


def assert_core(core, block_r=None):
    """The Gluon core is admitted at this test's shapes exactly when asked for."""
    block_r = block_r or 1 << (SHAPE["R"] - 1).bit_length()
    assert (mla._gluon_core(block_r, 1 << (SHAPE["DR"] - 1).bit_length()) is not None) == (core == "gluon")


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs each run
    return g


def rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def positions(B, L, gen):
    """Distinct positions per row: the last one (a full cache, a ragged last block), 0 (one position), the ends
    of the first block, then random ones."""
    fixed = [L - 1, 0, mla.BLOCK_L - 1, mla.BLOCK_L]
    extra = torch.randint(0, L, (B,), generator=gen, device=DEV).tolist()
    return torch.tensor((fixed + extra)[:B], dtype=torch.int64, device=DEV)


def inv_freq_of(DR):
    return 1.0 / (10000.0 ** (torch.arange(0, DR, 2, dtype=torch.float32, device=DEV) / DR))


def caches(gen, dtype):
    S = SHAPE
    return (rand(gen, LAYERS, ROWS, S["L"], S["R"], dtype=dtype), rand(gen, LAYERS, ROWS, S["L"], S["DR"], dtype=dtype))


def attention_problem(B, dtype, gen):
    S = SHAPE
    q = rand(gen, B, S["H"], S["NOPE"] + S["DR"], dtype=dtype)
    w_kv = rand(gen, S["H"], S["NOPE"] + S["V"], S["R"], dtype=dtype, scale=S["NOPE"] ** -0.5)
    return q, w_kv, *caches(gen, dtype), positions(B, S["L"], gen), (S["NOPE"] + S["DR"]) ** -0.5


def stale(cache, pos, value):
    """Overwrite each row's positions past pos[b]: they must never reach the result."""
    for b, p in enumerate(pos.tolist()):
        cache[LAYER, b, p + 1:] = value


def reference(q, w_kv, cache_kv, cache_pe, pos, scale):
    """fp64, row by row over the live positions only."""
    nope = q.shape[2] - cache_pe.shape[-1]
    w = w_kv.double()
    outs = []
    for b, p in enumerate(pos.tolist()):
        kv, pe, qb = cache_kv[LAYER, b, :p + 1].double(), cache_pe[LAYER, b, :p + 1].double(), q[b].double()
        q_lat = torch.einsum("hd,hdr->hr", qb[:, :nope], w[:, :nope])
        probs = ((q_lat @ kv.T + qb[:, nope:] @ pe.T) * scale).softmax(dim=-1)
        outs.append(torch.einsum("hr,hvr->hv", probs @ kv, w[:, nope:]).reshape(-1))
    return torch.stack(outs)


def assert_attention_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * ref.abs().max().item())


# ---- the cache write ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", BATCHES)
def test_cache_write_is_the_engine_rmsnorm_and_rope(B, dtype, gen):
    S = SHAPE
    H, NOPE, DR, R, L = S["H"], S["NOPE"], S["DR"], S["R"], S["L"]
    q = rand(gen, B, H, NOPE + DR, dtype=dtype)
    kv_a = rand(gen, B, R + DR, dtype=dtype, scale=3.0)
    norm = RMSNorm(R, eps=1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(rand(gen, R, scale=0.5) + 1)
    norm = norm.to(dtype)
    inv_freq, scaling, pos = inv_freq_of(DR), 1.13, positions(B, L, gen)
    cache_kv, cache_pe = caches(gen, dtype)
    q0, kv0, pe0 = q.clone(), cache_kv.clone(), cache_pe.clone()
    assert mla.cache_write_reason(q, kv_a, norm.weight, inv_freq, pos, cache_kv, cache_pe, LAYER) is None
    with torch.no_grad():
        mla.mla_cache_write(q, kv_a, norm.weight, norm.eps, inv_freq, scaling, pos, cache_kv, cache_pe, LAYER)
        angle = pos[:, None].float() * inv_freq
        freqs = torch.polar(torch.ones_like(angle), angle) * scaling  # as GraphDecode._step
        want_kv, want_pe = norm(kv_a[:, :R]), apply_rope(kv_a[:, R:], freqs)
        want_q = apply_rope(q0[..., NOPE:], freqs[:, None])
    rows = torch.arange(B, device=DEV)
    written = torch.zeros(LAYERS, ROWS, L, dtype=torch.bool, device=DEV)
    written[LAYER, rows, pos] = True
    assert torch.equal(cache_kv[~written], kv0[~written]) and torch.equal(cache_pe[~written], pe0[~written])
    tol = dict(rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(cache_kv[LAYER, rows, pos], want_kv, **tol)
    torch.testing.assert_close(cache_pe[LAYER, rows, pos], want_pe, **tol)
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE])  # only the rope part turns
    torch.testing.assert_close(q[..., NOPE:], want_q, **tol)


# ---- the attention ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,dtype", ROWS_DTYPES)
def test_attention_matches_fp64_and_never_reads_stale_positions(B, dtype, core, gen):
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(B, dtype, gen)
    stale(cache_kv, pos, float("nan"))
    stale(cache_pe, pos, float("nan"))
    assert mla.mla_reason(q, w_kv, cache_kv, cache_pe, LAYER, pos) is None
    assert_core(core)
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    ref = reference(q, w_kv, cache_kv, cache_pe, pos, scale)
    assert_attention_close(out, ref, dtype)
    # other garbage past each row's position: the same bits
    stale(cache_kv, pos, 3e4)
    stale(cache_pe, pos, float("-inf"))
    assert torch.equal(mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale), out)
    # the torch path computes the same maths
    assert_attention_close(mla.mla_reference(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale), ref, dtype)


@pytest.mark.parametrize("block_l", [4, 32] if CUDA else [4, 64])
def test_attention_any_position_block(block_l, core, gen, monkeypatch):
    """Many online-softmax steps with a ragged last one, or (on the CPU) one block longer than the whole cache.
    (A block of 64 at R=512 in fp32 would need 311 KB of shared memory.)"""
    monkeypatch.setattr(mla, "BLOCK_L", block_l)
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(3, torch.float32, gen)
    assert_core(core)
    stale(cache_kv, pos, float("nan"))
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    assert_attention_close(out, reference(q, w_kv, cache_kv, cache_pe, pos, scale), torch.float32)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_attention_split_over_positions(splits, core, gen, monkeypatch):
    """The core split into position chunks (one; several, the last ragged; more than the cache has blocks, so
    capped) merged by the output kernel: rows whose only live position is 0 leave every later chunk empty, and
    stale NaNs past each row's position reach no chunk."""
    monkeypatch.setattr(mla, "BLOCK_L", 4)
    monkeypatch.setattr(mla, "SPLITS", splits)
    monkeypatch.setattr(mla, "PROGRAMS", 10**6)  # SPLITS alone decides, whatever B * H
    assert_core(core)
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(4, torch.float32, gen)
    stale(cache_kv, pos, float("nan"))
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    assert_attention_close(out, reference(q, w_kv, cache_kv, cache_pe, pos, scale), torch.float32)


class _PartialsSpy:
    """Stands in for mla._out_kernel: keeps a copy of each launch's chunk partials (m, l), then launches it."""

    def __init__(self, kernel):
        self.kernel, self.ml = kernel, []

    def __getitem__(self, grid):
        def launch(w_kv, o_part, ml_part, *args, **kwargs):
            self.ml.append(ml_part.clone())
            return self.kernel[grid](w_kv, o_part, ml_part, *args, **kwargs)
        return launch


# on the CPU one dtype: the chunks' shares are of positions, and the Triton core sums in fp32 in each
@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.float32])
def test_attention_spreads_a_rows_live_positions_over_every_chunk(dtype, core, gen, monkeypatch):
    """A row's live positions are shared out over the chunks whatever the cache's length (docs/decode-log.md
    v30): rows of 16 and 41 live positions in 4-position blocks fill all 4 chunks, a row of one
    position fills chunk 0 alone. Chunks cut from the cache's length would leave the short rows in chunk 0."""
    monkeypatch.setattr(mla, "BLOCK_L", 4)
    monkeypatch.setattr(mla, "SPLITS", 4)
    monkeypatch.setattr(mla, "PROGRAMS", 10**6)
    spy = _PartialsSpy(mla._out_kernel)
    monkeypatch.setattr(mla, "_out_kernel", spy)
    assert_core(core)
    q, w_kv, cache_kv, cache_pe, _, scale = attention_problem(3, dtype, gen)
    pos = torch.tensor([15, 40, 0], device=DEV)
    stale(cache_kv, pos, float("nan"))
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    assert_attention_close(out, reference(q, w_kv, cache_kv, cache_pe, pos, scale), dtype)
    (ml,) = spy.ml
    filled = (ml[..., 1] > 0).all(dim=1)  # [B, splits]: the chunk's l > 0 for every head
    empty = (ml[..., 1] == 0).all(dim=1)
    want = torch.tensor([[True] * 4, [True] * 4, [True, False, False, False]], device=DEV)
    assert torch.equal(filled, want) and torch.equal(empty, ~want)


def test_attention_ragged_weight_slices(gen, monkeypatch):
    """q_lat and the output spread over several programs a head, each with a masked last slice (and W_UK rows
    loaded in several steps): the same result."""
    monkeypatch.setattr(mla, "SLICE_R", 16 if not CUDA else 128)  # R=40: 3 slices; R=512: 4
    monkeypatch.setattr(mla, "SLICE_V", 4 if not CUDA else 32)  # V=10: 3 slices; V=128: 4
    monkeypatch.setattr(mla, "BLOCK_N", 8 if not CUDA else 32)  # nope=12: 2 steps; 128: 4
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(3, torch.float32, gen)
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    assert_attention_close(out, reference(q, w_kv, cache_kv, cache_pe, pos, scale), torch.float32)


# ---- both kernels against the graph decode step's einsums ------------------------------------------------------

def einsum_attention(attn, x, cache, layer, pos, inv_freq, scaling):
    """The graph decode step's attention before these kernels (GraphDecode._attention, up to o_proj): torch
    einsums over the whole static cache with a position mask, the cache written by index."""
    B, H = x.shape[0], attn.n_heads
    angle = pos[:, None].float() * inv_freq
    freqs = torch.polar(torch.ones_like(angle), angle) * scaling
    valid = torch.arange(cache.max_len, device=x.device)[None, :] <= pos[:, None]
    rows = torch.arange(B, device=x.device)
    q, kv_a = project_pair(x, attn.q_in, attn.kv_a_proj_with_mqa, attn.pair_kernel)
    if not hasattr(attn, "q_proj"):
        q = attn.q_b_proj(attn.q_a_layernorm(q))
    q_nope, q_pe = q.view(B, H, -1).split([attn.nope, attn.rope], dim=-1)
    c_kv, k_pe = kv_a.split([attn.kv_lora_rank, attn.rope], dim=-1)
    cache.kv[layer, rows, pos] = attn.kv_a_layernorm(c_kv).to(cache.kv.dtype)
    cache.pe[layer, rows, pos] = apply_rope(k_pe, freqs).to(cache.pe.dtype)
    q_pe = apply_rope(q_pe, freqs[:, None])
    kv, pe = cache.kv[layer, :B], cache.pe[layer, :B]
    w_kv = attn.kv_b_proj.weight.view(H, attn.nope + attn.v_dim, attn.kv_lora_rank)
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_kv[:, :attn.nope])
    scores = (torch.einsum("bhr,blr->bhl", q_lat, kv) + torch.einsum("bhd,bld->bhl", q_pe, pe)).float()
    probs = (scores * attn.scale).masked_fill(~valid[:, None], float("-inf")).softmax(dim=-1).to(x.dtype)
    o_lat = torch.einsum("bhl,blr->bhr", probs, kv)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_kv[:, attn.nope:]).reshape(B, -1)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_kernels_reproduce_the_einsum_attention_of_a_tiny_model(q_lora_rank):
    """A tiny fp32 model with yarn rope (scaling != 1), rows at different positions: the two kernels, called as
    the graph step calls them, against its former einsum attention; outputs and caches."""
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
                  kv_lora_rank=40, q_lora_rank=q_lora_rank, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10,
                  first_k_dense_replace=2, max_position_embeddings=64,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.0})
    model = Transformer(a).to(DEV).eval()
    assert model.attention_scaling != 1.0
    attn = model.layers[LAYER].self_attn
    with torch.no_grad():
        attn.kv_a_layernorm.weight.normal_(1.0, 0.3)
    inv_freq, B, H, L = model.inv_freq.to(DEV), 3, a.num_attention_heads, 45
    ours, theirs = LatentCache.for_model(model, 4, L), LatentCache.for_model(model, 4, L)
    ours.kv.normal_()  # earlier positions' history, and stale values past it
    ours.pe.normal_()
    ours.lengths[:B] = torch.tensor([17, 0, L - 1])
    for mine, other in ((ours.kv, theirs.kv), (ours.pe, theirs.pe), (ours.lengths, theirs.lengths)):
        other.copy_(mine)
    x = torch.randn(B, a.hidden_size, device=DEV)
    with torch.no_grad():
        want = einsum_attention(attn, x, theirs, LAYER, theirs.lengths[:B], inv_freq, model.attention_scaling)
        pos = ours.lengths[:B]
        q, kv_a = project_pair(x, attn.q_in, attn.kv_a_proj_with_mqa, attn.pair_kernel)
        if not hasattr(attn, "q_proj"):
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q = q.view(B, H, -1)
        norm_w = attn.kv_a_layernorm.weight
        assert mla.cache_write_reason(q, kv_a, norm_w, inv_freq, pos, ours.kv, ours.pe, LAYER) is None
        mla.mla_cache_write(q, kv_a, norm_w, attn.kv_a_layernorm.eps, inv_freq, model.attention_scaling, pos,
                            ours.kv, ours.pe, LAYER)
        w_kv = attn.kv_b_proj.weight.view(H, attn.nope + attn.v_dim, attn.kv_lora_rank)
        assert mla.mla_reason(q, w_kv, ours.kv, ours.pe, LAYER, pos) is None
        got = mla.mla_attention(q, w_kv, ours.kv, ours.pe, LAYER, pos, attn.scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.kv, theirs.kv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.pe, theirs.pe, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,dtype", ROWS_DTYPES)
def test_decode_in_three_launches_is_the_write_then_the_attention(B, dtype, core, gen):
    """mla_decode (the cache write riding with the first attention launch) against mla_cache_write then
    mla_attention: the same arithmetic, so the same bits in the output, the caches and q, also while its last launch
    asks a later launch's weights into L2 (``ahead``); and where the kernels do not admit the inputs (a latent wider
    than they hold), the same torch path as the two calls."""
    S = SHAPE
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(B, dtype, gen)
    kv_a = rand(gen, B, S["R"] + S["DR"], dtype=dtype, scale=3.0)
    norm_w, inv_freq = (rand(gen, S["R"], scale=0.5) + 1).to(dtype), inv_freq_of(S["DR"])
    later = (rand(gen, 3 * S["R"], S["R"], dtype=dtype), rand(gen, 7, 40, dtype=dtype))  # a later launch's weights
    assert_core(core)

    def run(fused, ahead=()):
        t = [x.clone() for x in (q, cache_kv, cache_pe)]
        if fused:
            out = mla.mla_decode(t[0], kv_a, norm_w, 1e-6, inv_freq, 1.13, w_kv, t[1], t[2], LAYER, pos, scale,
                                 ahead=ahead)
        else:
            mla.mla_cache_write(t[0], kv_a, norm_w, 1e-6, inv_freq, 1.13, pos, t[1], t[2], LAYER)
            out = mla.mla_attention(t[0], w_kv, t[1], t[2], LAYER, pos, scale)
        return [out, *t]

    apart = run(False)
    assert not torch.equal(apart[1], q)  # the rope part turned
    for mine, asking, theirs in zip(run(True), run(True, later), apart):
        assert torch.equal(mine, theirs) and torch.equal(asking, theirs)
    assert_attention_close(apart[0], reference(apart[1], w_kv, apart[2], apart[3], pos, scale), dtype)
    with pytest.MonkeyPatch.context() as mp:  # the torch path, for both: the same bits again (the kernels' own
        # results differ from it by the interpreter's bf16 truncation, amplified by the softmax in places)
        mp.setattr(mla, "MAX_R", S["R"] - 1)
        assert "R=" in mla.mla_reason(q, w_kv, cache_kv, cache_pe, LAYER, pos)
        for mine, theirs in zip(run(True), run(False)):
            assert torch.equal(mine, theirs)


# ---- fallbacks and errors ----------------------------------------------------------------------------------------

def test_gluon_core_takes_only_tiles_its_layout_covers(monkeypatch):
    """The Gluon core's layout spreads a tile's latent over 8 values x 8 lanes x 4 warps (256) and its rope dims over
    32 lanes x warps: narrower tiles, a position block its 4 lanes do not divide, the interpreter (which cannot run
    Gluon) or the switch off leave the Triton core (None)."""
    monkeypatch.setattr(mla, "interpreting", lambda: False)
    monkeypatch.setattr(mla, "GLUON_CORE", True)
    layout = mla._gluon_core(512, 64)
    assert layout is not None and layout["BLOCK_L"] % layout["LANES"] == 0 and layout["VEC_PE"] == 2
    assert mla._gluon_core(256, 32) is not None  # exactly covered: 8 x 8 x 4 latent values, 1 x 8 x 4 rope dims
    assert mla._gluon_core(128, 64) is None  # latent narrower than the layout
    assert mla._gluon_core(512, 16) is None  # rope dims narrower than the layout
    monkeypatch.setattr(mla, "BLOCK_L", 6)
    assert mla._gluon_core(512, 64) is None
    monkeypatch.setattr(mla, "BLOCK_L", 16)
    monkeypatch.setattr(mla, "GLUON_CORE", False)
    assert mla._gluon_core(512, 64) is None
    monkeypatch.setattr(mla, "GLUON_CORE", True)
    monkeypatch.setattr(mla, "interpreting", lambda: True)
    assert mla._gluon_core(512, 64) is None


def test_inadmissible_inputs_take_the_torch_path(gen, monkeypatch):
    S = SHAPE
    DR, R = S["DR"], S["R"]
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(3, torch.float32, gen)
    kv_a, norm_w, inv_freq = rand(gen, 3, R + DR), rand(gen, R) + 1, inv_freq_of(DR)
    ref = reference(q, w_kv, cache_kv, cache_pe, pos, scale)
    # the kernels' results, to hold the torch path to
    kernel = [t.clone() for t in (q, cache_kv, cache_pe)]
    mla.mla_cache_write(kernel[0], kv_a, norm_w, 1e-6, inv_freq, 0.9, pos, kernel[1], kernel[2], LAYER)
    kernel.append(mla.mla_attention(kernel[0], w_kv, kernel[1], kernel[2], LAYER, pos, scale))
    # a strided q: attention as the reference, and the cache write rotates it in place all the same
    wide = torch.zeros(*q.shape[:2], 2 * q.shape[2], device=DEV)
    wide[..., ::2] = q
    strided = wide[..., ::2]
    assert "contiguous" in mla.mla_reason(strided, w_kv, cache_kv, cache_pe, LAYER, pos)
    assert_attention_close(mla.mla_attention(strided, w_kv, cache_kv, cache_pe, LAYER, pos, scale), ref,
                           torch.float32)
    assert "contiguous" in mla.cache_write_reason(strided, kv_a, norm_w, inv_freq, pos, cache_kv, cache_pe)
    kv2, pe2 = cache_kv.clone(), cache_pe.clone()
    mla.mla_cache_write(strided, kv_a, norm_w, 1e-6, inv_freq, 0.9, pos, kv2, pe2, LAYER)
    for mine, theirs in zip((strided, kv2, pe2), kernel):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # a latent wider than the kernels hold
    monkeypatch.setattr(mla, "MAX_R", R - 1)
    assert "R=" in mla.mla_reason(q, w_kv, cache_kv, cache_pe, LAYER, pos)
    assert_attention_close(mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale), ref, torch.float32)
    # on the CPU without the interpreter neither kernel runs: the same maths does
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, kv_a, norm_w, inv_freq, pos, cache_kv, cache_pe, w_kv = (
        t.cpu().clone() for t in (q, kv_a, norm_w, inv_freq, pos, cache_kv, cache_pe, w_kv))
    assert "device" in mla.cache_write_reason(q, kv_a, norm_w, inv_freq, pos, cache_kv, cache_pe, LAYER)
    mla.mla_cache_write(q, kv_a, norm_w, 1e-6, inv_freq, 0.9, pos, cache_kv, cache_pe, LAYER)
    assert "device" in mla.mla_reason(q, w_kv, cache_kv, cache_pe, LAYER, pos)
    out = mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)
    for mine, theirs in zip((q, cache_kv, cache_pe, out), kernel):
        torch.testing.assert_close(mine, theirs.cpu(), rtol=1e-5, atol=1e-5)


def test_shape_errors_are_errors(gen):
    S = SHAPE
    DR, R = S["DR"], S["R"]
    q, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(3, torch.float32, gen)
    kv_a, norm_w, inv_freq = rand(gen, 3, R + DR), rand(gen, R), inv_freq_of(DR)
    bad = [
        lambda: mla.mla_attention(q, w_kv[..., :-1], cache_kv, cache_pe, LAYER, pos, scale),  # w_kv not [H, ., R]
        lambda: mla.mla_attention(q, w_kv[1:], cache_kv, cache_pe, LAYER, pos, scale),  # heads differ
        lambda: mla.mla_attention(q, w_kv, cache_kv, cache_pe[:1], LAYER, pos, scale),  # caches differ
        lambda: mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYERS, pos, scale),  # no such layer
        lambda: mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos.float(), scale),  # float positions
        lambda: mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos[:2], scale),  # a position per row
        lambda: mla.mla_attention(q, w_kv, cache_kv[:, :2], cache_pe[:, :2], LAYER, pos, scale),  # rows > cache
        lambda: mla.mla_reference(q[..., :DR], w_kv, cache_kv, cache_pe, LAYER, pos, scale),  # no nope part
        lambda: mla.mla_cache_write(q, kv_a[:, :-1], norm_w, 1e-6, inv_freq, 1.0, pos, cache_kv, cache_pe, LAYER),
        lambda: mla.mla_cache_write(q, kv_a, norm_w[:-1], 1e-6, inv_freq, 1.0, pos, cache_kv, cache_pe, LAYER),
        lambda: mla.mla_cache_write(q, kv_a, norm_w, 1e-6, inv_freq[:-1], 1.0, pos, cache_kv, cache_pe, LAYER),
        lambda: mla.mla_cache_write(q[0], kv_a, norm_w, 1e-6, inv_freq, 1.0, pos, cache_kv, cache_pe, LAYER),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


@pytest.mark.skipif(not CUDA, reason="the prefetch is issued on a GPU only")
def test_ahead_asks_for_what_a_bulk_prefetch_can_take(monkeypatch):
    """kernels/_l2.args: contiguous tensors at 16-byte addresses and sizes, at most two, each split into 16-byte chunks
    that cover it over the launch's threads; nothing under the interpreter, which cannot run the prefetch."""
    w = torch.zeros(1000, 64, dtype=torch.bfloat16, device=DEV)
    flat = w.view(-1)
    ok = flat[8:-8]  # 16 bytes in, 16-byte sized
    args = _l2.args((w[:, ::2], flat[1:129], ok, w, flat[:64]), programs=3, warps=4, fallback=w)
    assert args["N"] == 2 and (args["n0"], args["n1"]) == (ok.nbytes, w.nbytes)
    assert args["r0"].data_ptr() == ok.data_ptr() and args["r1"].data_ptr() == w.data_ptr()
    for n, chunk in ((args["n0"], args["CHUNK0"]), (args["n1"], args["CHUNK1"])):
        assert chunk % 16 == 0 and n <= 3 * args["THREADS"] * chunk < n + 3 * args["THREADS"] * 16
    assert _l2.args((w[:, ::2], flat[1:129]), programs=3, warps=4, fallback=w)["N"] == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _l2.args((w,), programs=3, warps=4, fallback=w)["N"] == 0


# ---- CUDA graphs --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_positions(core, gen):
    S, B, dtype = SHAPE, 4, torch.bfloat16
    q_src, w_kv, cache_kv, cache_pe, pos, scale = attention_problem(B, dtype, gen)
    kv_a, norm_w = rand(gen, B, S["R"] + S["DR"], dtype=dtype), rand(gen, S["R"], dtype=dtype) + 1
    inv_freq, q = inv_freq_of(S["DR"]), torch.empty_like(q_src)
    assert_core(core)

    def step():
        q.copy_(q_src)  # the write rotates q in place: each replay starts from the projection's output
        mla.mla_cache_write(q, kv_a, norm_w, 1e-6, inv_freq, 1.13, pos, cache_kv, cache_pe, LAYER)
        return mla.mla_attention(q, w_kv, cache_kv, cache_pe, LAYER, pos, scale)

    graph, out = capture(step)
    for _ in range(3):  # new positions and inputs into the captured buffers
        pos.copy_(torch.randperm(S["L"], generator=gen, device=DEV)[:B])
        q_src.copy_(rand(gen, *q_src.shape, dtype=dtype))
        kv_a.copy_(rand(gen, *kv_a.shape, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        got, kv_after, pe_after = out.clone(), cache_kv.clone(), cache_pe.clone()
        assert torch.equal(got, step())  # eager, on the same state: the same slots, the same bits
        assert torch.equal(cache_kv, kv_after) and torch.equal(cache_pe, pe_after)
        assert_attention_close(got, reference(q, w_kv, cache_kv, cache_pe, pos, scale), dtype)
