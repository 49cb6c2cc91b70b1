"""Dense projections of a few rows on the tensor cores: y = x @ W^T for x [M, K] with 2 <= M <= 16, the graph
decode step's projections at batch > 1 (batch 1 has kernels/gemv.py's GEMVs).

- ``skinny_linear(x, w, sizes=None)``: y [M, N] in x's dtype; with ``sizes`` the N output columns are split
  into consecutive segments, one tensor each (a launch serves two projections of one input whose weights are
  joined, as gemv_fused does at M = 1).

One program per BLOCK_N weight rows streams its [BLOCK_N, K] slice once, BLOCK_K columns at a time, against x
padded to BLOCK_M = 16 rows (tl.dot's smallest tile side), with fp32 accumulation in ascending K. The first
weight tile is loaded before the programmatic-dependent-launch wait (kernels/pdl.py): weights are no kernel's
output, so that load overlaps the previous kernel's tail.

Numerics: fp32 sums of exact 16-bit products (fp32 inputs take an exact fp32 dot, not TF32), cast once. The
sum order differs from cuBLAS's, so results agree with torch's to fp32 rounding, not to the bit. Identical input
rows give identical output rows (one MMA computes every row of the tile alike, and no block shape depends on
M): the decode pipeline's batch-rows gate relies on it. Under the Triton interpreter the dot takes fp32
operands (its 16-bit dot is wrong), with the same contracts.

Inadmissible inputs (``skinny_reason``) return ``fallback()`` (the caller's own path); wrong shapes raise
ValueError.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import pdl
from ._admit import device_reason, dtype_reason, interpreting
from ._mma import mma

MIN_M, MAX_M = 2, 16
BLOCK_M = 16
# Untuned beyond a few variants on an H200 (python -m evident.kernels.bench --skinny --variants); at DeepSeek-V2-Lite's q + kv_a
# (N = 3648, K = 2048) BLOCK_N = 32 gives 114 programs, about one per SM.
BLOCK_N = 32
BLOCK_K = 256
STAGES = 4
NUM_WARPS = 4
INTERPRETER_BLOCK_N = 256  # the interpreter runs programs one by one: fewer, taller ones, same results


@triton.jit
def _store(out, acc, n, m, mlive, lo, hi):
    """acc [BLOCK_N, BLOCK_M] holds columns n of rows m; the columns in [lo, hi) go to out [M, hi - lo]."""
    keep = ((n >= lo) & (n < hi))[:, None] & mlive[None, :]
    tl.store(out + m[None, :] * (hi - lo) + (n - lo)[:, None], acc.to(out.dtype.element_ty), mask=keep)


@triton.jit
def _skinny_kernel(x, w, o0, o1, e0, e1, M, stride_x, K: tl.constexpr, NSEG: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, F32: tl.constexpr,
                   PDL: tl.constexpr):
    """Program n: output columns n*BLOCK_N.. of every row; segment 0 holds columns [0, e0), segment 1 [e0, e1)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nlive = n < e1
    m = tl.arange(0, BLOCK_M)
    mlive = m < M
    cols = tl.arange(0, BLOCK_K)
    wt = tl.load(w + n[:, None] * K + cols[None, :], mask=nlive[:, None] & (cols < K)[None, :], other=0.0)
    pdl.wait(PDL)  # x, and the outputs' memory, may belong to the previous kernel
    xt = tl.load(x + m[:, None] * stride_x + cols[None, :], mask=mlive[:, None] & (cols < K)[None, :], other=0.0)
    acc = mma(wt, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), F32)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):  # ascending K slices, pipelined
        kk = k0 + cols
        kin = kk < K
        wt = tl.load(w + n[:, None] * K + kk[None, :], mask=nlive[:, None] & kin[None, :], other=0.0)
        xt = tl.load(x + m[:, None] * stride_x + kk[None, :], mask=mlive[:, None] & kin[None, :], other=0.0)
        acc = mma(wt, xt, acc, F32)
    _store(o0, acc, n, m, mlive, 0, e0)
    if NSEG == 2:
        _store(o1, acc, n, m, mlive, e0, e1)


def skinny_reason(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int] | None = None) -> str | None:
    """Admission predicate: None admits, else why the call takes the caller's path. Wrong shapes raise."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if sizes is not None and (sum(sizes) != w.shape[0] or min(sizes, default=0) <= 0):
        raise ValueError(f"segments {list(sizes)} do not split w's {w.shape[0]} rows into positive parts")
    checks = [device_reason(x, w), dtype_reason("w", w.dtype)]
    if x.dtype != w.dtype:
        checks.append(f"x dtype {x.dtype} differs from w dtype {w.dtype}")
    if x.stride(1) != 1 or not w.is_contiguous():
        checks.append("x's rows and w must be contiguous")
    if not MIN_M <= x.shape[0] <= MAX_M:
        checks.append(f"M={x.shape[0]} outside {MIN_M}..{MAX_M}")
    if sizes is not None and len(sizes) > 2:
        checks.append(f"{len(sizes)} segments, more than 2")
    if w.numel() >= 2**31 or w.shape[0] == 0:
        checks.append(f"w of {w.numel()} elements: empty or too large for 32-bit offsets")
    return next((c for c in checks if c), None)


def _launch(x, w, outs: Sequence[torch.Tensor], ends: Sequence[int]):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    block_n = INTERPRETER_BLOCK_N if interpreting() else BLOCK_N
    K = w.shape[1]
    return _skinny_kernel[(triton.cdiv(w.shape[0], block_n),)](
        x, w, outs[0], outs[-1], ends[0], ends[-1], x.shape[0], x.stride(0), K=K, NSEG=len(outs), BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(K))), STAGES=STAGES,
        F32=interpreting() or w.dtype == torch.float32, num_warps=NUM_WARPS, **pdl.flags(x.device))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int] | None = None, fallback=None):
    """x [M, K] @ w [N, K]^T in x's dtype, fp32 inside: one tensor [M, N], or with ``sizes`` a list of [M, size]
    tensors, one per segment of w's rows. Inadmissible inputs return ``fallback()``."""
    if skinny_reason(x, w, sizes):
        return fallback() if fallback is not None else _torch(x, w, sizes)
    parts = [w.shape[0]] if sizes is None else list(sizes)
    outs = [torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) for n in parts]
    _launch(x, w, outs, list(itertools.accumulate(parts)))
    return outs[0] if sizes is None else outs


def _torch(x, w, sizes):
    y = (x.float() @ w.float().T).to(x.dtype)
    return y if sizes is None else list(y.split(list(sizes), dim=1))


__all__ = ["MAX_M", "skinny_linear", "skinny_reason"]
