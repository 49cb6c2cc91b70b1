"""Multi-head latent attention (DeepSeek-V2, absorbed form) at decode: three launches a layer, for CUDA graphs.

- ``mla_cache_write(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer)``: RMSNorm of
  kv_a[b, :R] into cache_kv [layers, rows, L, R] and rope of kv_a[b, R:] into cache_pe [layers, rows, L, Dr], both
  at position pos[b] of cache row b; the rope part of q [B, H, nope + Dr] is rotated in place. One launch.
- ``mla_attention(q, w_kv, cache_kv, cache_pe, layer, pos, scale)`` -> out [B, H*v] in q's dtype: row b's heads
  over positions 0..pos[b] of cache row b, w_kv [H, nope + v, R] holding W_UK and W_UV; fp32 inside, rounded
  once. Three launches.
- ``mla_decode(q, kv_a, norm_weight, eps, inv_freq, scaling, w_kv, cache_kv, cache_pe, layer, pos, scale, ahead=())``:
  the two above in order, the same results, in three launches: the cache write runs as extra programs of the first;
  the last asks ``ahead``'s weights (a later launch's) into L2.
One dtype (fp16/bf16/fp32) for q, kv_a, weights and caches; pos int32/int64, each in [0, L) (the device cannot
check it). Inadmissible inputs (``cache_write_reason``, ``mla_reason``) take the torch path, which computes the
same maths; wrong shapes raise ValueError. Contract, launches, measurements: kernels/KERNELS.md, section
"Latent attention (`mla.py`)".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import _l2, pdl
from ._admit import device_reason, dtype_reason, interpreting

# Limits of what was compiled for sm_90 and fits (no spills; shared memory 135 KB in fp32, 72 KB in bf16):
MAX_R = 512  # the latent (kv_lora_rank) is held whole: BLOCK_L x R and SLICE_V x R tiles
MAX_DR = 256  # rope dims, held whole
MAX_HEAD = 1024  # nope looped over in BLOCK_N rows, v spread over programs of SLICE_V rows
MAX_Q_PAIRS = 4096  # the cache write holds every head's rope pairs of a row at once (H * Dr/2)
BLOCK_L = 16  # cache positions per step of the online softmax (32: 255 registers at R=512)
# Position chunks a (row, head), flash-decoding: up to SPLITS, until the core has about PROGRAMS programs. On an
# H200 at batch 1 (16 programs unsplit) 4 chunks took the decode step from 2.53 to 2.39 ms; at batch 8 (128
# programs) splitting gained nothing (docs/decode-log.md v8).
SPLITS = 4
PROGRAMS = 64
BLOCK_N = 64  # W_UK rows (of nope) per load in the q_lat kernel
SLICE_R = 64  # latent columns per q_lat program: R / SLICE_R programs a head
SLICE_V = 16  # W_UV rows per output program: v / SLICE_V programs a head
SLICE_WARPS = 4  # the q_lat and output kernels
NUM_WARPS = 4  # the attention core: 8 took the b1 step 1.79 -> 1.85 ms on an H200, 2 as slow (docs/decode-log.md v11)
W_STAGES = 2  # pipeline stages (cp.async) of the W_UK loop
L_STAGES = 3  # and of the position loop
WRITE_WARPS = SLICE_WARPS  # mla_decode writes in the q-latent launch: the same warps, the same bits
# The attention core on a GPU in Gluon, its layout chosen: a tile's positions in each thread's registers and across
# CORE_LANES lanes, the latent across the warp's other lanes and every warp (docs/decode-log.md v31)
GLUON_CORE = True
CORE_LANES = 4
CORE_VEC = 8  # latent values a thread loads at once (16 bytes in bf16)


# ---- kernels -------------------------------------------------------------------------------------------------

@triton.jit
def _rope_freqs(p, inv_freq, scaling, DR: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rope pair i at position p is rotated by the complex (fr, fi), as torch.polar(1, angle) * scaling makes it."""
    i = tl.arange(0, BLOCK_P)
    im = i < DR // 2
    angle = p.to(tl.float32) * tl.load(inv_freq + i, mask=im, other=0.0)
    return tl.cos(angle) * scaling, tl.sin(angle) * scaling, i, im


