"""Routed experts of a MoE layer at decode: experts_gate_up, experts_down, moe_experts, for CUDA-graph capture.

B tokens, each with k expert ids (ids [B, k] int64; -1 marks a pair computed on another rank); MAX_B at decode, up to
MAX_PAIRS pairs B x k in a prefill (the tensor-core kernel's contract does not depend on B):
- ``experts_gate_up(x [B, D], w13 [E, 2I, D], ids)`` -> h [B, k, I] in x's dtype: silu(gate) * up, fp32 inside;
- ``experts_down(h, w2 [E, D, I], ids)`` -> y [B, k, D] fp32, 0.0 for a -1 pair;
- ``moe_experts(x, w13, w2, ids, weights [B, k])`` -> [B, D] fp32: the slots' weighted sum, s ascending;
- ``route(ids)``: the pairs sorted by expert on the device, to pass as ``route=`` to both kernels (None at B = 1).
Inputs and weights share one dtype (fp16/bf16/fp32); ids must lie in [-1, E) (the device cannot check it).
Inadmissible inputs (``moe_reason`` / ``gate_up_reason`` / ``down_reason``) take the torch path, which computes
the same maths; wrong shapes raise ValueError. Kernels, numerics, measurements: kernels/KERNELS.md, section
"Routed experts (`moe.py`)".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from ._admit import device_reason, dtype_reason, interpreting
from ._mma import mma

MAX_B = 16  # tokens per call at decode: the route kernel's (kernels/route.py) and the graph step's batches
# B >= 2 takes a program a sorted pair in the grid's second dimension (CUDA allows 65,535 there): a prefill's B x k
MAX_PAIRS = 65535
# B = 1: weight rows per one-warp program (for experts_gate_up a gate row with its up row, BLOCK_N; for
# experts_down, DOWN_BLOCK_N). One row (gemv.py's finding at K=2048..4096) for gate/up; two for down (K=1408,
# 16,384 programs a call with one): the decode step at batch 1 on an H200 2.38 -> 2.17 ms (docs/decode-log.md v8).
BLOCK_N = 1
DOWN_BLOCK_N = 2
BLOCK_K = 512
NUM_WARPS = 1
MAX_K = 16384  # the one-row kernel's K loop is unrolled at compile time
# B >= 2: tensor-core tiles of G tokens (tl.dot's smallest tile side is 16) against DOT_BLOCK_N weight rows
# (experts_gate_up: that many gate rows and as many up rows). Untuned: python -m evident.kernels.moe_bench --variants.
# None of these may depend on B or on the routing (identical rows must stay bitwise identical).
G = 16
DOT_BLOCK_N = 64
DOT_DOWN_BLOCK_N = 64
DOT_BLOCK_K = 128
DOT_WARPS = 4
DOT_STAGES = 3  # the K loop's software pipeline: weight tiles in flight per program
# The interpreter runs programs one by one in Python: taller blocks give the same results with far fewer
# programs.
INTERPRETER_BLOCK_N = 1024
# B = 1 in the graph step (experts_down's ``early``): down's programs go on over the slots whose h gate_up has
# written, instead of waiting for gate_up's end (docs/decode-log.md v28). False: the A/B switch of the decode probe.
EARLY_DOWN = True
BLOCK_D = 1024  # the weighted sum over slots: D columns per program
COMBINE_WARPS = 4


def sentinel(dtype: torch.dtype) -> int:
    """h's "not written yet" bits in dtype's width: a NaN with a payload (0xFFA5, 0xFFA5A5A5) that no arithmetic or
    conversion makes (a computed NaN is canonical). Were gate_up to write it, down would only wait for gate_up's end."""
    return {2: -0x5B, 4: -0x5A5A5B}[dtype.itemsize]


@triton.jit
def _clamp(gate, up, LIMIT: tl.constexpr):
    """The swiglu clamp (DeepSeek-V4): gate at most LIMIT, up within +-LIMIT; LIMIT 0: none."""
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate, up


@triton.jit
def _bits(v):
    """v's bits as an integer of its width (16 or 32)."""
    return v.to(tl.int16, bitcast=True) if v.dtype.primitive_bitwidth == 16 else v.to(tl.int32, bitcast=True)


