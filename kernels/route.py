"""route: the MoE router of the decode step (gate logits, scores, top-k, weights, shared slots) in one launch at
batch 1, two above.

The maths of the engine's ``MoE.route`` in fp32, for x [B, D] (B <= MAX_B) against gate_weight [E, D]
(E <= MAX_E), fp16/bf16/fp32. Returns ids [B, top_k + shared] int64 and weights fp32: the top_k experts in
descending order of the choice (the score; noaux_tc: score + bias), ties to the lowest index, then shared expert
j as id E + j with weight 1.0; ``remap`` (int64 [E + shared]) maps every id (expert parallelism: -1 for "not on
this rank"). No host synchronisation and no shape that depends on the data: a call can be captured in a CUDA
graph. Inputs a kernel does not admit (``route_reason``) take ``route_reference``, the same maths in torch; wrong
shapes raise ValueError. The kernel routes all three ways (``method``): greedy top-k of the softmax
(DeepSeek-V2-Lite), DeepSeek-V2's group_limited_greedy (the topk_group of n_group contiguous groups with the best
score kept, top-k inside them) and DeepSeek-V3's noaux_tc (sigmoid scores plus a correction bias for the choice,
groups ranked by the sum of their two best choices, the unbiased scores as weights); groups too rank with ties to
the lowest index. ``add_norm_route`` also makes x itself, from the residual add and RMSNorm before the router
(kernels/norm.py's add_rms_norm, the same roundings), still one launch at batch 1: the decode step's
post-attention norm and its router; there it can publish h' and x to the next launch before its own end
(``ready``, kernels/pdl.py's publish), for the shared experts. The gate logits' programs write fp32 partials; at
batch 1 the last of them to finish (an atomic count) selects, above it a second launch selects each row
(``ONE_LAUNCH_ROWS``: measured).
Launches, numerics, why: kernels/KERNELS.md, section "Router (`route.py`)".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _count, norm, pdl
from ._admit import device_reason, dtype_reason

MAX_B = 16  # rows a call (moe.MAX_B: the routed experts' kernel takes the same batches)
MAX_E = 1024  # one select program holds a row's scores in registers
MAX_SLOTS = 64  # top_k + shared: the top-k loop is unrolled
MAX_GROUPS = 32  # n_group of the group routings: the loops over groups are unrolled
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")  # the kernel's METHOD, by index
# The logits tiles: BLOCK_E gate rows by BLOCK_D columns, one warp (gemv.py's finding for weight streaming on an
# H200); at Lite (E=64, D=2048) a grid of 16 x 8 = 128 programs, 4 KB of weight each. Untuned. The tile shapes
# the sums, so it is a module constant, never chosen per batch.
BLOCK_E = 4
BLOCK_D = 256
LOGITS_WARPS = 1
ROW_IN_ONE_WARP = 4096  # add_norm_route holds a whole row of x per program: a wider one takes four warps
# Up to this many rows the last logits program selects (one launch; add_norm_route makes x in it too); above it a
# second launch selects the rows in parallel and add_norm_route is the norm's launch and route's two. On an H200 at
# V2-Lite's shape one launch with the norm took 4.8 us at batch 1 against 6.0 for the norm, logits and select apart,
# and 24.7 us at batch 8 (one program selecting 8 rows in turn, every program norming 8 rows) against 8.5.
ONE_LAUNCH_ROWS = 1


@triton.jit
def _sum_units(v):
    """The sum of v's lanes, each in [0, 1] (or NaN: then NaN), with the same bits in any order: added exactly as
    integers of 2^-52 (1024 lanes of at most 1 stay under 2^62), then rounded once, within 2^-42 of the true sum.
    A float sum's order follows the lanes' layout, which Triton picks per kernel, and the selection runs inside two
    kernels (the logits launch at batch 1, its own above): a row's routes must not depend on which (KERNELS.md)."""
    scale = 4503599627370496.0  # 2^52
    total = tl.sum((v * scale).to(tl.int64), axis=0).to(tl.float32) / scale
    return tl.where(tl.sum((v != v).to(tl.int32), axis=0) > 0, float("nan"), total)


