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
engine/DECODE.md v19), which cannot start before the final norm ends, then the pick, the copy into the inputs and the
advance, three more launches on the step's path.
"""
from __future__ import annotations

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
    if x.dim() != 2 or x.shape[0] > MAX_BATCH:
        return f"x {tuple(x.shape)}: the kernel takes at most {MAX_BATCH} row(s)"
    reason = gemv.gemv_reason(x[0], w)
    if reason:
        return reason
    if reason := argmax.vocab_reason(w.shape[0]):
        return reason
    if counts.dtype != torch.int32 or counts.numel() < counts_for(w.shape[0]):
        return f"counts must be int32 with at least {counts_for(w.shape[0])} zeros, got {counts.numel()}"
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


__all__ = ["head_pick", "head_reason", "counts_for"]
