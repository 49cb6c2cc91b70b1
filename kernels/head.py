"""head_pick: the decode step's end at batch 1 in one launch: the vocabulary projection, the greedy pick and its
margin, the pick written as the row's next input and the row's position advanced.

Contract: ``head_pick(x, w, counts, nxt, lengths, fallback)``, x [1, K], w [V, K] -> (logits [1, V] in x's dtype,
ids int64 [1], margins fp32 [1]). logits[0, v] is W's row v dotted with x in fp32, each BLOCK_K slice's products
summed and the slices added in ascending K order (kernels/gemv.py's order), rounded to x's dtype; ids and margins are
``pick_batch``'s of those logits (kernels/argmax.py: the first maximum, the first NaN, top1 - top2); then
nxt[0] = ids[0] and lengths[0] += 1. Program j takes ROWS rows of W (their first slice loaded before its PDL wait),
stores its logits and their best triple; the last program of each GROUP to finish merges the group's triples, and the
last of those merges the groups' (kernels/_count.py: ``counts`` int32, at least ``counts_for(V)``, zero, each count
put back to zero by the program that merged), so the answer never depends on scheduling. Inputs it does not admit
(``head_reason``) get ``fallback()``: the caller's projection, pick, copy and advance.

Why one launch: the step ended with cuBLAS's projection (106.7 µs on an H200 against a 94.7 µs read of its 419 MB,
docs/decode-log.md v19), which cannot start before the final norm ends, then the pick, the copy into the inputs and the
advance, three more launches on the step's path.

``head_pick_screened(x, w, screen, nxt, lengths, fallback)`` -> (ids, margins), the same pick, margin, write and
advance as ``head_pick`` without the logits, bit for bit, reading W in int8 and only a few of its rows in full. The
screen (``screen_of(w)``) holds W's rows in int8 with one scale each, and a bound c_i on each row with
|v_i - a_i| <= ||x|| c_i, where v_i is the kernel's fp32 dot of row i (gemv's order, as ``head_pick`` sums it) and
a_i the screen's: the quantization residual's norm (Cauchy-Schwarz) and fp32 summation's error over K terms on both
sums. The first launch stores, per row, hi_i = a_i + e_i (e_i that bound, widened for the rounding of e itself) and
keeps T, the second largest lo_i = a_i - e_i (two atomic maxima). The second launch's programs each scan a span of
the hi, list the rows whose hi, rounded to the logits' dtype, is not below T so rounded, compute them as
``head_pick`` does (gemv's ``row_dots`` on the same tile shape: the same bits) and pick among them. Every row left out
has a rounded logit below two listed rows' (rounding is monotone), so the pick, the lowest index among equal maxima,
and the runner-up are the full projection's. A NaN row is always listed. Why: at batch 1 the projection is the
step's largest single read after the experts (419 MB in bf16 for DeepSeek-V2-Lite), and the pick needs only its top
two (docs/decode-log.md v34).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _count, argmax, gemv, pdl
from ._admit import interpreting

ROWS = 8  # vocabulary rows a program
NUM_WARPS = 2
INTERPRETER_ROWS = 64  # the interpreter runs programs one by one: fewer, taller ones
GROUP = 256  # programs whose triples one program merges; then the groups' in one
MAX_BATCH = 1  # at batch 8 cuBLAS reads the weights once for every row, which one program a row-block cannot
SCREEN = True  # the batch-1 step without logits picks through the screen (False: head_pick's one launch)
SCREEN_ROWS = 8  # int8 rows a program of the screen
SCREEN_WARPS = 2  # kernels.bench --head --variants on an H100: 8 rows in 2 warps the fastest of five
CHECKERS = 128  # programs of the second launch, each scanning a span of the rows' hi (V = 102,400: one scan)
SCAN = 1024  # hi a checking program scans at once
INTERPRETER_CHECKERS = 4
QUANT_CHUNK = 8192  # rows quantized at once (fp64: 128 MiB at K = 2048)


@triton.jit
def _head_kernel(x, w, logits, part, counts, ids, margins, nxt, lengths, V, stride_w, NB: tl.constexpr,
                 NG: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 PDL: tl.constexpr):
    j = tl.program_id(0)
    rows = j * ROWS + tl.arange(0, ROWS)
    live = rows < V
    w0 = gemv.first_slice(w, rows, live, stride_w, K, BLOCK_K)
    pdl.wait(PDL)  # x, the outputs and the scratch may be the previous kernel's
    v = gemv.row_dots(x, w, w0, rows, live, stride_w, K, ROWS, BLOCK_K).to(logits.dtype.element_ty)
    tl.store(logits + rows, v, mask=live)
    best, second, first = argmax.block_best(tl.where(live, v.to(tl.float32), float("-inf")), rows, live, V)
    argmax.store_best(part + j * 3, best, second, first)
    g = j // GROUP
    n = tl.minimum(NB - g * GROUP, GROUP)
    if _count.last_to_arrive(counts + 1 + g, n):
        g_best, g_second, g_first = argmax.merge_blocks(part + g * GROUP * 3, n, GROUP, GROUP)
        argmax.store_best(part + (NB + g) * 3, g_best, g_second, g_first)
        _count.reset(counts + 1 + g)
        if _count.last_to_arrive(counts, NG):
            top, runner, pick = argmax.merge_blocks(part + NB * 3, NG, NG, GROUP)
            argmax.store_pick(ids, margins, 0, top, runner, pick)
            tl.store(nxt, pick.to(tl.int64))
            tl.store(lengths, tl.load(lengths) + 1)
            _count.reset(counts)


def _rows() -> int:
    return INTERPRETER_ROWS if interpreting() else ROWS


def counts_for(V: int) -> int:
    """The int32 counts a launch over V vocabulary rows needs: one, and one a group (as many as one row a program
    makes, so that any ROWS fits)."""
    return 1 + triton.cdiv(V, GROUP)


def head_reason(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, nxt: torch.Tensor,
                lengths: torch.Tensor) -> str | None:
    """Admission predicate: None admits, else why the call takes its fallback."""
    if reason := _rows_reason(x, w, nxt, lengths):
        return reason
    if counts.dtype != torch.int32 or counts.numel() < counts_for(w.shape[0]):
        return f"counts must be int32 with at least {counts_for(w.shape[0])} zeros, got {counts.numel()}"
    return None


def _rows_reason(x: torch.Tensor, w: torch.Tensor, nxt: torch.Tensor, lengths: torch.Tensor) -> str | None:
    if x.dim() != 2 or x.shape[0] > MAX_BATCH:
        return f"x {tuple(x.shape)}: the kernel takes at most {MAX_BATCH} row(s)"
    reason = gemv.gemv_reason(x[0], w)
    if reason:
        return reason
    if reason := argmax.vocab_reason(w.shape[0]):
        return reason
    if nxt.dtype != torch.int64 or lengths.dtype != torch.int64 or nxt.numel() < 1 or lengths.numel() < 1:
        return "nxt and lengths must be int64 with a row each"
    return None


def head_pick(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, nxt: torch.Tensor, lengths: torch.Tensor,
              fallback):
    """(logits [1, V], ids int64 [1], margins fp32 [1]) of x [1, K] against w [V, K] in one launch, which also writes
    the pick to nxt[0] and adds one to lengths[0]; ``fallback()`` where the kernel does not admit the inputs."""
    if head_reason(x, w, counts, nxt, lengths):
        return fallback()
    logits = torch.empty(1, w.shape[0], dtype=x.dtype, device=x.device)
    ids = torch.empty(1, dtype=torch.int64, device=x.device)
    margins = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(x, w, logits, ids, margins, counts, nxt, lengths)
    return logits, ids, margins


def _launch(x, w, logits, ids, margins, counts, nxt, lengths):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    V, K = w.shape
    rows = _rows()
    nb = triton.cdiv(V, rows)
    ng = triton.cdiv(nb, GROUP)
    part = torch.empty((nb + ng) * 3, dtype=torch.float32, device=x.device)
    return _head_kernel[(nb,)](x, w, logits, part, counts, ids, margins, nxt, lengths, V, w.stride(0), NB=nb, NG=ng,
                               K=K, ROWS=rows, BLOCK_K=min(gemv.BLOCK_K, triton.next_power_of_2(K)), GROUP=GROUP,
                               num_warps=NUM_WARPS, **pdl.flags(x.device))


@dataclass
class VocabScreen:
    """W's screen (``screen_of``) and the two launches' scratch, reused by every step (one stream)."""
    q: torch.Tensor  # uint8 [V, K]: q + 128, q in -127..127
    scale: torch.Tensor  # fp32 [V]: row i is about scale_i * q_i
    bound: torch.Tensor  # fp32 [V]: c_i
    state: torch.Tensor  # fp32 [2]: the largest lo and T so far, -inf between launches
    count: torch.Tensor  # int32 [1]: the second launch's arrivals, zero between launches
    hi: torch.Tensor  # fp32 [V]: each row's hi
    listed: torch.Tensor  # int32 [V]: each checking program's rows to check, in its own span
    part: torch.Tensor  # fp32 [CHECKERS * 3]: each checking program's triple


def summation_bound(K: int) -> float:
    """A relative bound on fp32 sums of K products (Higham's gamma_K at unit roundoff 2**-24, for the products'
    own rounding too), widened 10%."""
    return 1.1 * (K + 2) * 2.0 ** -24


def screen_of(w: torch.Tensor) -> VocabScreen | None:
    """W [V, K]'s int8 screen on W's device, or None where W holds a non-finite value (no scale bounds it) or K is not
    a multiple of 4 (the screen reads its bytes four at a time)."""
    if w.shape[1] % 4 or not bool(torch.isfinite(w).all()):
        return None
    V, K = w.shape
    dev = w.device
    q = torch.empty(V, K, dtype=torch.uint8, device=dev)
    scale, bound = (torch.empty(V, dtype=torch.float32, device=dev) for _ in range(2))
    g = summation_bound(K)
    for r0 in range(0, V, QUANT_CHUNK):
        wf = w[r0:r0 + QUANT_CHUNK].double()
        s = (wf.abs().amax(1) / 127).float()  # the stored scale, then used as stored
        sd = s.double()[:, None]
        qq = torch.where(sd > 0, torch.round(wf / sd.clamp_min(1e-300)), 0).clamp(-127, 127)
        d = (wf - sd * qq).norm(dim=1)
        # the residual; head_pick's sum's rounding; the screen's: its sum of u x (u = q + 128), then 128 times x's sum
        c = d + g * (wf.norm(dim=1) + sd[:, 0] * ((qq + 128).norm(dim=1) + 128 * K ** 0.5))
        q[r0:r0 + QUANT_CHUNK] = (qq + 128).to(torch.uint8)
        scale[r0:r0 + QUANT_CHUNK] = s
        bound[r0:r0 + QUANT_CHUNK] = torch.nextafter(c.float(), torch.tensor(float("inf"), device=dev))
    return VocabScreen(q, scale, bound, torch.full((2,), float("-inf"), device=dev),
                  torch.zeros(1, dtype=torch.int32, device=dev), torch.empty(V, dtype=torch.float32, device=dev),
                  torch.empty(V, dtype=torch.int32, device=dev), torch.empty(CHECKERS * 3, device=dev))


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """v in fp32 rounded to the logits' dtype and back: monotone, as the logits' own rounding."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _word_floats(words, ASM: tl.constexpr):
    """int32 words of 4 bytes u (little-endian) -> 4 fp32 tensors 2**23 + u, byte 0 first: each byte put under the
    bits of 2**23, one PRMT an element on a GPU. A conversion from an integer runs at a quarter rate on sm_90, and
    Triton's own extraction of bytes took about four instructions an element: either left the screen
    compute-bound, no faster than head_pick's read of twice the bytes (docs/decode-log.md v34)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $4, 0x4B000000, 0x7540; prmt.b32 $1, $4, 0x4B000000, 0x7541;"
            "prmt.b32 $2, $4, 0x4B000000, 0x7542; prmt.b32 $3, $4, 0x4B000000, 0x7543;",
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return (((words >> 0) & 0xFF | 0x4B000000).to(tl.float32, bitcast=True),
            ((words >> 8) & 0xFF | 0x4B000000).to(tl.float32, bitcast=True),
            ((words >> 16) & 0xFF | 0x4B000000).to(tl.float32, bitcast=True),
            ((words >> 24) & 0xFF | 0x4B000000).to(tl.float32, bitcast=True))


@triton.jit
def _screen_dots(x, q, q0, rows, live, stride_q, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr):
    """(fp32 dots of the screen's bytes u = q + 128 with x, the sum of x, the sum of its squares). q is read as int32
    words (stride_q in words), 4 bytes each; u x is exact in fp32 (8 bits by 8), summed in a fixed order."""
    words = tl.arange(0, BLOCK_K // 4)
    acc = tl.zeros([ROWS], dtype=tl.float32)
    sx = tl.zeros([], dtype=tl.float32)
    xx = tl.zeros([], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ww = k0 // 4 + words
        inside = ww < K // 4
        if k0 == 0:
            qw = q0
        else:
            qw = tl.load(q + rows[:, None] * stride_q + ww[None, :], mask=live[:, None] & inside[None, :], other=0)
        f0, f1, f2, f3 = _word_floats(qw, ASM)
        x0 = tl.load(x + 4 * ww, mask=inside, other=0.0).to(tl.float32)
        x1 = tl.load(x + 4 * ww + 1, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(x + 4 * ww + 2, mask=inside, other=0.0).to(tl.float32)
        x3 = tl.load(x + 4 * ww + 3, mask=inside, other=0.0).to(tl.float32)
        acc += tl.sum((f0 - 8388608.0) * x0[None, :] + (f1 - 8388608.0) * x1[None, :]
                      + (f2 - 8388608.0) * x2[None, :] + (f3 - 8388608.0) * x3[None, :], axis=1)
        sx += tl.sum(x0 + x1 + x2 + x3, axis=0)
        xx += tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3, axis=0)
    return acc, sx, xx


@triton.jit
def _screen_kernel(x, q, scale, bound, state, his, V, stride_q, G, K: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    lanes = tl.arange(0, ROWS)
    rows = j * ROWS + lanes
    live = rows < V
    words = tl.arange(0, BLOCK_K // 4)
    q0 = tl.load(q + rows[:, None] * stride_q + words[None, :], mask=live[:, None] & (words < K // 4)[None, :],
                 other=0)
    s = tl.load(scale + rows, mask=live, other=0.0)
    c = tl.load(bound + rows, mask=live, other=0.0)
    pdl.wait(PDL)
    dots, sx, xx = _screen_dots(x, q, q0, rows, live, stride_q, K, ROWS, BLOCK_K, ASM)
    a = (dots - 128 * sx) * s
    # e's own rounding: a relative 2**-20 of e and 2**-22 of |a| cover fp32's few roundings here
    e = (tl.sqrt(xx) * (1 + 2 * G) * c) * (1 + 2.0 ** -20) + tl.abs(a) * 2.0 ** -22 + 1e-30
    lo = tl.where(live & (a == a), a - e, float("-inf"))  # a NaN row bounds nothing (its hi is NaN: listed)
    hi = a + e
    m1 = tl.max(lo, axis=0)
    m2 = tl.max(tl.where(lanes == tl.min(tl.where(lo == m1, lanes, ROWS), axis=0), float("-inf"), lo), axis=0)
    top = tl.load(state, volatile=True)
    t = tl.load(state + 1, volatile=True)
    if m1 > t:  # only then can this block raise T: the others skip the atomics
        # T is never above the second largest lo: a block's own second, or its best against the best of the blocks
        # before (read before this block's is added, so never its own). No atomic's returned value is used: with
        # them, some threads of this kernel wrote out of bounds on sm_90 (Triton 3.6, compute-sanitizer).
        mine = tl.maximum(m2, tl.minimum(m1, top))
        tl.atomic_max(state, m1)
        tl.atomic_max(state + 1, mine)
    tl.store(his + rows, hi, mask=live)


@triton.jit
def _check_rows(x, w, listed, at, n, top, second, first, V, stride_w, K: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The listed rows at ``at`` (those below n), computed as ``head_pick`` does, merged into the running triple."""
    live = at < n
    rows = tl.load(listed + at, mask=live, other=0)
    w0 = gemv.first_slice(w, rows, live, stride_w, K, BLOCK_K)
    v = gemv.row_dots(x, w, w0, rows, live, stride_w, K, ROWS, BLOCK_K).to(x.dtype.element_ty).to(tl.float32)
    b, s, f = argmax.block_best(tl.where(live, v, float("-inf")), rows, live, V)
    return argmax.merge_pair(top, second, first, b, s, f)


@triton.jit
def _check_kernel(x, w, state, count, his, listed, part, ids, margins, nxt, lengths, V, stride_w,
                  SPAN: tl.constexpr, SCAN: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_K: tl.constexpr, P: tl.constexpr, DYNAMIC: tl.constexpr, PDL: tl.constexpr):
    """Program p scans rows [p SPAN, (p + 1) SPAN) SCAN at a time, lists those whose hi T admits in its own span of
    ``listed``, and computes them ROWS at a time; the last program to finish merges the programs' triples."""
    p = tl.program_id(0)
    pdl.wait(PDL)  # the screen's his and T
    dtype: tl.constexpr = x.dtype.element_ty
    t = _rounded(tl.load(state + 1, volatile=True), dtype)
    lanes = tl.arange(0, ROWS)
    scan = tl.arange(0, SCAN)
    top = tl.full([], float("-inf"), tl.float32)
    second = tl.full([], float("-inf"), tl.float32)
    first = tl.full([], V, tl.int32)
    mine = listed + p * SPAN
    for s0 in tl.static_range(0, SPAN, SCAN):
        rows = p * SPAN + s0 + scan
        inside = (rows < V) & (s0 + scan < SPAN)
        hi = tl.load(his + rows, mask=inside, other=float("-inf"))
        keep = inside & ~(_rounded(hi, dtype) < t)  # a NaN hi is kept
        k32 = keep.to(tl.int32)
        n = tl.sum(k32, axis=0)
        tl.store(mine + tl.cumsum(k32, axis=0) - 1, rows, mask=keep)
        tl.debug_barrier()  # the program's own stores, read back by its other threads
        if DYNAMIC:
            for c0 in range(0, n, ROWS):
                top, second, first = _check_rows(x, w, mine, c0 + lanes, n, top, second, first, V, stride_w, K,
                                                 ROWS, BLOCK_K)
        else:  # the interpreter takes a loop bound from the constants only
            for c0 in range(0, SCAN, ROWS):
                top, second, first = _check_rows(x, w, mine, c0 + lanes, n, top, second, first, V, stride_w, K,
                                                 ROWS, BLOCK_K)
        tl.debug_barrier()  # read before the next scan's stores
    argmax.store_best(part + p * 3, top, second, first)
    if _count.last_to_arrive(count, P):
        best, runner, pick = argmax.merge_blocks(part, P, P, P)
        argmax.store_pick(ids, margins, 0, best, runner, pick)
        tl.store(nxt, pick.to(tl.int64))
        tl.store(lengths, tl.load(lengths) + 1)
        tl.store(state, float("-inf"))
        tl.store(state + 1, float("-inf"))
        _count.reset(count)


def screen_reason(x: torch.Tensor, w: torch.Tensor, screen: VocabScreen | None, nxt: torch.Tensor,
                  lengths: torch.Tensor) -> str | None:
    """Admission predicate of ``head_pick_screened``: None admits, else why the call takes its fallback."""
    if screen is None:
        return "no screen (W holds a non-finite value, or K is not a multiple of 4)"
    if screen.q.shape != w.shape or screen.q.device != w.device:
        return f"the screen is of a {tuple(screen.q.shape)} weight, not this {tuple(w.shape)} one"
    if w.shape[1] % 4:
        return f"K={w.shape[1]}: the screen reads its bytes four at a time"
    return _rows_reason(x, w, nxt, lengths)


def head_pick_screened(x: torch.Tensor, w: torch.Tensor, screen: VocabScreen | None, nxt: torch.Tensor,
                       lengths: torch.Tensor, fallback):
    """(ids int64 [1], margins fp32 [1]) of x [1, K] against w [V, K], ``head_pick``'s bit for bit, in two launches
    through W's screen; they also write the pick to nxt[0] and add one to lengths[0]. ``fallback()`` where they do
    not admit the inputs."""
    if screen_reason(x, w, screen, nxt, lengths):
        return fallback()
    ids = torch.empty(1, dtype=torch.int64, device=x.device)
    margins = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch_screened(x, w, screen, ids, margins, nxt, lengths)
    return ids, margins


def _launch_screened(x, w, screen: VocabScreen, ids, margins, nxt, lengths):
    """The two launches; returns Triton's two compiled kernels (None under the interpreter)."""
    V, K = w.shape
    rows = _rows()
    block_k = min(gemv.BLOCK_K, triton.next_power_of_2(K))
    screen_rows = INTERPRETER_ROWS if interpreting() else SCREEN_ROWS
    first = _screen_kernel[(triton.cdiv(V, screen_rows),)](
        x, screen.q.view(torch.int32), screen.scale, screen.bound, screen.state, screen.hi, V, screen.q.stride(0) // 4,
        summation_bound(K), K=K, ROWS=screen_rows, BLOCK_K=block_k, ASM=not interpreting(), num_warps=SCREEN_WARPS,
        **pdl.flags(x.device))
    checkers = INTERPRETER_CHECKERS if interpreting() else CHECKERS
    span = triton.cdiv(triton.cdiv(V, checkers), rows) * rows
    second = _check_kernel[(checkers,)](
        x, w, screen.state, screen.count, screen.hi, screen.listed, screen.part, ids, margins, nxt, lengths, V,
        w.stride(0), SPAN=span, SCAN=min(SCAN, triton.next_power_of_2(span)), K=K, ROWS=rows, BLOCK_K=block_k,
        P=checkers, DYNAMIC=not interpreting(), num_warps=NUM_WARPS, **pdl.flags(x.device))
    return first, second


__all__ = ["head_pick", "head_reason", "counts_for", "VocabScreen", "screen_of", "head_pick_screened", "screen_reason"]