@triton.jit
def _select_row(part, remap, bias, ids, wts, B: tl.constexpr, b, scaling, N_SPLIT: tl.constexpr, E: tl.constexpr,
                K: tl.constexpr, S: tl.constexpr, NORM: tl.constexpr, REMAP: tl.constexpr, METHOD: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_E: tl.constexpr,
                SLOTS: tl.constexpr):
    """Row b: logits from the partials, the scores (softmax; noaux_tc: sigmoid, plus the bias for the choice), the
    group restriction (METHOD 1 and 2), the top K by the choice, their weights, S shared slots, the remap."""
    e = tl.arange(0, BLOCK_E)
    live = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for j in tl.static_range(N_SPLIT):  # ascending splits: the same sum whatever the batch; other programs' partials
        # (kernels/_count.py)
        logits += tl.load(part + (j * B + b) * E + e, mask=live, other=0.0, cache_modifier=".cg")
    logits = tl.where(live, logits, float("-inf"))
    if METHOD == 2:  # noaux_tc: sigmoid scores; the bias steers the choice only
        scores = tl.math.div_rn(tl.zeros_like(logits) + 1.0, 1.0 + tl.exp(-logits))
        choice = scores + tl.load(bias + e, mask=live, other=0.0)
    else:
        p = tl.exp(logits - tl.max(logits, axis=0))  # 0 on the padding lanes
        scores = tl.math.div_rn(p, tl.zeros_like(p) + _sum_units(p))
        choice = scores
    # NaN ranks first (as in a descending sort, and torch.topk): it counts as +inf, for groups and experts alike
    choice = tl.where(choice != choice, float("inf"), choice)
    if METHOD != 0 and TOPK_GROUP < N_GROUP:  # keep the TOPK_GROUP best of N_GROUP groups, ties to the lowest
        grp = e // (E // N_GROUP)  # N_GROUP and above on the padding lanes
        g = tl.arange(0, GROUPS)
        gval = tl.zeros([GROUPS], dtype=tl.float32)
        for i in tl.static_range(N_GROUP):
            mine = grp == i
            top = tl.max(tl.where(mine, choice, float("-inf")), axis=0)
            if METHOD == 2:  # plus the second largest: the largest of the rest once the (lowest) first is out
                first = tl.min(tl.where(mine & (choice == top), e, BLOCK_E), axis=0)
                top += tl.max(tl.where(mine & (e != first), choice, float("-inf")), axis=0)
            gval = tl.where(g == i, top, gval)
        gval = tl.where(gval != gval, float("inf"), gval)  # inf + -inf
        gfree = g < N_GROUP
        keep = e < 0
        for i in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(gfree, gval, float("-inf")), axis=0)
            at = tl.min(tl.where(gfree & (gval == top), g, GROUPS), axis=0)
            keep = keep | (grp == at)
            gfree = gfree & (g != at)
        if METHOD == 1:  # the others score 0, as in the torch path (a kept expert's 0 ties with them)
            scores = tl.where(keep, scores, 0.0)
            choice = tl.where(keep, choice, 0.0)
        else:
            choice = tl.where(keep, choice, float("-inf"))
    # the top K by iterative argmax over the lanes still free (the padding never is), lowest index among equals
    free = live
    slot = tl.arange(0, SLOTS)
    vals = tl.zeros([SLOTS], dtype=tl.float32)
    pick = tl.zeros([SLOTS], dtype=tl.int32)
    for i in tl.static_range(K):
        top = tl.max(tl.where(free, choice, float("-inf")), axis=0)
        at = tl.min(tl.where(free & (choice == top), e, BLOCK_E), axis=0)
        vals = tl.where(slot == i, tl.sum(tl.where(e == at, scores, 0.0), axis=0), vals)
        pick = tl.where(slot == i, at, pick)
        free = free & (e != at)
    routed = slot < K
    if NORM:
        total = _sum_units(tl.where(routed, vals, 0.0)) + 1e-20
        weight = tl.math.div_rn(vals, tl.zeros_like(vals) + total)
        if METHOD == 2:  # noaux_tc scales the normalised weights too
            weight = weight * scaling
    else:
        weight = vals * scaling
    weight = tl.where(routed, weight, 1.0)  # the shared experts' slots
    pick = tl.where(routed, pick, E + slot - K)
    out = slot < K + S
    if REMAP:
        pick = tl.load(remap + pick, mask=out, other=-1)
    tl.store(ids + b * (K + S) + slot, pick.to(tl.int64), mask=out)
    tl.store(wts + b * (K + S) + slot, weight, mask=out)