@triton.jit
def _write_latent(kv_a, w, cache_kv, cache_pe, eps, kva_stride, layer, rows, b, p, fr, fi, i, im, R: tl.constexpr,
                  DR: tl.constexpr, L: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row b's cache slot at position p: the RMSNorm of its c_kv and the rope of its k_pe."""
    keep = (p >= 0) & (p < L)  # a position outside the cache is skipped, never written out of bounds
    slot = ((layer * rows + b).to(tl.int64) * L + p.to(tl.int64))
    src = kv_a + b.to(tl.int64) * kva_stride
    # RMSNorm of c_kv, rounded as the engine's RMSNorm rounds
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    c = tl.load(src + r, mask=rm, other=0.0).to(tl.float32)
    normed = (c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps)).to(kv_a.dtype.element_ty).to(tl.float32)
    y = tl.load(w + r, mask=rm, other=0.0).to(tl.float32) * normed
    tl.store(cache_kv + slot * R + r, y.to(cache_kv.dtype.element_ty), mask=rm & keep)
    ke = tl.load(src + R + 2 * i, mask=im, other=0.0).to(tl.float32)
    ko = tl.load(src + R + 2 * i + 1, mask=im, other=0.0).to(tl.float32)
    pe = cache_pe + slot * DR + 2 * i
    tl.store(pe, (ke * fr - ko * fi).to(cache_pe.dtype.element_ty), mask=im & keep)
    tl.store(pe + 1, (ke * fi + ko * fr).to(cache_pe.dtype.element_ty), mask=im & keep)


@triton.jit
def _rotate_q(q, b, h, hm, fr, fi, i, im, H: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr):
    """The rope part of row b's query heads h (a block, live where hm), in place."""
    qm = hm[:, None] & im[None, :]
    qp = q + b.to(tl.int64) * (H * (NOPE + DR)) + h[:, None] * (NOPE + DR) + NOPE + 2 * i[None, :]
    qe = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
    qo = tl.load(qp + 1, mask=qm, other=0.0).to(tl.float32)
    tl.store(qp, (qe * fr[None, :] - qo * fi[None, :]).to(q.dtype.element_ty), mask=qm)
    tl.store(qp + 1, (qe * fi[None, :] + qo * fr[None, :]).to(q.dtype.element_ty), mask=qm)


