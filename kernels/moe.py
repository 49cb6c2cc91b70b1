"""Routed experts of a MoE layer at decode: experts_gate_up, experts_down, moe_experts, for CUDA-graph capture.

For B tokens that each chose k distinct experts (ids [B, k]):

- ``experts_gate_up``: h[b, s] = silu(g) * u, g and u the gate and up rows of expert ids[b, s] against x[b]
  (w13 [E, 2I, D]: rows 0..I-1 gate_proj, I..2I-1 up_proj), fp32 sums, silu and product, cast once to x's dtype;
- ``experts_down``: y[b, s] = w2[ids[b, s]] @ h[b, s] in fp32 (w2 [E, D, I]);
- ``moe_experts``: out[b] = sum over s ascending of weights[b, s] * y[b, s], fp32.

Each expert's weights are read once per call however many tokens chose it, without the host: the B*k
(token, slot) pairs are sorted by expert on the device (stable, so a group's tokens come in ascending b), and a
fixed grid of (weight-row block, sorted pair) programs runs. The first pair of each group loads the group's
weight rows once and applies them to each member's input; the other programs of the group return at once. No
shape depends on the data and nothing waits on the host, so a call can be captured in a CUDA graph and replayed
with new ids.

Every output element is summed the same way whatever the batch: one member at a time, fp32 products over a
fixed BLOCK_K slice summed by one [BLOCK_N, BLOCK_K] reduction, slices added in ascending K. The group size
only decides how many members share the loaded weights, never the order of a member's sums, so a row of a
batch of 8 is bitwise equal to the same row at batch 1 (num_warps, BLOCK_N and BLOCK_K are module constants,
the same for every batch, since they shape the reduction tree).

Inadmissible inputs (``moe_reason`` / ``gate_up_reason`` / ``down_reason``) take the torch path, which computes
the same maths (moe_reference's pieces); wrong shapes raise ValueError. ids must lie in [0, E): the kernels
cannot check that without a host synchronisation. A row that repeats an expert is still computed correctly
(the kernel splits groups larger than MAX_GROUP), only slower.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._admit import device_reason, dtype_reason, interpreting

MAX_B = 16  # tokens per call; the largest group tile is next_power_of_2(MAX_B)
# One weight row per one-warp program (for experts_gate_up a gate row with its up row, BLOCK_N; for
# experts_down, DOWN_BLOCK_N): gemv.py's finding on an H200 at K=2048..4096. Untuned for these kernels: see
# python -m kernels.moe_bench --variants. BLOCK_K and NUM_WARPS shape the reduction tree, so changing them
# changes the bits for every batch size at once, never between batch sizes; they must not depend on B.
BLOCK_N = 1
DOWN_BLOCK_N = 1
BLOCK_K = 512
NUM_WARPS = 1
# The interpreter runs programs one by one in Python and sums each row with numpy on its own: taller blocks give
# the same results with far fewer programs.
INTERPRETER_BLOCK_N = 1024
MAX_K = 16384  # the K loop is unrolled at compile time
BLOCK_D = 1024  # the weighted sum over slots: D columns per program
COMBINE_WARPS = 4


@triton.jit
def _group(inp, w_e, out, sorted_ids, order, j, e, n_pairs, rows, DIV: tl.constexpr, N: tl.constexpr,
           K: tl.constexpr, GATED: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `rows` of expert e's weights (w_e) against the inputs of sorted pairs j..j+G-1 that chose e."""
    gs = tl.arange(0, G)
    idx = j + gs
    live = (idx < n_pairs) & (tl.load(sorted_ids + idx, mask=idx < n_pairs, other=-1) == e)
    pair = tl.load(order + idx, mask=live, other=0)  # the flat b*k + s index: where the result goes
    rlive = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([G, BLOCK_N], dtype=tl.float32)  # gate rows (or down rows)
    acc_b = tl.zeros([G, BLOCK_N], dtype=tl.float32)  # up rows
    for k0 in tl.static_range(0, K, BLOCK_K):  # fixed ascending order over K slices
        kk = k0 + cols
        kin = kk < K
        wmask = rlive[:, None] & kin[None, :]
        # the weight slice is loaded once and kept in registers for every member
        wa = tl.load(w_e + rows[:, None] * K + kk[None, :], mask=wmask, other=0.0).to(tl.float32)
        if GATED:
            wb = tl.load(w_e + (rows + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            # one member at a time: its sums are the same [BLOCK_N, BLOCK_K] reduction whatever G is. Its input
            # row: token b for gate/up (DIV = k), the pair's own h row for down (DIV = 1). A dead member (past the
            # group) reads some pair's row and is never stored: no branch, so the loads can be hoisted.
            src = tl.load(order + j + g, mask=j + g < n_pairs, other=0) // DIV
            sel = (gs == g)[:, None]
            xg = tl.load(inp + src * K + kk, mask=kin, other=0.0).to(tl.float32)
            acc_a = tl.where(sel, acc_a + tl.sum(wa * xg[None, :], axis=1)[None, :], acc_a)
            if GATED:
                acc_b = tl.where(sel, acc_b + tl.sum(wb * xg[None, :], axis=1)[None, :], acc_b)
    dst = out + pair[:, None] * N + rows[None, :]
    smask = live[:, None] & rlive[None, :]
    if GATED:
        tl.store(dst, (acc_a * tl.sigmoid(acc_a) * acc_b).to(out.dtype.element_ty), mask=smask)
    else:
        tl.store(dst, acc_a, mask=smask)


@triton.jit
def _experts_kernel(inp, w, out, sorted_ids, order, n_pairs, DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                    GATED: tl.constexpr, MAX_GROUP: tl.constexpr, G2: tl.constexpr, G4: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, j): weight rows n*BLOCK_N.. of sorted pair j's expert, if j is its group's first pair."""
    j = tl.program_id(1)
    e = tl.load(sorted_ids + j)
    first = tl.load(sorted_ids + j - 1, mask=j > 0, other=-1) != e
    # Only a row repeating an expert makes a group larger than MAX_GROUP; a pair beyond its first pair's reach
    # is then computed on its own (same sums, weights read again).
    alone = tl.load(sorted_ids + j - MAX_GROUP, mask=j >= MAX_GROUP, other=-1) == e
    if (first | alone) == 0:
        return  # another program of this group does its work
    ahead = j + tl.arange(0, MAX_GROUP)
    same = (ahead < n_pairs) & (tl.load(sorted_ids + ahead, mask=ahead < n_pairs, other=-1) == e)
    n = tl.sum((same & first).to(tl.int32), axis=0)  # the group's size up to MAX_GROUP; 0 for a lone pair
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e = w + e * ((2 * N if GATED else N) * K)
    # the smallest tile that holds the group: members beyond it cost compute, not memory
    if n <= 1:
        _group(inp, w_e, out, sorted_ids, order, j, e, n_pairs, rows, DIV, N, K, GATED, 1, BLOCK_N, BLOCK_K)
    elif n <= G2:
        _group(inp, w_e, out, sorted_ids, order, j, e, n_pairs, rows, DIV, N, K, GATED, G2, BLOCK_N, BLOCK_K)
    elif n <= G4:
        _group(inp, w_e, out, sorted_ids, order, j, e, n_pairs, rows, DIV, N, K, GATED, G4, BLOCK_N, BLOCK_K)
    else:
        _group(inp, w_e, out, sorted_ids, order, j, e, n_pairs, rows, DIV, N, K, GATED, MAX_GROUP, BLOCK_N, BLOCK_K)


@triton.jit
def _combine_kernel(y, wts, out, D: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b] = sum over s ascending of wts[b, s] * y[b, s] (launched without FMA contraction: each product is
    rounded before it is added, as in the torch path)."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        acc = acc + tl.load(wts + b * SLOTS + s).to(tl.float32) * tl.load(y + (b * SLOTS + s) * D + d, mask=live)
    tl.store(out + b * D + d, acc, mask=live)


# ---- torch path: the reference and the fallback -------------------------------------------------------------

def _gate_up_torch(x, w13, ids):
    inter = w13.shape[1] // 2
    gu = (w13[ids].float() @ x.float()[:, None, :, None])[..., 0]  # [B, k, 2I], the weights gathered per pair
    g, u = gu[..., :inter], gu[..., inter:]
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def _down_torch(h, w2, ids):
    return (w2[ids].float() @ h.float()[..., None])[..., 0]


def _combine_torch(y, weights):
    out = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for s in range(y.shape[1]):  # ascending slots
        out = out + weights[:, s, None].float() * y[:, s]
    return out


def moe_reference(x, w13, w2, ids, weights):
    """The plain torch reference: out [B, D] fp32, the same maths as moe_experts."""
    _check_moe(x, w13, w2, ids, weights)
    return _combine_torch(_down_torch(_gate_up_torch(x, w13, ids), w2, ids), weights)


# ---- shapes (errors) and admission (fallbacks) --------------------------------------------------------------

def _check_ids(ids, rows):
    if ids.dim() != 2 or ids.shape[0] != rows or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise ValueError(f"expected integer ids [B={rows}, k], got {tuple(ids.shape)} {ids.dtype}")


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
    if not 1 <= B <= MAX_B or k == 0:
        checks.append(f"B={B} outside 1..{MAX_B} or no slots")
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
def _rank_kernel(ids, sorted_ids, order, n, NP: tl.constexpr):
    """A stable sort of n <= NP ids in one program: each id's place is the count of ids before it (smaller, or
    equal and earlier). torch.sort's radix sort costs ~6.5 µs a call on an H200 for these few ids."""
    i = tl.arange(0, NP)
    live = i < n
    v = tl.load(ids + i, mask=live, other=0)
    before = (v[None, :] < v[:, None]) | ((v[None, :] == v[:, None]) & (i[None, :] < i[:, None]))
    place = tl.sum((before & live[None, :]).to(tl.int32), axis=1)
    tl.store(sorted_ids + place, v, mask=live)
    tl.store(order + place, i.to(tl.int64), mask=live)


MAX_RANK = 1024  # ids sorted by _rank_kernel (B*k pairs); more go through torch.sort


def _route(ids):
    """The (token, slot) pairs sorted by expert on the device, stable: (sorted expert ids, flat pair indices)."""
    flat = ids.reshape(-1)
    if flat.numel() > MAX_RANK:
        return torch.sort(flat, stable=True)
    sorted_ids, order = torch.empty_like(flat), torch.empty_like(flat)
    _rank_kernel[(1,)](flat, sorted_ids, order, flat.numel(), NP=triton.next_power_of_2(flat.numel()), num_warps=4)
    return sorted_ids, order


def _launch(inp, w, out, route, slots: int, gated: bool):
    """One launch of the experts kernel; returns Triton's compiled kernel (None under the interpreter)."""
    sorted_ids, order = route
    n_pairs = sorted_ids.numel()
    N, K = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    block_n = min(INTERPRETER_BLOCK_N, triton.next_power_of_2(N)) if interpreting() else \
        (BLOCK_N if gated else DOWN_BLOCK_N)
    mg = triton.next_power_of_2(n_pairs // slots)
    return _experts_kernel[(triton.cdiv(N, block_n), n_pairs)](
        inp, w, out, sorted_ids, order, n_pairs, DIV=slots if gated else 1, N=N, K=K, GATED=gated,
        MAX_GROUP=mg, G2=min(2, mg), G4=min(4, mg), BLOCK_N=block_n,
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(K)), num_warps=NUM_WARPS)


def _gate_up(x, w13, ids, route):
    h = torch.empty(*ids.shape, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch(x, w13, h, route, ids.shape[1], True)
    return h


def _down(h, w2, ids, route):
    y = torch.empty(*ids.shape, w2.shape[1], dtype=torch.float32, device=h.device)
    _launch(h, w2, y, route, ids.shape[1], False)
    return y


def experts_gate_up(x, w13, ids):
    """h [B, k, I] in x's dtype: silu(gate rows @ x[b]) * (up rows @ x[b]) of expert ids[b, s], fp32 inside."""
    if gate_up_reason(x, w13, ids):
        return _gate_up_torch(x, w13, ids)
    return _gate_up(x, w13, ids, _route(ids))


def experts_down(h, w2, ids):
    """y [B, k, D] fp32: w2[ids[b, s]] @ h[b, s] with fp32 sums."""
    if down_reason(h, w2, ids):
        return _down_torch(h, w2, ids)
    return _down(h, w2, ids, _route(ids))


def moe_experts(x, w13, w2, ids, weights):
    """out [B, D] fp32: the routed experts' outputs weighted by weights[b, s] (fp32), summed over ascending s."""
    if moe_reason(x, w13, w2, ids, weights):
        return moe_reference(x, w13, w2, ids, weights)
    route = _route(ids)  # sorted once for both kernels
    y = _down(_gate_up(x, w13, ids, route), w2, ids, route)
    B, k, D = y.shape
    out = torch.empty(B, D, dtype=torch.float32, device=x.device)
    _combine_kernel[(B, triton.cdiv(D, BLOCK_D))](y, weights.float().contiguous(), out, D=D, SLOTS=k,
                                                  BLOCK_D=BLOCK_D, num_warps=COMBINE_WARPS, enable_fp_fusion=False)
    return out


__all__ = ["MAX_B", "experts_gate_up", "experts_down", "moe_experts", "moe_reference", "moe_reason",
           "gate_up_reason", "down_reason"]
