"""Weights asked into the L2 cache ahead of their use, to stay there: the graph decode step's next-layer prefetch.

At batch 1 a layer's attention launches leave HBM mostly idle, while the next layer's first read, its q and kv_a
projections, waits on HBM. A launch of the attention asks those weights into L2 (``ask``, before its PDL wait: weights
only), one bulk prefetch (``cp.async.bulk.prefetch.L2``) a thread a region, with an evict_last policy, so that the
experts' stream between (loaded evict_first, kernels/moe.py) leaves them there. A prefetch changes no value; under the
interpreter, or for a region it cannot take, none is issued. Measured: docs/decode-log.md v25.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._admit import interpreting

REGIONS = 2  # tensors a launch may ask for
ALIGN = 16  # a bulk prefetch's address and size are multiples of 16 bytes


@triton.jit
def _ask_one(base, nbytes, t, CHUNK: tl.constexpr):
    start = t * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
        "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def ask(r0, n0, r1, n1, program, N: tl.constexpr, THREADS: tl.constexpr, CHUNK0: tl.constexpr,
        CHUNK1: tl.constexpr):
    """This program's share of the N (0-2) regions (byte pointers r, n bytes each), one chunk a thread: thread t of
    program p takes bytes [(p * THREADS + t) * CHUNK, +CHUNK) of each."""
    if N > 0:
        t = program.to(tl.int64) * THREADS + tl.arange(0, THREADS)
        _ask_one(r0, n0, t, CHUNK0)
        if N > 1:
            _ask_one(r1, n1, t, CHUNK1)


def args(tensors, programs: int, warps: int, fallback: torch.Tensor) -> dict:
    """``ask``'s arguments for a launch of ``programs`` programs of ``warps`` warps: the tensors (at most REGIONS)
    that a prefetch can take (CUDA, contiguous, 16-byte aligned and sized), each split evenly among the threads;
    ``fallback`` stands for an unused pointer."""
    threads = 32 * warps
    regions = [] if interpreting() else [
        t for t in tensors
        if t.is_cuda and t.is_contiguous() and t.data_ptr() % ALIGN == 0 and t.nbytes % ALIGN == 0 and t.nbytes]
    regions = [t.view(torch.uint8) for t in regions[:REGIONS]]
    chunks = [triton.cdiv(triton.cdiv(t.nbytes, programs * threads), ALIGN) * ALIGN for t in regions]
    pad = [(fallback, 0, ALIGN)] * (REGIONS - len(regions))
    (r0, n0, c0), (r1, n1, c1) = [(t, t.nbytes, c) for t, c in zip(regions, chunks)] + pad
    return dict(r0=r0, n0=n0, r1=r1, n1=n1, N=len(regions), THREADS=threads, CHUNK0=c0, CHUNK1=c1)