@triton.jit(do_not_specialize=["layer", "rows"])
def _cache_write_kernel(q, kv_a, w, inv_freq, pos, cache_kv, cache_pe, eps, scaling, kva_stride, layer, rows,
                        H: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program b: row b's cache slot at pos[b], and its query heads' rope parts in place."""
    pdl.wait(PDL)
    b = tl.program_id(0)
    p = tl.load(pos + b)
    fr, fi, i, im = _rope_freqs(p, inv_freq, scaling, DR, BLOCK_P)
    _write_latent(kv_a, w, cache_kv, cache_pe, eps, kva_stride, layer, rows, b, p, fr, fi, i, im, R, DR, L, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    _rotate_q(q, b, h, h < H, fr, fi, i, im, H, NOPE, DR)


@triton.jit(do_not_specialize=["layer", "rows"])
def _q_latent_kernel(q, w_kv, q_lat, kv_a, w_norm, inv_freq, pos, cache_kv, cache_pe, eps, scaling, kva_stride, layer,
                     rows, H: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                     L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
                     WRITE: tl.constexpr, FULL_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h, j): q_lat[b, h, j*BLOCK_R:(j+1)*BLOCK_R] = q_nope[b, h] @ W_UK[h][:, that slice], fp32. With
    WRITE, programs (b, h, cdiv(R, BLOCK_R)) also do mla_cache_write's work, a launch fewer: head h's rope part in
    place, and at h = 0 row b's cache slot (q_lat reads q_nope only, so the two parts never touch the same memory)."""
    pdl.wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    if WRITE and tl.program_id(2) == tl.cdiv(R, BLOCK_R):
        p = tl.load(pos + b)
        fr, fi, i, im = _rope_freqs(p, inv_freq, scaling, DR, BLOCK_P)
        _rotate_q(q, b, h + tl.arange(0, 1), tl.full([1], True, tl.int1), fr, fi, i, im, H, NOPE, DR)
        if h == 0:
            _write_latent(kv_a, w_norm, cache_kv, cache_pe, eps, kva_stride, layer, rows, b, p, fr, fi, i, im, R, DR,
                          L, FULL_R)
    else:
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < R
        w_h = w_kv + h.to(tl.int64) * ((NOPE + V) * R)
        q_bh = q + (b * H + h).to(tl.int64) * (NOPE + DR)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for n0 in tl.range(0, NOPE, BLOCK_N, num_stages=STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < NOPE
            qn = tl.load(q_bh + n, mask=nm, other=0.0).to(tl.float32)
            wt = tl.load(w_h + n[:, None] * R + r[None, :], mask=nm[:, None] & rm[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wt * qn[:, None], axis=0)
        tl.store(q_lat + (b * H + h).to(tl.int64) * R + r, acc, mask=rm)


@triton.jit(do_not_specialize=["layer", "rows"])
def _latent_attention_kernel(q, q_lat, cache_kv, cache_pe, pos, o_part, ml_part, scale, layer, rows,
                             H: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr, R: tl.constexpr,
                             L: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_DR: tl.constexpr, BLOCK_L: tl.constexpr, L_STAGES: tl.constexpr,
                             STATIC_BOUND: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h, c): over the live positions of chunk c (the row's live BLOCK_L tiles shared out in runs of
    equal length, so that however few of the cache's L positions are live, they spread over every chunk), the
    running max m of the latent scores, l = sum of exp(score - m) and o = sum of exp(score - m) * kv, fp32:
    o_part[b, h, c] = o, ml_part[b, h, c] = (m, l); a chunk with no live position gives (-inf, 0) and o = 0."""
    pdl.wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    bh = (b * H + h).to(tl.int64)
    ql = tl.load(q_lat + bh * R + r, mask=rm, other=0.0)
    d = tl.arange(0, BLOCK_DR)
    dm = d < DR
    q_pe = tl.load(q + bh * (NOPE + DR) + NOPE + d, mask=dm, other=0.0).to(tl.float32)
    live = tl.minimum(tl.load(pos + b).to(tl.int32) + 1, L)
    chunk = tl.cdiv(tl.cdiv(live, BLOCK_L), SPLITS) * BLOCK_L
    lo = c * chunk
    hi = tl.minimum(live, lo + chunk)  # past the chunk's live end
    row = (layer * rows + b).to(tl.int64) * L
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    # The interpreter cannot take a loop bound loaded from memory (its scalars are 1-element arrays, which
    # numpy refuses as an index): there the loop runs over CHUNK positions, the most a chunk can hold, and the
    # tiles past hi, fully masked, change nothing (m_safe below keeps a chunk with nothing live yet at exp(-inf) =
    # 0, not NaN).
    for i in tl.range(0, CHUNK if STATIC_BOUND else hi - lo, BLOCK_L, num_stages=L_STAGES):
        lpos = lo + i + tl.arange(0, BLOCK_L)
        lm = lpos < hi
        kv = tl.load(cache_kv + (row + lpos)[:, None] * R + r[None, :], mask=lm[:, None] & rm[None, :],
                     other=0.0).to(tl.float32)
        pe = tl.load(cache_pe + (row + lpos)[:, None] * DR + d[None, :], mask=lm[:, None] & dm[None, :],
                     other=0.0).to(tl.float32)
        s = (tl.sum(kv * ql[None, :], axis=1) + tl.sum(pe * q_pe[None, :], axis=1)) * scale
        s = tl.where(lm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha + tl.sum(pr[:, None] * kv, axis=0)
        m_i = m_new
    part = bh * SPLITS + c
    tl.store(o_part + part * R + r, acc, mask=rm)
    tl.store(ml_part + part * 2, m_i)
    tl.store(ml_part + part * 2 + 1, l_i)


@gluon.jit
def _gl_wait():
    """pdl.wait in Gluon: wait for the previous launch, then let the next one launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit(do_not_specialize=["layer", "rows"])
def _latent_attention_gluon(q, q_lat, cache_kv, cache_pe, pos, o_part, ml_part, scale, layer, rows,
                            H: gl.constexpr, NOPE: gl.constexpr, DR: gl.constexpr, R: gl.constexpr, L: gl.constexpr,
                            SPLITS: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_DR: gl.constexpr,
                            BLOCK_L: gl.constexpr, LANES: gl.constexpr, VEC: gl.constexpr, VEC_PE: gl.constexpr,
                            WARPS: gl.constexpr, PDL: gl.constexpr):
    """_latent_attention_kernel's work, the same chunks and partials, with its layout set: the scores' sum over the
    latent crosses the warps once; the max, the sum of p and the weighted sum over positions stay inside each thread
    and its LANES lanes (Triton's own choice put positions across the warps: three cross-warp sums a tile)."""
    KV: gl.constexpr = gl.BlockedLayout([BLOCK_L // LANES, VEC], [LANES, 32 // LANES], [1, WARPS], [1, 0])
    PE: gl.constexpr = gl.BlockedLayout([BLOCK_L // LANES, VEC_PE], [LANES, 32 // LANES], [1, WARPS], [1, 0])
    if PDL:
        _gl_wait()
    b = gl.program_id(0)
    h = gl.program_id(1)
    c = gl.program_id(2)
    r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, KV))
    rm = r < R
    d = gl.arange(0, BLOCK_DR, layout=gl.SliceLayout(0, PE))
    dm = d < DR
    bh = (b * H + h).to(gl.int64)
    ql = gl.load(q_lat + bh * R + r, mask=rm, other=0.0)
    q_pe = gl.load(q + bh * (NOPE + DR) + NOPE + d, mask=dm, other=0.0).to(gl.float32)
    live = gl.minimum(gl.load(pos + b).to(gl.int32) + 1, L)
    chunk = gl.cdiv(gl.cdiv(live, BLOCK_L), SPLITS) * BLOCK_L
    lo = c * chunk
    hi = gl.minimum(live, lo + chunk)
    row = (layer * rows + b).to(gl.int64) * L
    l_kv = gl.arange(0, BLOCK_L, layout=gl.SliceLayout(1, KV))
    l_pe = gl.arange(0, BLOCK_L, layout=gl.SliceLayout(1, PE))
    m_i = gl.max(gl.full([BLOCK_L], float("-inf"), gl.float32, layout=gl.SliceLayout(1, KV)), axis=0)
    l_i = gl.sum(gl.zeros([BLOCK_L], gl.float32, layout=gl.SliceLayout(1, KV)), axis=0)
    acc = gl.zeros([BLOCK_R], gl.float32, layout=gl.SliceLayout(0, KV))
    for i in range(0, hi - lo, BLOCK_L):
        p_kv = lo + i + l_kv
        p_pe = lo + i + l_pe
        kv = gl.load(cache_kv + (row + p_kv)[:, None] * R + r[None, :], mask=(p_kv < hi)[:, None] & rm[None, :],
                     other=0.0).to(gl.float32)
        pe = gl.load(cache_pe + (row + p_pe)[:, None] * DR + d[None, :], mask=(p_pe < hi)[:, None] & dm[None, :],
                     other=0.0).to(gl.float32)
        # the positions sit alike in both layouts: this conversion moves nothing
        s_pe = gl.convert_layout(gl.sum(pe * q_pe[None, :], axis=1), gl.SliceLayout(1, KV), assert_trivial=True)
        s = (gl.sum(kv * ql[None, :], axis=1) + s_pe) * scale
        s = gl.where(p_kv < hi, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_safe)
        pr = gl.exp(s - m_safe)
        l_i = l_i * alpha + gl.sum(pr, axis=0)
        acc = acc * alpha + gl.sum(pr[:, None] * kv, axis=0)
        m_i = m_new
    part = bh * SPLITS + c
    gl.store(o_part + part * R + r, acc, mask=rm)
    gl.store(ml_part + part * 2, m_i)
    gl.store(ml_part + part * 2 + 1, l_i)


def _gluon_core(block_r: int, block_dr: int) -> dict | None:
    """The Gluon core's layout constants for these tiles, or None where its layout is wider than them (a layout wider
    than its tile holds elements twice; neither compiled nor measured so), or under the interpreter, which cannot run
    Gluon: then the Triton core runs."""
    spread, warps = 32 // CORE_LANES, NUM_WARPS
    vec_pe = min(CORE_VEC, block_dr // (spread * warps))
    if not GLUON_CORE or interpreting() or BLOCK_L % CORE_LANES or block_r < CORE_VEC * spread * warps or vec_pe < 1:
        return None
    return dict(BLOCK_L=BLOCK_L, LANES=CORE_LANES, VEC=CORE_VEC, VEC_PE=vec_pe, WARPS=warps, num_warps=warps)


@triton.jit
def _out_kernel(w_kv, o_part, ml_part, out, H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
                r0, n0, r1, n1, N: tl.constexpr, THREADS: tl.constexpr, CHUNK0: tl.constexpr, CHUNK1: tl.constexpr):
    """Program (b, h, j): o_lat[b, h] from the chunks' partials (rescaled to their common max, summed in ascending
    chunk order, divided by the rescaled sum of l), then out[b, h*V + j*BLOCK_V + i] = W_UV[h][that row] . o_lat,
    rounded once. First it asks its share of the ``ahead`` weights into L2 (kernels/_l2.py)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    _l2.ask(r0, n0, r1, n1, (b * H + h) * tl.num_programs(2) + tl.program_id(2), N, THREADS, CHUNK0, CHUNK1)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = v < V
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    w_h = w_kv + h.to(tl.int64) * ((NOPE + V) * R)
    wt = tl.load(w_h + (NOPE + v)[:, None] * R + r[None, :], mask=vm[:, None] & rm[None, :], other=0.0)
    pdl.wait(PDL)  # the weight slice is read while the attention core finishes; o_lat is its output
    bh = (b * H + h).to(tl.int64)
    m = tl.load(ml_part + bh * SPLITS * 2)  # chunk 0 holds position 0, always live: m is finite
    for c in tl.static_range(1, SPLITS):
        m = tl.maximum(m, tl.load(ml_part + (bh * SPLITS + c) * 2))
    ol = tl.zeros([BLOCK_R], dtype=tl.float32)
    denom = tl.zeros([], dtype=tl.float32)
    for c in tl.static_range(SPLITS):
        part = bh * SPLITS + c
        wc = tl.exp(tl.load(ml_part + part * 2) - m)  # 1 for one chunk, 0 for a chunk with nothing live
        ol += wc * tl.load(o_part + part * R + r, mask=rm, other=0.0)
        denom += wc * tl.load(ml_part + part * 2 + 1)
    y = tl.sum(wt.to(tl.float32) * (ol / denom)[None, :], axis=1)
    tl.store(out + bh * V + v, y.to(out.dtype.element_ty), mask=vm)


# ---- torch path: the reference and the fallback -------------------------------------------------------------

def _rope_torch(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """As the engine's apply_rope: adjacent pairs of x times complex freqs, in fp32, rounded to x's dtype."""
    xc = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def _cache_write_torch(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer):
    B, R = q.shape[0], cache_kv.shape[-1]
    angle = pos[:, None].float() * inv_freq.float()
    freqs = torch.polar(torch.ones_like(angle), angle) * scaling
    rows = torch.arange(B, device=pos.device)
    c = kv_a[:, :R].float()
    y = norm_weight * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(kv_a.dtype)
    cache_kv[layer, rows, pos] = y.to(cache_kv.dtype)
    cache_pe[layer, rows, pos] = _rope_torch(kv_a[:, R:], freqs).to(cache_pe.dtype)
    nope = q.shape[2] - cache_pe.shape[-1]
    q[..., nope:] = _rope_torch(q[..., nope:], freqs[:, None])


def mla_reference(q, w_kv, cache_kv, cache_pe, layer: int, pos, scale: float) -> torch.Tensor:
    """The torch path of mla_attention (same maths, fp32, over the whole cache with a position mask)."""
    _check_attention(q, w_kv, cache_kv, cache_pe, layer, pos)
    B, H, _ = q.shape
    L, Dr = cache_kv.shape[2], cache_pe.shape[-1]
    nope = q.shape[2] - Dr
    w = w_kv.float()
    live = torch.arange(L, device=q.device)[None, :] <= pos[:, None]  # [B, L]
    # stale positions are zeroed, not only masked: a non-finite one would turn 0 * inf into NaN
    kv = torch.where(live[..., None], cache_kv[layer, :B].float(), 0.0)
    pe = torch.where(live[..., None], cache_pe[layer, :B].float(), 0.0)
    q_lat = torch.einsum("bhd,hdr->bhr", q[..., :nope].float(), w[:, :nope])
    s = (torch.einsum("bhr,blr->bhl", q_lat, kv) + torch.einsum("bhd,bld->bhl", q[..., nope:].float(), pe)) * scale
    p = s.masked_fill(~live[:, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhr,hvr->bhv", torch.einsum("bhl,blr->bhr", p, kv), w[:, nope:])
    return out.reshape(B, -1).to(q.dtype)


# ---- shapes (errors) and admission (fallbacks) --------------------------------------------------------------

def _check_cache(cache_kv, cache_pe, layer, pos, B):
    if cache_kv.dim() != 4 or cache_pe.dim() != 4 or cache_kv.shape[:3] != cache_pe.shape[:3]:
        raise ValueError(f"expected cache_kv [layers, rows, L, R] and cache_pe [layers, rows, L, Dr], got "
                         f"{tuple(cache_kv.shape)} and {tuple(cache_pe.shape)}")
    if not 0 <= layer < cache_kv.shape[0]:
        raise ValueError(f"layer {layer} outside the cache's {cache_kv.shape[0]} layers")
    if B > cache_kv.shape[1]:
        raise ValueError(f"{B} rows but the cache holds {cache_kv.shape[1]}")
    if pos.dim() != 1 or pos.shape[0] != B or pos.dtype.is_floating_point or pos.dtype.is_complex \
            or pos.dtype == torch.bool:
        raise ValueError(f"expected integer pos [B={B}], got {tuple(pos.shape)} {pos.dtype}")


def _check_cache_write(q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, layer):
    if q.dim() != 3 or cache_pe.dim() != 4 or q.shape[2] < cache_pe.shape[-1] or cache_pe.shape[-1] % 2:
        raise ValueError(f"expected q [B, H, nope + Dr] and cache_pe [layers, rows, L, Dr] with Dr even, got "
                         f"{tuple(q.shape)} and {tuple(cache_pe.shape)}")
    _check_cache(cache_kv, cache_pe, layer, pos, q.shape[0])
    R, Dr = cache_kv.shape[-1], cache_pe.shape[-1]
    if kv_a.dim() != 2 or tuple(kv_a.shape) != (q.shape[0], R + Dr):
        raise ValueError(f"expected kv_a [B, R + Dr] = {(q.shape[0], R + Dr)}, got {tuple(kv_a.shape)}")
    if tuple(norm_weight.shape) != (R,) or tuple(inv_freq.shape) != (Dr // 2,):
        raise ValueError(f"expected norm_weight [{R}] and inv_freq [{Dr // 2}], got {tuple(norm_weight.shape)} "
                         f"and {tuple(inv_freq.shape)}")


def _check_attention(q, w_kv, cache_kv, cache_pe, layer, pos):
    if q.dim() != 3 or cache_pe.dim() != 4 or q.shape[2] <= cache_pe.shape[-1]:
        raise ValueError(f"expected q [B, H, nope + Dr] with nope > 0 and cache_pe [layers, rows, L, Dr], got "
                         f"{tuple(q.shape)} and {tuple(cache_pe.shape)}")
    _check_cache(cache_kv, cache_pe, layer, pos, q.shape[0])
    R, Dr = cache_kv.shape[-1], cache_pe.shape[-1]
    if w_kv.dim() != 3 or w_kv.shape[0] != q.shape[1] or w_kv.shape[2] != R or w_kv.shape[1] <= q.shape[2] - Dr:
        raise ValueError(f"expected w_kv [H={q.shape[1]}, nope + v, R={R}] with v > 0, got {tuple(w_kv.shape)}")


def _common_reason(tensors: dict, pos, cache_kv, cache_pe) -> list:
    checks = [device_reason(pos, *tensors.values())]
    checks += [dtype_reason(name, t.dtype) for name, t in tensors.items()]
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        checks.append(f"dtypes differ: {sorted(str(d) for d in dtypes)}")
    if pos.dtype not in (torch.int32, torch.int64):
        checks.append(f"pos dtype {pos.dtype} is not int32 or int64")
    if not (pos.is_contiguous() and cache_kv.is_contiguous() and cache_pe.is_contiguous()):
        checks.append("pos and the caches must be contiguous")
    R, Dr = cache_kv.shape[-1], cache_pe.shape[-1]
    if not (1 <= R <= MAX_R and 2 <= Dr <= MAX_DR):
        checks.append(f"R={R} outside 1..{MAX_R} or Dr={Dr} outside 2..{MAX_DR}")
    if pos.shape[0] == 0:
        checks.append("no rows")
    return checks


def cache_write_reason(q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, layer: int = 0) -> str | None:
    """Admission predicate of mla_cache_write: None admits, else why it takes the torch path."""
    _check_cache_write(q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, layer)
    tensors = dict(q=q, kv_a=kv_a, norm_weight=norm_weight, cache_kv=cache_kv, cache_pe=cache_pe)
    checks = _common_reason(tensors, pos, cache_kv, cache_pe) + [device_reason(q, inv_freq)]
    if inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        checks.append(f"inv_freq must be contiguous float32, got {inv_freq.dtype}")
    if not q.is_contiguous():
        checks.append("q must be contiguous (its rope part is rotated in place)")
    if kv_a.stride(1) != 1:
        checks.append("kv_a's rows must be contiguous")
    if not 1 <= q.shape[1] * (cache_pe.shape[-1] // 2) <= MAX_Q_PAIRS:
        checks.append(f"H * Dr/2 = {q.shape[1] * (cache_pe.shape[-1] // 2)} rope pairs outside 1..{MAX_Q_PAIRS}")
    return next((c for c in checks if c), None)


def mla_reason(q, w_kv, cache_kv, cache_pe, layer: int, pos) -> str | None:
    """Admission predicate of mla_attention: None admits, else why it takes the torch path."""
    _check_attention(q, w_kv, cache_kv, cache_pe, layer, pos)
    tensors = dict(q=q, w_kv=w_kv, cache_kv=cache_kv, cache_pe=cache_pe)
    checks = _common_reason(tensors, pos, cache_kv, cache_pe)
    if not (q.is_contiguous() and w_kv.is_contiguous()):
        checks.append("q and w_kv must be contiguous")
    nope, v = q.shape[2] - cache_pe.shape[-1], w_kv.shape[1] - (q.shape[2] - cache_pe.shape[-1])
    if nope > MAX_HEAD or v > MAX_HEAD:
        checks.append(f"nope={nope} or v={v} above {MAX_HEAD}")
    return next((c for c in checks if c), None)


# ---- launches -----------------------------------------------------------------------------------------------

def _launch_cache_write(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    B, H, hd = q.shape
    layers, rows, L, R = cache_kv.shape
    Dr = cache_pe.shape[-1]
    return _cache_write_kernel[(B,)](
        q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, float(eps), float(scaling), kv_a.stride(0),
        layer, rows, H=H, NOPE=hd - Dr, DR=Dr, R=R, L=L, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_P=triton.next_power_of_2(Dr // 2), BLOCK_H=triton.next_power_of_2(H), num_warps=WRITE_WARPS,
        **pdl.flags(q.device))


def _launch_attention(q, w_kv, cache_kv, cache_pe, layer, pos, scale, out, write=None, ahead=()):
    """Three launches through fp32 scratch (q_lat [B, H, R], the chunks' partials); ``write`` (kv_a, norm_weight, eps,
    inv_freq, scaling): mla_cache_write's work too, in the first; ``ahead``: weights the third asks into L2. Returns
    Triton's compiled kernels in launch order (Nones under the interpreter)."""
    B, H, hd = q.shape
    layers, rows, L, R = cache_kv.shape
    Dr = cache_pe.shape[-1]
    nope = hd - Dr
    V = w_kv.shape[1] - nope
    splits = max(1, min(SPLITS, triton.cdiv(PROGRAMS, B * H), triton.cdiv(L, BLOCK_L)))
    chunk = triton.cdiv(triton.cdiv(L, splits), BLOCK_L) * BLOCK_L  # the most a chunk holds: a full cache's share
    q_lat = torch.empty(B, H, R, dtype=torch.float32, device=q.device)
    o_part = torch.empty(B, H, splits, R, dtype=torch.float32, device=q.device)
    ml_part = torch.empty(B, H, splits, 2, dtype=torch.float32, device=q.device)
    block_r, slice_r = triton.next_power_of_2(R), min(SLICE_R, triton.next_power_of_2(R))
    slice_v = min(SLICE_V, triton.next_power_of_2(V))
    flags = pdl.flags(q.device)
    kv_a, norm_weight, eps, inv_freq, scaling = write or (q, q, 0.0, q, 0.0)  # unread without WRITE
    k1 = _q_latent_kernel[(B, H, triton.cdiv(R, slice_r) + (write is not None))](
        q, w_kv, q_lat, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, float(eps), float(scaling),
        kv_a.stride(0), layer, rows, H=H, NOPE=nope, DR=Dr, R=R, V=V, L=L,
        BLOCK_N=min(BLOCK_N, triton.next_power_of_2(nope)), BLOCK_R=slice_r, STAGES=W_STAGES,
        WRITE=write is not None, FULL_R=block_r, BLOCK_P=triton.next_power_of_2(Dr // 2), num_warps=SLICE_WARPS,
        **flags)
    block_dr = triton.next_power_of_2(Dr)
    if (layout := _gluon_core(block_r, block_dr)) is not None:
        k2 = _latent_attention_gluon[(B, H, splits)](
            q, q_lat, cache_kv, cache_pe, pos, o_part, ml_part, float(scale), layer, rows, H=H, NOPE=nope, DR=Dr, R=R,
            L=L, SPLITS=splits, BLOCK_R=block_r, BLOCK_DR=block_dr, **layout, **flags)
    else:
        k2 = _latent_attention_kernel[(B, H, splits)](
            q, q_lat, cache_kv, cache_pe, pos, o_part, ml_part, float(scale), layer, rows, H=H, NOPE=nope, DR=Dr, R=R,
            L=L, CHUNK=chunk, SPLITS=splits, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_L=BLOCK_L,
            L_STAGES=L_STAGES, STATIC_BOUND=interpreting(), num_warps=NUM_WARPS, **flags)
    grid = (B, H, triton.cdiv(V, slice_v))
    k3 = _out_kernel[grid](
        w_kv, o_part, ml_part, out, H=H, NOPE=nope, R=R, V=V, SPLITS=splits, BLOCK_R=block_r, BLOCK_V=slice_v,
        num_warps=SLICE_WARPS, **_l2.args(ahead, B * H * grid[2], SLICE_WARPS, out), **flags)
    return [k1, k2, k3]


def mla_cache_write(q, kv_a, norm_weight, eps: float, inv_freq, scaling: float, pos, cache_kv, cache_pe,
                    layer: int) -> None:
    """cache_kv[layer, b, pos[b]] = RMSNorm(kv_a[b, :R]), cache_pe[layer, b, pos[b]] = rope(kv_a[b, R:]), and
    q[b, :, nope:] rotated in place, for every row b of q [B, H, nope + Dr]."""
    if cache_write_reason(q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, layer):
        _cache_write_torch(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer)
        return
    _launch_cache_write(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer)


def mla_attention(q, w_kv, cache_kv, cache_pe, layer: int, pos, scale: float) -> torch.Tensor:
    """out [B, H*v] in q's dtype: latent attention of q [B, H, nope + Dr] (rope part already rotated) over
    positions 0..pos[b] of cache row b, fp32 inside."""
    if mla_reason(q, w_kv, cache_kv, cache_pe, layer, pos):
        return mla_reference(q, w_kv, cache_kv, cache_pe, layer, pos, scale)
    out = _attention_out(q, w_kv, cache_pe)
    _launch_attention(q, w_kv, cache_kv, cache_pe, layer, pos, scale, out)
    return out


def _attention_out(q, w_kv, cache_pe) -> torch.Tensor:
    B, H = q.shape[:2]
    return torch.empty(B, H * (w_kv.shape[1] - q.shape[2] + cache_pe.shape[-1]), dtype=q.dtype, device=q.device)


def mla_decode(q, kv_a, norm_weight, eps: float, inv_freq, scaling: float, w_kv, cache_kv, cache_pe, layer: int, pos,
               scale: float, ahead=()) -> torch.Tensor:
    """mla_cache_write then mla_attention, the same results, in three launches (the write rides with the first).
    ``ahead``: up to two weight tensors of a later launch (the next layer's projections) that the last launch's
    programs ask into L2, to stay there, before their wait (kernels/_l2.py); no value changes."""
    if cache_write_reason(q, kv_a, norm_weight, inv_freq, pos, cache_kv, cache_pe, layer) \
            or mla_reason(q, w_kv, cache_kv, cache_pe, layer, pos):
        mla_cache_write(q, kv_a, norm_weight, eps, inv_freq, scaling, pos, cache_kv, cache_pe, layer)
        return mla_attention(q, w_kv, cache_kv, cache_pe, layer, pos, scale)
    out = _attention_out(q, w_kv, cache_pe)
    _launch_attention(q, w_kv, cache_kv, cache_pe, layer, pos, scale, out, (kv_a, norm_weight, eps, inv_freq, scaling),
                      ahead)
    return out


__all__ = ["mla_cache_write", "mla_attention", "mla_decode", "mla_reference", "cache_write_reason", "mla_reason"]