@triton.jit
def _add_norm_slice(h, delta, norm_w, h_out, x_out, eps, b, ds, dlive, first, D: tl.constexpr,
                    BLOCK_ROW: tl.constexpr):
    """x[b] over columns ds of h[b] + delta[b] normed as kernels/norm.py's add_rms_norm rounds it (delta rounded to h's
    dtype, the sum rounded, fp32 mean of squares, the norm rounded, times the weight, rounded). Every program computes
    the row's sum of squares with the same code, so all agree; ``first`` stores the row's h and x."""
    cols = tl.arange(0, BLOCK_ROW)
    keep = cols < D
    dt = h_out.dtype.element_ty
    v = (tl.load(h + b * D + cols, mask=keep, other=0.0).to(tl.float32)
         + tl.load(delta + b * D + cols, mask=keep, other=0.0).to(tl.float32).to(dt).to(tl.float32)).to(dt)
    tl.store(h_out + b * D + cols, v, mask=keep & first)
    v = v.to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    w_row = tl.load(norm_w + cols, mask=keep & first, other=0.0).to(tl.float32)  # only the first stores x
    tl.store(x_out + b * D + cols, (w_row * (v * inv).to(dt).to(tl.float32)).to(dt), mask=keep & first)
    vs = (tl.load(h + b * D + ds, mask=dlive, other=0.0).to(tl.float32)
          + tl.load(delta + b * D + ds, mask=dlive, other=0.0).to(tl.float32).to(dt).to(tl.float32)).to(dt)
    ws = tl.load(norm_w + ds, mask=dlive, other=0.0).to(tl.float32)
    return (ws * (vs.to(tl.float32) * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _fill(buf, N: tl.constexpr, VALUE: tl.constexpr):
    """buf[:N] = VALUE, an integer of buf's element width, as bits."""
    offs = tl.arange(0, 1024)
    for i in tl.static_range(0, N, 1024):
        if buf.dtype.element_ty.primitive_bitwidth == 16:
            v = tl.full([1024], VALUE, tl.int16).to(buf.dtype.element_ty, bitcast=True)
        else:
            v = tl.full([1024], VALUE, tl.int32).to(buf.dtype.element_ty, bitcast=True)
        tl.store(buf + i + offs, v, mask=i + offs < N)


@triton.jit
def _route_kernel(x, w, part, count, remap, bias, ids, wts, scaling, h, delta, norm_w, h_out, eps,
                  B: tl.constexpr, E: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                  ADD_NORM: tl.constexpr, SELECT: tl.constexpr, BLOCK_ROW: tl.constexpr, N_SPLIT: tl.constexpr,
                  K: tl.constexpr, S: tl.constexpr, NORM: tl.constexpr, REMAP: tl.constexpr, METHOD: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS: tl.constexpr, E_PAD: tl.constexpr,
                  SLOTS: tl.constexpr, ready, PUBLISH: tl.constexpr, hreset, N_RESET: tl.constexpr,
                  FILL: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): part[j, b, e] = sum over columns j*BLOCK_D.. of w[e] * x[b], for gate rows e of block i and
    every row b (the weight tile loaded once for all rows); with ADD_NORM, x is made here from h + delta (as
    kernels/norm.py's add_rms_norm), and program (0, 0) writes h_out and x. With SELECT the last program to finish (a
    counter, put back to 0 for the next launch) selects every row's experts from the partials: one launch, not two.
    With PUBLISH, program (0, 0) publishes h_out and x (``pdl.publish`` on ready) before the next launch starts."""
    split = tl.program_id(1)
    es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ds = split * BLOCK_D + tl.arange(0, BLOCK_D)
    elive, dlive = es < E, ds < D
    # the gate weight is no kernel's output: its load overlaps the previous kernel's tail
    wt = tl.load(w + es[:, None] * D + ds[None, :], mask=elive[:, None] & dlive[None, :], other=0.0).to(tl.float32)
    first = (tl.program_id(0) == 0) & (split == 0)
    pdl.wait_only(PDL)
    if PUBLISH:
        if first:  # the flag says 1 only once this launch has published: a reader started before then waits
            tl.atomic_xchg(ready, 0, sem="relaxed", scope="gpu")
            if N_RESET > 0:  # the experts' h buffer marked unwritten before anything of this step writes it
                _fill(hreset, N_RESET, FILL)
        else:  # the publisher lets the next launch start once x is stored
            pdl.launch_dependents(PDL)
    else:
        pdl.launch_dependents(PDL)
    for b in tl.static_range(B):  # unrolled: every row's x loads are in flight at once
        if ADD_NORM:
            xb = _add_norm_slice(h, delta, norm_w, h_out, x, eps, b, ds, dlive, first, D, BLOCK_ROW)
        else:
            xb = tl.load(x + b * D + ds, mask=dlive, other=0.0).to(tl.float32)
        if PUBLISH and b == B - 1:
            if first:
                pdl.publish(ready, PDL)
        tl.store(part + (split * B + b) * E + es, tl.sum(wt * xb[None, :], axis=1), mask=elive)
    if SELECT:
        if _count.last_to_arrive(count, tl.num_programs(0) * tl.num_programs(1)):
            for row in range(B):
                _select_row(part, remap, bias, ids, wts, B, row, scaling, N_SPLIT, E, K, S, NORM, REMAP, METHOD,
                            N_GROUP, TOPK_GROUP, GROUPS, E_PAD, SLOTS)
            _count.reset(count)


@triton.jit
def _select_kernel(part, remap, bias, ids, wts, scaling, B: tl.constexpr, N_SPLIT: tl.constexpr, E: tl.constexpr,
                   K: tl.constexpr, S: tl.constexpr, NORM: tl.constexpr, REMAP: tl.constexpr, METHOD: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS: tl.constexpr, E_PAD: tl.constexpr,
                   SLOTS: tl.constexpr, PDL: tl.constexpr):
    """Program b: row b's selection (above ONE_LAUNCH_ROWS rows: the rows in parallel)."""
    pdl.wait(PDL)
    _select_row(part, remap, bias, ids, wts, B, tl.program_id(0), scaling, N_SPLIT, E, K, S, NORM, REMAP, METHOD,
                N_GROUP, TOPK_GROUP, GROUPS, E_PAD, SLOTS)


# ---- shapes (errors), admission (fallbacks) and the torch path ---------------------------------------------

def _check(x, gate_weight, top_k, shared, remap, method="greedy", n_group=1, topk_group=1, bias=None):
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"expected x [B, D] and gate_weight [E, D], got {tuple(x.shape)} and "
                         f"{tuple(gate_weight.shape)}")
    E = gate_weight.shape[0]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} outside 1..E={E}")
    if shared < 0:
        raise ValueError(f"shared={shared} is negative")
    if remap is not None and (tuple(remap.shape) != (E + shared,) or remap.dtype.is_floating_point
                              or remap.dtype.is_complex or remap.dtype == torch.bool):
        raise ValueError(f"expected integer remap [E + shared = {E + shared}], got {tuple(remap.shape)} {remap.dtype}")
    if method not in METHODS:
        raise ValueError(f"unknown routing method {method!r}, expected one of {METHODS}")
    if method == "greedy":
        return
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group={n_group} does not divide E={E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} outside 1..n_group={n_group}")
    if top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k={top_k} above the {topk_group * (E // n_group)} experts of {topk_group} groups")
    if method == "noaux_tc" and (bias is None or tuple(bias.shape) != (E,)):
        raise ValueError(f"noaux_tc needs a bias [E={E}], got {None if bias is None else tuple(bias.shape)}")
    if method == "noaux_tc" and E // n_group < 2:
        raise ValueError(f"noaux_tc ranks groups by their top 2: groups of {E // n_group} expert")


def route_reason(x, gate_weight, top_k: int, shared: int = 0, remap=None, method: str = "greedy", n_group: int = 1,
                 topk_group: int = 1, bias: torch.Tensor | None = None) -> str | None:
    """Admission predicate: None admits, else why the call takes the torch path. Wrong shapes raise ValueError."""
    _check(x, gate_weight, top_k, shared, remap, method, n_group, topk_group, bias)
    (B, D), E = x.shape, gate_weight.shape[0]
    bias = bias if method == "noaux_tc" else None
    tensors = tuple(t for t in (x, gate_weight, remap, bias) if t is not None)
    checks = [device_reason(*tensors), dtype_reason("x", x.dtype), dtype_reason("gate_weight", gate_weight.dtype)]
    if not (x.is_contiguous() and gate_weight.is_contiguous()):
        checks.append("x and gate_weight must be contiguous")
    if remap is not None and (remap.dtype != torch.int64 or not remap.is_contiguous()):
        checks.append(f"remap must be contiguous int64, got {remap.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        checks.append(f"bias must be contiguous fp32, got {bias.dtype}")
    if method != "greedy" and n_group > MAX_GROUPS:
        checks.append(f"n_group={n_group} above {MAX_GROUPS}")
    if not 1 <= B <= MAX_B:
        checks.append(f"B={B} outside 1..{MAX_B}")
    if E > MAX_E or top_k + shared > MAX_SLOTS:
        checks.append(f"E={E} above {MAX_E} or top_k + shared = {top_k + shared} above {MAX_SLOTS}")
    if E * D >= 2**31:
        checks.append("gate_weight too large for 32-bit offsets")
    return next((c for c in checks if c), None)


def _groups_kept(scores: torch.Tensor, n_group: int, topk_group: int, group_score, fill: float) -> torch.Tensor:
    """scores [B, E] with the experts outside the topk_group best of n_group groups (by group_score) set to fill."""
    if topk_group >= n_group:  # every group kept
        return scores
    by_group = scores.view(scores.shape[0], n_group, -1)
    kept = torch.sort(group_score(by_group), dim=-1, descending=True, stable=True)[1][:, :topk_group]
    mask = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
    return scores.masked_fill(~mask.repeat_interleave(by_group.shape[-1], dim=1), fill)


def route_reference(x, gate_weight, top_k: int, norm_topk_prob: bool, scaling: float, shared: int = 0,
                    remap=None, method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: the same maths as route (ties to the lowest index through a stable sort), and the group
    routings: group_limited_greedy (groups by their best softmax score) and noaux_tc (sigmoid scores plus ``bias``
    for the choice, groups by their top-2 sum; the weights are the unbiased scores, renormalised under
    norm_topk_prob, then scaled)."""
    _check(x, gate_weight, top_k, shared, remap, method, n_group, topk_group, bias)
    logits = F.linear(x.float(), gate_weight.float())
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = _groups_kept(scores + bias.to(scores.device, torch.float32), n_group, topk_group,
                              lambda g: g.topk(2, dim=-1)[0].sum(dim=-1), float("-inf"))
        idx = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :top_k]
        vals = scores.gather(1, idx)
        weights = (vals / (vals.sum(dim=-1, keepdim=True) + 1e-20) if norm_topk_prob else vals) * scaling
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if method == "group_limited_greedy":
            scores = _groups_kept(scores, n_group, topk_group, lambda g: g.max(dim=-1).values, 0.0)
        vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
        vals, idx = vals[:, :top_k], idx[:, :top_k]
        if norm_topk_prob and top_k > 1:
            weights = vals / (vals.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = vals * scaling
    B, E = x.shape[0], gate_weight.shape[0]
    idx = torch.cat([idx, torch.arange(E, E + shared, device=x.device).expand(B, shared)], dim=1)
    weights = torch.cat([weights, torch.ones(B, shared, dtype=torch.float32, device=x.device)], dim=1)
    if remap is not None:
        idx = remap.to(idx.device)[idx]
    return idx.long().contiguous(), weights.contiguous()


# ---- launches -----------------------------------------------------------------------------------------------

def _warps(D: int, E: int, add_norm: bool) -> tuple[int, int]:
    """(warps of the logits launch, warps of a selection)."""
    warps = 4 if add_norm and triton.next_power_of_2(D) > ROW_IN_ONE_WARP else LOGITS_WARPS
    return warps, 1 if triton.next_power_of_2(E) <= 256 else 4


def _launch(x, gate_weight, top_k, norm_topk_prob, scaling, shared, remap, method, n_group, topk_group, bias,
            counter, norm=None, ready=None, h_reset=None):
    """One launch (two above ONE_LAUNCH_ROWS rows) -> (ids, weights); ``norm`` (h, delta, norm_weight, eps, h_out): x
    is made in the first (add_rms_norm); ``ready``: published there (one launch and norm only), after h_reset's fill."""
    (B, D), E = x.shape, gate_weight.shape[0]
    block_e, block_d = min(BLOCK_E, triton.next_power_of_2(E)), min(BLOCK_D, triton.next_power_of_2(D))
    n_split = triton.cdiv(D, block_d)
    part = torch.empty(n_split, B, E, dtype=torch.float32, device=x.device)
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    slots = top_k + shared
    ids = torch.empty(B, slots, dtype=torch.int64, device=x.device)
    weights = torch.empty(B, slots, dtype=torch.float32, device=x.device)
    e_pad, kind = triton.next_power_of_2(E), METHODS.index(method)
    if kind == 0 or topk_group == n_group:
        n_group = topk_group = 1  # no group is dropped: the group code is not compiled in
    h, delta, norm_weight, eps, h_out = norm or (x, x, x, 0.0, x)  # unread without ADD_NORM
    hbuf, fill = h_reset or (x, 0)  # unwritten without h_reset
    warps, select_warps = _warps(D, E, norm is not None)
    # A row's routes from a given x are the same either way (the selection's sums are exact, _sum_units).
    # add_norm_route's x is not: at batch 1 its sum of squares is this launch's, above it norm.py's, one rounding step
    # apart at most (as the graph step's projections already differ between batch 1 and above, kernels/skinny.py).
    one = B <= ONE_LAUNCH_ROWS
    flags = pdl.flags(x.device)
    select = dict(NORM=bool(norm_topk_prob) and (top_k > 1 or kind == 2), REMAP=remap is not None, METHOD=kind,
                  N_GROUP=n_group, TOPK_GROUP=topk_group, GROUPS=triton.next_power_of_2(n_group), E_PAD=e_pad,
                  SLOTS=triton.next_power_of_2(slots), N_SPLIT=n_split, K=top_k, S=shared)
    lookup = ids if remap is None else remap, bias if kind == 2 else part
    _route_kernel[(triton.cdiv(E, block_e), n_split)](
        x, gate_weight, part, counter, *lookup, ids, weights, float(scaling), h, delta, norm_weight, h_out, float(eps),
        B=B, E=E, D=D, BLOCK_E=block_e, BLOCK_D=block_d, ADD_NORM=norm is not None, SELECT=one,
        BLOCK_ROW=triton.next_power_of_2(D), ready=counter if ready is None else ready,  # unread without PUBLISH
        PUBLISH=ready is not None, hreset=hbuf, N_RESET=0 if h_reset is None else hbuf.numel(), FILL=fill,
        num_warps=warps, **select, **flags)
    if not one:
        _select_kernel[(B,)](part, *lookup, ids, weights, float(scaling), B=B, E=E, **select, num_warps=select_warps,
                             **flags)
    return ids, weights


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float,
          shared: int = 0, remap: torch.Tensor | None = None, method: str = "greedy", n_group: int = 1,
          topk_group: int = 1, bias: torch.Tensor | None = None,
          counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, top_k + shared] int64, weights [B, top_k + shared] fp32) for x [B, D] against gate_weight [E, D].
    ``counter``: int32 [1], zero, the launch's own (it is back to zero after): a graph step passes one a layer;
    None allocates it."""
    if route_reason(x, gate_weight, top_k, shared, remap, method, n_group, topk_group, bias):
        return route_reference(x, gate_weight, top_k, norm_topk_prob, scaling, shared, remap, method, n_group,
                               topk_group, bias)
    return _launch(x, gate_weight, top_k, norm_topk_prob, scaling, shared, remap, method, n_group, topk_group, bias,
                   counter)


def add_norm_route(h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float, shared: int = 0,
                   remap: torch.Tensor | None = None, method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                   bias: torch.Tensor | None = None, counter: torch.Tensor | None = None,
                   ready: torch.Tensor | None = None, h_reset=None):
    """kernels.norm.add_rms_norm(h, delta, norm_weight, eps) -> (h', x), then route(x, ...) -> (ids, weights): (h', x,
    ids, weights), in one launch up to ONE_LAUNCH_ROWS rows, else as those two calls. ``ready`` (int32 [1]): 1 once
    that one launch has published h' and x to the next launch (``pdl.publish``: the next launch's programs start
    after it), set to 0 on the other paths, which publish nothing early. ``h_reset`` (buf, bits), with ready only:
    buf filled with bits (an integer of its element width) before the publication, on every path: the experts'
    h buffer marked unwritten for a down launch that checks it (kernels/moe.py, ``experts_down``'s early)."""
    if h_reset is not None and ready is None:
        raise ValueError("h_reset is filled before ready's publication: it needs ready")
    if delta.shape != h.shape:
        raise ValueError(f"h {tuple(h.shape)} and delta {tuple(delta.shape)} differ in shape")
    if norm.norm_reason(h, norm_weight) or dtype_reason("delta", delta.dtype) or device_reason(h, delta) \
            or not delta.is_contiguous() \
            or route_reason(h, gate_weight, top_k, shared, remap, method, n_group, topk_group, bias) \
            or h.shape[0] > ONE_LAUNCH_ROWS:
        if ready is not None:
            ready.zero_()
        if h_reset is not None:
            h_reset[0].view({2: torch.int16, 4: torch.int32}[h_reset[0].itemsize]).fill_(h_reset[1])
        h, x = norm.add_rms_norm(h, delta, norm_weight, eps)
        return h, x, *route(x, gate_weight, top_k, norm_topk_prob, scaling, shared, remap, method, n_group,
                            topk_group, bias, counter)
    h_out, x = torch.empty_like(h), torch.empty_like(h)
    ids, weights = _launch(x, gate_weight, top_k, norm_topk_prob, scaling, shared, remap, method, n_group, topk_group,
                           bias, counter, (h, delta, norm_weight, eps, h_out), ready, h_reset)
    return h_out, x, ids, weights


__all__ = ["MAX_B", "add_norm_route", "route", "route_reason", "route_reference"]