@triton.jit
def _row_kernel(inp, w, out, keys, order, ready, e_shared, DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                GATED: tl.constexpr, SORTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                LIMIT: tl.constexpr, SHARED: tl.constexpr, EARLY: tl.constexpr, SENT: tl.constexpr,
                PDL: tl.constexpr):
    """B = 1. Program (n, j): weight rows n*BLOCK_N.. of pair p's expert against p's input row; p = j, or
    order[j] if the pairs come sorted (keys are then the sorted ids). With SHARED, the last SHARED slots hold experts
    e_shared.. (fixed: no id read) and their programs come first in the grid and start once ``ready`` says the
    input is published (``pdl.wait_or_acquire``), not after the previous launch's end. With EARLY (down after such
    a gate_up, whose h was filled with SENT by the router's launch): the shared slots first too, and no wait on
    gate_up unless a slice of h still holds SENT; a value that is not SENT is gate_up's, written once a step."""
    j = tl.program_id(1)
    first_shared = tl.num_programs(1) - SHARED
    fixed = False
    if SHARED > 0:
        j = (j + first_shared) % tl.num_programs(1)
        fixed = j >= first_shared
    if EARLY:  # down: the router and gate_up's start are behind this launch; h's rows are checked below
        pdl.launch_dependents(PDL)
        e = tl.load(keys + j, cache_modifier=".cg")
    elif fixed:  # a shared expert's slot: what it reads is x only, published before the router's end
        pdl.wait_or_acquire(ready, PDL)
        e = (e_shared + j - first_shared).to(tl.int64)
    else:
        pdl.wait(PDL)  # which weights to read is the router's output
        e = tl.load(keys + j)
    p = tl.load(order + j) if SORTED else j.to(tl.int64)  # the flat pair index b*k + s: where the result goes
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rlive = rows < N
    if e < 0:  # computed on another device: no weights read; y's row is 0, h's left as it is
        if not GATED:
            tl.store(out + p * N + rows, tl.zeros([BLOCK_N], dtype=tl.float32), mask=rlive)
        return
    w_e = w + e * ((2 * N if GATED else N) * K)
    src = p // DIV  # the input row: token b for gate/up (DIV = k), the pair's own h row for down (DIV = 1)
    cols = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)  # gate rows (or down rows)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)  # up rows
    for k0 in tl.static_range(0, K, BLOCK_K):  # fixed ascending order over K slices
        kk = k0 + cols
        kin = kk < K
        wmask = rlive[:, None] & kin[None, :]
        # evict_first: read once a step, the experts' bytes should not push out of L2 what was asked to stay there
        # (the next layer's projections, kernels/_l2.py)
        if EARLY:  # the weights first; h's slice from L2, where a SENT left means gate_up has not written it yet
            wa = tl.load(w_e + rows[:, None] * K + kk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
            xk = tl.load(inp + src * K + kk, mask=kin, other=0.0, cache_modifier=".cg")
            if tl.max((_bits(xk) == SENT).to(tl.int32), axis=0) != 0:
                pdl.wait_only(PDL)  # gate_up's end
                xk = tl.load(inp + src * K + kk, mask=kin, other=0.0, cache_modifier=".cg")
        else:
            xk = tl.load(inp + src * K + kk, mask=kin, other=0.0)
            wa = tl.load(w_e + rows[:, None] * K + kk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        acc_a += tl.sum(wa.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        if GATED:
            wb = tl.load(w_e + (rows + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            acc_b += tl.sum(wb * xk[None, :], axis=1)
    if GATED:
        acc_a, acc_b = _clamp(acc_a, acc_b, LIMIT)
        tl.store(out + p * N + rows, (acc_a * tl.sigmoid(acc_a) * acc_b).to(out.dtype.element_ty), mask=rlive)
    else:
        tl.store(out + p * N + rows, acc_a, mask=rlive)


@triton.jit
def _dot_kernel(inp, w, out, sorted_ids, order, n_pairs, DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                GATED: tl.constexpr, G: tl.constexpr, LOG_NP: tl.constexpr, F32: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, LIMIT: tl.constexpr, PDL: tl.constexpr):
    """B >= 2. Program (n, j): weight rows n*BLOCK_N.. of sorted pair j's expert against the inputs of the up to
    G pairs from j on that chose it, if j leads them (it starts its group, or lies a multiple of G past the
    start); else nothing."""
    pdl.wait(PDL)
    j = tl.program_id(1)
    e = tl.load(sorted_ids + j)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rlive = rows < N
    if e < 0:  # computed on another device: no weights read; y's row is 0, h's left as it is
        if not GATED:
            tl.store(out + tl.load(order + j) * N + rows, tl.zeros([BLOCK_N], dtype=tl.float32), mask=rlive)
        return
    first = tl.load(sorted_ids + j - 1, mask=j > 0, other=-2) != e
    deep = tl.load(sorted_ids + j - G, mask=j >= G, other=-2) == e  # more than G pairs of the group up to j
    start = j
    if deep:  # only then can j be a later leader: find the group's start, the first sorted pair of e (binary search
        # over [0, j]: LOG_NP halvings, any B; a scan of every pair, as before, held NP ids a program)
        lo = j * 0
        hi = j
        for _ in tl.static_range(LOG_NP):
            mid = (lo + hi) // 2
            below = tl.load(sorted_ids + mid) < e
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        start = lo
    if (first | (deep & ((j - start) % G == 0))) == 0:
        return  # another program does this pair's work
    idx = j + tl.arange(0, G)
    live = (idx < n_pairs) & (tl.load(sorted_ids + idx, mask=idx < n_pairs, other=-2) == e)
    pair = tl.load(order + idx, mask=live, other=0)  # the flat b*k + s index: where the result goes
    src = pair // DIV  # the input row: token b for gate/up (DIV = k), the pair's own h row for down (DIV = 1)
    w_e = w + e * ((2 * N if GATED else N) * K)
    cols = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK_N, G], dtype=tl.float32)  # gate rows (or down rows) x tokens
    acc_b = tl.zeros([BLOCK_N, G], dtype=tl.float32)  # up rows x tokens
    for k0 in range(0, K, BLOCK_K):  # ascending K slices, pipelined (num_stages)
        kk = k0 + cols
        kin = kk < K
        xt = tl.load(inp + src[:, None] * K + kk[None, :], mask=live[:, None] & kin[None, :], other=0.0)
        wmask = rlive[:, None] & kin[None, :]
        wa = tl.load(w_e + rows[:, None] * K + kk[None, :], mask=wmask, other=0.0)
        acc_a = mma(wa, xt, acc_a, F32)
        if GATED:
            wb = tl.load(w_e + (rows + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc_b = mma(wb, xt, acc_b, F32)
    dst = out + pair[None, :] * N + rows[:, None]
    smask = rlive[:, None] & live[None, :]
    if GATED:
        acc_a, acc_b = _clamp(acc_a, acc_b, LIMIT)
        tl.store(dst, (acc_a * tl.sigmoid(acc_a) * acc_b).to(out.dtype.element_ty), mask=smask)
    else:
        tl.store(dst, acc_a, mask=smask)


@triton.jit
def _combine_kernel(y, wts, out, D: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[b] = sum over s ascending of wts[b, s] * y[b, s] (launched without FMA contraction: each product is
    rounded before it is added, as in the torch path)."""
    pdl.wait(PDL)
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        acc = acc + tl.load(wts + b * SLOTS + s).to(tl.float32) * tl.load(y + (b * SLOTS + s) * D + d, mask=live)
    tl.store(out + b * D + d, acc, mask=live)


# ---- torch path: the reference and the fallback -------------------------------------------------------------

def _gate_up_torch(x, w13, ids, limit: float = 0.0):
    inter = w13.shape[1] // 2
    here = ids >= 0  # -1: computed elsewhere; its row is set to 0 here
    gu = (w13[ids.clamp(min=0)].float() @ x.float()[:, None, :, None])[..., 0]  # [B, k, 2I], weights per pair
    g, u = gu[..., :inter], gu[..., inter:]
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return torch.where(here[..., None], torch.nn.functional.silu(g) * u, 0.0).to(x.dtype)


def _down_torch(h, w2, ids):
    y = (w2[ids.clamp(min=0)].float() @ h.float()[..., None])[..., 0]
    return torch.where((ids >= 0)[..., None], y, 0.0)  # where, not a product: h's rows of -1 pairs may be NaN


def _combine_torch(y, weights):
    out = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for s in range(y.shape[1]):  # ascending slots
        out = out + weights[:, s, None].float() * y[:, s]
    return out


def moe_reference(x, w13, w2, ids, weights, limit: float = 0.0):
    """The plain torch reference: out [B, D] fp32, the same maths as moe_experts."""
    _check_moe(x, w13, w2, ids, weights)
    return _combine_torch(_down_torch(_gate_up_torch(x, w13, ids, limit), w2, ids), weights)


# ---- shapes (errors) and admission (fallbacks) --------------------------------------------------------------

def _check_ids(ids, rows=None):
    if ids.dim() != 2 or rows not in (None, ids.shape[0]) or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise ValueError(f"expected integer ids [B{'' if rows is None else f'={rows}'}, k], got {tuple(ids.shape)} "
                         f"{ids.dtype}")


def _check_route(route, ids):
    if route is None:
        return
    if len(route) != 2 or any(t.shape != (ids.numel(),) for t in route):
        raise ValueError(f"expected route (sorted_ids, order) of {ids.numel()} pairs each, as route(ids) gives")


def _check_gate_up(x, w13, ids):
    if x.dim() != 2 or w13.dim() != 3 or w13.shape[2] != x.shape[1] or w13.shape[1] % 2:
        raise ValueError(f"expected x [B, D] and w13 [E, 2I, D], got x {tuple(x.shape)} and w13 {tuple(w13.shape)}")
    _check_ids(ids, x.shape[0])


def _check_down(h, w2, ids):
    if h.dim() != 3 or w2.dim() != 3 or w2.shape[2] != h.shape[2]:
        raise ValueError(f"expected h [B, k, I] and w2 [E, D, I], got h {tuple(h.shape)} and w2 {tuple(w2.shape)}")
    _check_ids(ids, h.shape[0])
    if ids.shape[1] != h.shape[1]:
        raise ValueError(f"ids {tuple(ids.shape)} do not match h {tuple(h.shape)}")


def _check_moe(x, w13, w2, ids, weights=None):
    _check_gate_up(x, w13, ids)
    if w2.dim() != 3 or tuple(w2.shape) != (w13.shape[0], x.shape[1], w13.shape[1] // 2):
        want = (w13.shape[0], x.shape[1], w13.shape[1] // 2)
        raise ValueError(f"expected w2 [E, D, I] = {want}, got {tuple(w2.shape)}")
    if weights is not None and tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"expected weights {tuple(ids.shape)}, got {tuple(weights.shape)}")


def _reason(inp, w, ids, k_dim: int) -> str | None:
    B, k = ids.shape
    checks = [device_reason(inp, w, ids), dtype_reason("w", w.dtype)]
    if inp.dtype != w.dtype:
        checks.append(f"input dtype {inp.dtype} differs from weight dtype {w.dtype}")
    if ids.dtype != torch.int64:
        checks.append(f"ids dtype {ids.dtype} is not int64")
    if not (inp.is_contiguous() and w.is_contiguous() and ids.is_contiguous()):
        checks.append("inputs, weights and ids must be contiguous")
    if B == 0 or k == 0 or B * k > MAX_PAIRS:
        checks.append(f"B={B} rows of {k} slots: none, or more than {MAX_PAIRS} pairs")
    if not 1 <= k_dim <= MAX_K or w.shape[0] == 0 or w.shape[1] == 0:
        checks.append(f"K={k_dim} outside 1..{MAX_K}, or no experts or rows")
    if w.shape[1] * w.shape[2] >= 2**31:
        checks.append("an expert too large for 32-bit offsets")
    return next((c for c in checks if c), None)


def gate_up_reason(x, w13, ids) -> str | None:
    """Admission predicate of experts_gate_up: None admits, else why it takes the torch path."""
    _check_gate_up(x, w13, ids)
    return _reason(x, w13, ids, x.shape[1])


def down_reason(h, w2, ids) -> str | None:
    """Admission predicate of experts_down."""
    _check_down(h, w2, ids)
    return _reason(h, w2, ids, h.shape[2])


def moe_reason(x, w13, w2, ids, weights=None) -> str | None:
    """Admission predicate of moe_experts: both kernels (experts_down's input is the contiguous h in x's dtype
    that experts_gate_up makes, so x stands for it) and, if given, weights on the same device."""
    _check_moe(x, w13, w2, ids, weights)
    reasons = [gate_up_reason(x, w13, ids), _reason(x, w2, ids, w2.shape[2]),
               None if weights is None else device_reason(x, weights)]
    return next((r for r in reasons if r), None)


# ---- launches -----------------------------------------------------------------------------------------------

@triton.jit
def _rank_kernel(ids, sorted_ids, order, n, NP: tl.constexpr, PDL: tl.constexpr):
    """A stable sort of n <= NP ids in one program: each id's place is the count of ids before it (smaller, or
    equal and earlier). torch.sort's radix sort costs ~6.5 µs a call on an H200 for these few ids."""
    pdl.wait(PDL)
    i = tl.arange(0, NP)
    live = i < n
    v = tl.load(ids + i, mask=live, other=0)
    before = (v[None, :] < v[:, None]) | ((v[None, :] == v[:, None]) & (i[None, :] < i[:, None]))
    place = tl.sum((before & live[None, :]).to(tl.int32), axis=1)
    tl.store(sorted_ids + place, v, mask=live)
    tl.store(order + place, i.to(tl.int64), mask=live)


MAX_RANK = 1024  # ids sorted by _rank_kernel (B*k pairs); more go through torch.sort


def _route(ids):
    """The B*k (token, slot) pairs of ids [B, k] sorted by expert on the device, stable (-1 first): (sorted ids,
    flat pair indices b*k + s), int64 [B*k] each."""
    flat = ids.reshape(-1)
    if flat.numel() > MAX_RANK or flat.dtype != torch.int64 or device_reason(flat):
        return torch.sort(flat.long(), stable=True)
    sorted_ids, order = torch.empty_like(flat), torch.empty_like(flat)
    _rank_kernel[(1,)](flat, sorted_ids, order, flat.numel(), NP=triton.next_power_of_2(flat.numel()), num_warps=4,
                        **pdl.flags(flat.device))
    return sorted_ids, order


def route(ids):
    """What experts_gate_up and experts_down need to group the pairs of ids [B, k], computed once for both: at
    B >= 2 the pairs sorted by expert on the device, stable, -1 first: (sorted ids, flat pair indices b*k + s),
    int64 [B*k] each; at B = 1 None (the one-row kernel takes the pairs as they come: no launch)."""
    _check_ids(ids)
    return None if ids.shape[0] == 1 else _route(ids)


def _launch(inp, w, out, route, slots: int, gated: bool, ids=None, limit: float = 0.0, shared=None, early=0):
    """One launch of the experts kernel for out's B; returns Triton's compiled kernel (None under the
    interpreter). At B = 1 route may be None (ids then given): pairs in their own order; ``shared`` (ready, S): the
    last S slots are the last S experts of w, started early (``_row_kernel``)."""
    B = out.shape[0]
    N, K = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    if B == 1:
        keys, order = (ids.reshape(-1), None) if route is None else route
        block_n = min(INTERPRETER_BLOCK_N, triton.next_power_of_2(N)) if interpreting() else \
            (BLOCK_N if gated else DOWN_BLOCK_N)
        ready, n_shared = shared or (keys, 0)  # keys: unread without SHARED
        flags = pdl.flags(w.device)
        on = bool(early) and flags["PDL"]
        return _row_kernel[(triton.cdiv(N, block_n), keys.numel())](
            inp, w, out, keys, keys if order is None else order, ready, w.shape[0] - n_shared,
            DIV=slots if gated else 1, N=N, K=K, GATED=gated, SORTED=order is not None, BLOCK_N=block_n,
            BLOCK_K=min(BLOCK_K, triton.next_power_of_2(K)), LIMIT=float(limit),
            SHARED=early if on else n_shared, EARLY=on, SENT=sentinel(inp.dtype), num_warps=NUM_WARPS, **flags)
    sorted_ids, order = route
    n_pairs = sorted_ids.numel()
    block_n = INTERPRETER_BLOCK_N if interpreting() else (DOT_BLOCK_N if gated else DOT_DOWN_BLOCK_N)
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))  # tl.dot's tile sides are at least 16
    return _dot_kernel[(triton.cdiv(N, block_n), n_pairs)](
        inp, w, out, sorted_ids, order, n_pairs, DIV=slots if gated else 1, N=N, K=K, GATED=gated, G=G,
        LOG_NP=n_pairs.bit_length(), F32=interpreting() or w.dtype == torch.float32, BLOCK_N=block_n,
        BLOCK_K=min(DOT_BLOCK_K, max(16, triton.next_power_of_2(K))), LIMIT=float(limit), num_warps=DOT_WARPS,
        num_stages=DOT_STAGES, **pdl.flags(w.device))


def _route_for(ids, pairs):
    """The route a launch needs: none at B = 1, else the caller's or a fresh one."""
    if ids.shape[0] == 1:
        return None
    return _route(ids) if pairs is None else pairs


def gate_up_out(x, w13, slots: int) -> torch.Tensor:
    """h's buffer for ``experts_gate_up`` of x's rows, ``slots`` a row: its ``out=``, made before the router's launch
    when the shared slots start early."""
    return torch.empty(x.shape[0], slots, w13.shape[1] // 2, dtype=x.dtype, device=x.device)


def _gate_up(x, w13, ids, route, limit: float = 0.0, shared=None, out=None):
    h = gate_up_out(x, w13, ids.shape[1]) if out is None else out
    _launch(x, w13, h, route, ids.shape[1], True, ids, limit, shared)
    return h


def _down(h, w2, ids, route, early=0):
    y = torch.empty(*ids.shape, w2.shape[1], dtype=torch.float32, device=h.device)
    _launch(h, w2, y, route, ids.shape[1], False, ids, early=early)
    return y


def experts_gate_up(x, w13, ids, route=None, limit: float = 0.0, shared=None, out=None):
    """h [B, k, I] in x's dtype: silu(gate rows @ x[b]) * (up rows @ x[b]) of expert ids[b, s], fp32 inside; rows
    of -1 ids unspecified. route: route(ids) if the caller has it (sort once for both calls), else made here.
    limit > 0: the swiglu clamp first (gate at most limit, up within +-limit; DeepSeek-V4).
    shared (ready, S), B = 1: the caller's word that the last S slots of ids are w13's last S experts and that x
    comes from ``route.add_norm_route(..., ready=ready)``: those slots start when x is published, before the
    router's end. Their writes then overlap the router, so ``out`` (h's buffer) must be allocated before it."""
    _check_gate_up(x, w13, ids)
    _check_route(route, ids)
    if shared is not None and (out is None or not 0 < shared[1] <= ids.shape[1]):
        raise ValueError(f"shared slots need out= (allocated before the router) and 0 < S <= {ids.shape[1]}")
    if out is not None and (tuple(out.shape) != (*ids.shape, w13.shape[1] // 2) or out.dtype != x.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"expected out {(*ids.shape, w13.shape[1] // 2)} {x.dtype}, contiguous, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if gate_up_reason(x, w13, ids):
        h = _gate_up_torch(x, w13, ids, limit)
        return h if out is None else out.copy_(h)
    return _gate_up(x, w13, ids, _route_for(ids, route), limit, shared if ids.shape[0] == 1 else None, out)


def experts_down(h, w2, ids, route=None, early=0):
    """y [B, k, D] fp32: w2[ids[b, s]] @ h[b, s] with fp32 sums; 0.0 where ids[b, s] is -1.
    early=S, B = 1: the caller's word that h is ``out`` of experts_gate_up with ``shared`` S and that the router's
    launch filled it with sentinel(h.dtype) (``route.add_norm_route``'s h_reset). Under PDL each program then waits
    for gate_up's end only if its slice of h still holds the mark, the shared slots first in the grid; the same bits."""
    _check_down(h, w2, ids)
    _check_route(route, ids)
    if down_reason(h, w2, ids):
        return _down_torch(h, w2, ids)
    return _down(h, w2, ids, _route_for(ids, route), early)  # read at B = 1 only


def moe_experts(x, w13, w2, ids, weights, route=None, limit: float = 0.0):
    """out [B, D] fp32: the routed experts' outputs weighted by weights[b, s] (fp32), summed over ascending s;
    slots of -1 ids add weights[b, s] * 0. limit: as experts_gate_up's."""
    _check_route(route, ids)
    if moe_reason(x, w13, w2, ids, weights):
        return moe_reference(x, w13, w2, ids, weights, limit)
    route = _route_for(ids, route)  # sorted once for both kernels
    y = _down(_gate_up(x, w13, ids, route, limit), w2, ids, route)
    B, k, D = y.shape
    out = torch.empty(B, D, dtype=torch.float32, device=x.device)
    _combine_kernel[(B, triton.cdiv(D, BLOCK_D))](y, weights.float().contiguous(), out, D=D, SLOTS=k,
                                                  BLOCK_D=BLOCK_D, num_warps=COMBINE_WARPS, enable_fp_fusion=False,
                                                  **pdl.flags(x.device))
    return out


__all__ = ["MAX_B", "MAX_PAIRS", "route", "experts_gate_up", "gate_up_out", "experts_down", "moe_experts",
           "moe_reference", "moe_reason", "gate_up_reason", "down_reason"]
