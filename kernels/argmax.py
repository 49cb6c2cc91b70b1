"""pick_batch: the greedy pick over a batch of logits and its margin, in one launch, deterministic.

Contract: ``pick_batch(logits, fallback)`` -> (ids int64 [B], margins fp32 [B]). ids equal ``torch.argmax(logits,
dim=-1)``: the first maximal index of each row, NaN counting as the maximum (the first NaN wins, as in torch), 0 for a
row of -inf. margins are the largest logit less the second largest (a repeated maximum gives 0), as
``torch.topk(logits.float(), 2)`` makes them; NaN where a row holds a NaN. Programs of BLOCK_V logits a row each write
their block's best, its first index and the runner-up; the last program to finish (kernels/_count.py) merges each
row's blocks in ascending order, so the answer never depends on scheduling. Inputs it does not admit
(``pick_reason``) get ``fallback()``: the engine's torch pick. The decode loop's pick: on an H200 torch's float
copy, argmax and topk took 0.128 ms at batch 1 and V = 102,400, this kernel 8.6 µs (kernels/KERNELS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _count, pdl
from ._admit import device_reason, dtype_reason

BLOCK_V = 4096
NUM_WARPS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROWS = 64  # the merge walks the rows in one program
MERGE_CHUNK = 32  # blocks the merge reads at once (V = 102,400 is 25 blocks)


@triton.jit
def block_best(x, idx, live, V):
    """(best, runner-up, first index of best) of one block of fp32 values x at indices idx (live: in range, the others
    -inf), NaN standing for the best and its first index taken."""
    nan = (x != x) & live
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0  # then the first NaN is the pick, the margin NaN
    x = tl.where(nan, float("-inf"), x)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where((x == best) & live, idx, V), axis=0)
    second = tl.max(tl.where(idx == first, float("-inf"), x), axis=0)
    first = tl.where(has_nan, tl.min(tl.where(nan, idx, V), axis=0), first)
    best = tl.where(has_nan, float("nan"), best)
    return best, second, first


@triton.jit
def merge_pair(top, second, first, b, s, f):
    """Two triples (``block_best``'s) of disjoint index sets, in either order -> theirs: the larger best, equal
    bests taken at the lower index (the other then the runner-up), a NaN best at the lower NaN's index."""
    n1 = top != top
    n2 = b != b
    take = tl.where(n1 | n2, n2 & (~n1 | (f < first)), (b > top) | ((b == top) & (f < first)))
    return (tl.where(take, b, top), tl.where(take, tl.maximum(s, top), tl.maximum(second, b)),
            tl.where(take, f, first))


@triton.jit
def store_best(out, best, second, first):
    tl.store(out, best)
    tl.store(out + 1, second)
    tl.store(out + 2, first.to(tl.float32))  # exact: V < 2**24


@triton.jit
def merge_blocks(at, n, SPAN, CHUNK: tl.constexpr):
    """The (best, runner-up, first index of best) of n blocks' triples stored at ``at`` (``store_best``), read CHUNK
    at a time in ascending order over SPAN >= n (a loop bound the interpreter takes: a kernel argument, not a value the
    program computed): the best, the lowest index holding it, the runner-up the larger of that block's
    runner-up and every other block's best; a NaN block makes the result NaN with the first NaN's index. The result is
    a block's triple again, so blocks merge in groups, then the groups."""
    b = tl.arange(0, CHUNK)
    none = 16777216.0  # 2**24: above every index
    top = tl.full([], float("-inf"), tl.float32)
    second = tl.full([], float("-inf"), tl.float32)
    first = tl.full([], none, tl.float32)
    nan_first = tl.full([], none, tl.float32)
    for c0 in range(0, SPAN, CHUNK):
        keep = c0 + b < n
        bests = tl.load(at + (c0 + b) * 3, mask=keep, other=float("-inf"), cache_modifier=".cg")
        seconds = tl.load(at + (c0 + b) * 3 + 1, mask=keep, other=float("-inf"), cache_modifier=".cg")
        firsts = tl.load(at + (c0 + b) * 3 + 2, mask=keep, other=none, cache_modifier=".cg")
        nans = (bests != bests) & keep
        nan_first = tl.minimum(nan_first, tl.min(tl.where(nans, firsts, none), axis=0))
        ok = keep & ~nans
        c_top = tl.max(tl.where(ok, bests, float("-inf")), axis=0)
        c_first = tl.min(tl.where(ok & (bests == c_top), firsts, none), axis=0)
        c_second = tl.maximum(tl.max(tl.where(ok & (firsts == c_first), seconds, float("-inf")), axis=0),
                              tl.max(tl.where(ok & (firsts != c_first), bests, float("-inf")), axis=0))
        take = (c_top > top) | (first == none)  # an equal best in a later chunk is only a runner-up
        second = tl.where(take, tl.maximum(top, c_second), tl.maximum(second, c_top))
        first = tl.where(take, c_first, first)
        top = tl.where(take, c_top, top)
    has_nan = nan_first < none
    return tl.where(has_nan, float("nan"), top), second, tl.where(has_nan, nan_first, first)


@triton.jit
def store_pick(ids, margins, r, best, second, first):
    """Row r's pick and margin (NaN beside a NaN, and for a row of -inf) from its merged triple."""
    tl.store(ids + r, first.to(tl.int64))
    tl.store(margins + r, best - second)


@triton.jit
def _pick_kernel(logits, part, count, ids, margins, stride, B: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
                 NB: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, j): part[row, j] = (best, runner-up, first index of best) of logits block j, NaN as the best;
    the last program merges every row."""
    pdl.wait(PDL)
    row = tl.program_id(0)
    j = tl.program_id(1)
    idx = j * BLOCK_V + tl.arange(0, BLOCK_V)
    live = idx < V
    x = tl.load(logits + row.to(tl.int64) * stride + idx, mask=live, other=float("-inf")).to(tl.float32)
    best, second, first = block_best(x, idx, live, V)
    store_best(part + (row * NB + j) * 3, best, second, first)
    if _count.last_to_arrive(count, B * NB):
        for r in range(B):
            top, runner, pick = merge_blocks(part + r * NB * 3, NB, NB, CHUNK)
            store_pick(ids, margins, r, top, runner, pick)
        _count.reset(count)


def vocab_reason(V: int) -> str | None:
    """Why V rows cannot be picked among (the index travels as fp32 in the merge's triples), or None."""
    return None if 2 <= V < 2**24 else f"V={V} outside 2..2**24 (exact in fp32)"


def pick_reason(logits: torch.Tensor) -> str | None:
    """Admission predicate: None admits, else why the call takes its fallback."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return f"logits must be a non-empty [B, V] tensor, got {tuple(logits.shape)}"
    if logits.stride(1) != 1:
        return "logits rows must be contiguous"
    if logits.shape[1] >= 2**31 - 1 or logits.shape[0] * logits.stride(0) >= 2**31:
        return "too large for 32-bit offsets"
    if logits.shape[0] > MAX_ROWS:
        return f"{tuple(logits.shape)}: more than {MAX_ROWS} rows"
    return vocab_reason(logits.shape[1]) or device_reason(logits) or dtype_reason("logits", logits.dtype, DTYPES)


def pick_batch(logits: torch.Tensor, fallback, counter: torch.Tensor | None = None):
    """(ids int64 [B], margins fp32 [B]) of [B, V] logits in one launch, or ``fallback()`` where the kernel does not
    admit them (the engine's torch pick); ``counter`` int32 [1], zero, the launch's own (None allocates it)."""
    if pick_reason(logits):
        return fallback()
    ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    margins = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=logits.device)
    _launch(logits, ids, margins, counter)
    return ids, margins


def _launch(logits, ids, margins, counter):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    B, V = logits.shape
    nb = triton.cdiv(V, BLOCK_V)
    part = torch.empty(B, nb, 3, dtype=torch.float32, device=logits.device)
    return _pick_kernel[(B, nb)](logits, part, counter, ids, margins, logits.stride(0), B=B, V=V, BLOCK_V=BLOCK_V,
                                 NB=nb, CHUNK=MERGE_CHUNK, num_warps=NUM_WARPS,
                                 **pdl.flags(logits.device))
