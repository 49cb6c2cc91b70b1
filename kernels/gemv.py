"""Deterministic decode projections: one Triton kernel behind gemv_exact, gemv_fused and gemm_per_token.

Every output element is one weight row dotted with one input row: fp32 products summed over a fixed
BLOCK_K slice (one tree reduction whose shape depends only on the compile-time block sizes), and the
slices added in ascending K order. Nothing in that order depends on N, on the row's position, on which
segment it belongs to or on M, which is what makes the contracts hold:

- ``gemv_exact``: y = W x, M=1, fp32 accumulation in that fixed order, output dtype per call.
- ``gemv_fused``: several GEMVs on one input in one launch over concatenated weight rows, an output
  dtype per segment; bitwise equal to ``gemv_exact`` per segment.
- ``gemm_per_token``: [M, K] x W^T for small M; row m is bitwise equal to ``gemv_exact(x[m], W)``, so
  batched decode keeps row-wise parity with batch 1.

Inadmissible inputs (see ``*_reason``) fall back to the torch reference while keeping the contract:
fused falls back to gemv_exact per segment, per-token to gemv_exact per row.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import pdl
from ._admit import FLOATS, device_reason, dtype_reason, interpreting

BLOCK_K = 1024  # the contract's reduction slice
# One row per one-warp program: the fastest of BLOCK_N 1-16 x 1-8 warps on an H200 at K=4096,
# N=2624 (kernels/bench.py --variants; with all of a row's loads issued up front it is no faster)
BLOCK_N = 1
NUM_WARPS = 1
# The interpreter runs programs one by one in Python and sums each row with numpy independently of the
# block height, so it takes taller blocks: same results, far fewer programs.
INTERPRETER_BLOCK_N = 64
MAX_K = 16384  # the K loop is unrolled at compile time
MAX_M = 16
MAX_SEGMENTS = 4


@triton.jit
def _store(out, acc, rows, lo, hi, m):
    keep = (rows >= lo) & (rows < hi)
    tl.store(out + m * (hi - lo) + (rows - lo), acc.to(out.dtype.element_ty), mask=keep)


@triton.jit
def first_slice(w, rows, live, stride_w, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """W's first BLOCK_K columns of ``rows`` (live: in range): loaded before a PDL wait, weights being no kernel's
    output."""
    cols = tl.arange(0, BLOCK_K)
    return tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=live[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def row_dots(x, w, w0, rows, live, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 dots of W's ``rows`` with the input row x: each BLOCK_K slice's products summed, the slices added in
    ascending K order (the contract's order); w0 is the first slice (``first_slice``)."""
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # fixed ascending order over K slices
        kk = k0 + cols
        xk = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
        if k0 == 0:
            wk = w0
        else:
            wk = tl.load(w + rows[:, None] * stride_w + kk[None, :], mask=live[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.sum(wk.to(tl.float32) * xk[None, :], axis=1)
    return acc


@triton.jit
def _rows_kernel(x, w, o0, o1, o2, o3, e0, e1, e2, e3, stride_x, stride_w,
                 K: tl.constexpr, NSEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (n, m): rows n*BLOCK_N.. of W against input row m. Segment s holds rows [e_{s-1}, e_s)."""
    m = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = e3 if NSEG == 4 else (e2 if NSEG == 3 else (e1 if NSEG == 2 else e0))
    live = rows < n_rows
    # The first weight slice is loaded before waiting on the previous kernel: under programmatic dependent launch
    # this load overlaps that kernel's tail.
    w0 = first_slice(w, rows, live, stride_w, K, BLOCK_K)
    # Under programmatic dependent launch (kernels/pdl.py) x and the outputs' memory may belong to the previous
    # kernel: wait for it here. On an H200 this takes a stream of gemv_fused calls from 7.09 to 5.37 µs a call
    # (prefetching 2 or 4 slices, or letting the next kernel start before the wait, was slower: KERNELS.md).
    pdl.wait(PDL)
    acc = row_dots(x + m * stride_x, w, w0, rows, live, stride_w, K, BLOCK_N, BLOCK_K)
    _store(o0, acc, rows, 0, e0, m)
    if NSEG > 1:
        _store(o1, acc, rows, e0, e1, m)
    if NSEG > 2:
        _store(o2, acc, rows, e1, e2, m)
    if NSEG > 3:
        _store(o3, acc, rows, e2, e3, m)


def gemv_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch reference: y = W x in fp32, cast to out_dtype (default x's dtype)."""
    return torch.mv(w.float(), x.float()).to(out_dtype or x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor, x_dims: int) -> None:
    """Wrong shapes are errors, not fallbacks."""
    if w.dim() != 2 or x.dim() != x_dims or x.shape[-1] != w.shape[1]:
        want = "[K]" if x_dims == 1 else "[M, K]"
        raise ValueError(f"expected x {want} and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")


def _common_reason(x: torch.Tensor, w: torch.Tensor, out_dtypes: Sequence[torch.dtype], block_k: int) -> str | None:
    K = w.shape[1]
    checks = [device_reason(x, w), dtype_reason("w", w.dtype)]
    checks += [dtype_reason("out", d) for d in out_dtypes]
    if x.dtype != w.dtype:
        checks.append(f"x dtype {x.dtype} differs from w dtype {w.dtype}")
    if x.stride(-1) != 1 or w.stride(1) != 1:
        checks.append("x and w rows must be contiguous")
    if not 1 <= K <= MAX_K:
        checks.append(f"K={K} outside 1..{MAX_K}")
    if w.shape[0] == 0 or w.shape[0] * w.stride(0) >= 2**31:
        checks.append(f"N={w.shape[0]} empty or too large for 32-bit offsets")
    if block_k <= 0 or block_k & (block_k - 1):
        checks.append(f"block_k={block_k} is not a power of two")
    return next((c for c in checks if c), None)


def gemv_reason(x, w, out_dtype=None, block_k: int = BLOCK_K) -> str | None:
    """Admission predicate of gemv_exact: None admits, else why it falls back."""
    _check(x, w, 1)
    return _common_reason(x, w, [out_dtype or x.dtype], block_k)


def _launch(x, w, outs: Sequence[torch.Tensor], ends: Sequence[int], rows: int, block_k: int):
    """One launch of the shared kernel; returns Triton's compiled kernel (None under the interpreter)."""
    nseg = len(outs)
    outs = list(outs) + [outs[0]] * (MAX_SEGMENTS - nseg)
    ends = list(ends) + [ends[-1]] * (MAX_SEGMENTS - nseg)
    K = w.shape[1]
    block_n = INTERPRETER_BLOCK_N if interpreting() else BLOCK_N
    grid = (triton.cdiv(w.shape[0], block_n), rows)
    return _rows_kernel[grid](x, w, *outs, *ends, x.stride(0) if x.dim() == 2 else 0, w.stride(0),
                              K=K, NSEG=nseg, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(K)),
                              num_warps=NUM_WARPS, **pdl.flags(x.device))


def gemv_exact(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               block_k: int = BLOCK_K) -> torch.Tensor:
    """y[N] = w[N, K] @ x[K] with fp32 accumulation in fixed BLOCK_K order, cast to out_dtype (default x's)."""
    if gemv_reason(x, w, out_dtype, block_k):
        return gemv_reference(x, w, out_dtype)
    out = torch.empty(w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, w, [out], [w.shape[0]], 1, block_k)
    return out


def fused_reason(x, w, sizes: Sequence[int], out_dtypes: Sequence[torch.dtype], block_k: int = BLOCK_K) -> str | None:
    """Admission predicate of gemv_fused."""
    _check(x, w, 1)
    if len(sizes) != len(out_dtypes) or sum(sizes) != w.shape[0] or min(sizes, default=0) <= 0:
        raise ValueError(f"segments {list(sizes)} with dtypes {list(out_dtypes)} do not split w's "
                         f"{w.shape[0]} rows into positive parts, one dtype each")
    if len(sizes) > MAX_SEGMENTS:
        return f"{len(sizes)} segments, more than {MAX_SEGMENTS}"
    return _common_reason(x, w, out_dtypes, block_k)


def gemv_fused(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int], out_dtypes: Sequence[torch.dtype],
               block_k: int = BLOCK_K, fallback=None) -> list[torch.Tensor]:
    """GEMVs of x against consecutive row segments of w (sizes), in one launch; segment s in out_dtypes[s].
    Inadmissible inputs return ``fallback()`` when given (the caller's own path), else gemv_exact per segment."""
    if fused_reason(x, w, sizes, out_dtypes, block_k):
        if fallback is not None:
            return fallback()
        return [gemv_exact(x, part, d, block_k) for part, d in zip(w.split(list(sizes)), out_dtypes)]
    outs = [torch.empty(n, dtype=d, device=x.device) for n, d in zip(sizes, out_dtypes)]
    ends = list(itertools.accumulate(sizes))
    _launch(x, w, outs, ends, 1, block_k)
    return outs


def per_token_reason(x, w, out_dtype=None, block_k: int = BLOCK_K) -> str | None:
    """Admission predicate of gemm_per_token."""
    _check(x, w, 2)
    if not 1 <= x.shape[0] <= MAX_M:
        return f"M={x.shape[0]} outside 1..{MAX_M}"
    return _common_reason(x, w, [out_dtype or x.dtype], block_k)


def gemm_per_token(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                   block_k: int = BLOCK_K, fallback=None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ w[N, K]^T, each row computed exactly as gemv_exact computes it alone.
    Inadmissible inputs return ``fallback()`` when given (the caller's own path), else gemv_exact per row."""
    if per_token_reason(x, w, out_dtype, block_k):
        if fallback is not None:
            return fallback()
        return torch.stack([gemv_exact(row, w, out_dtype, block_k) for row in x]) if len(x) else \
            torch.empty(0, w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, w, [out], [w.shape[0]], x.shape[0], block_k)
    return out


__all__ = ["BLOCK_K", "FLOATS", "gemv_exact", "gemv_fused", "gemm_per_token", "gemv_reference",
           "gemv_reason", "fused_reason", "per_token_reason"]
