"""argmax_batch: the greedy pick over a batch of logits, deterministic and lowest index on ties.

Contract: equal to ``torch.argmax(logits, dim=-1)`` (the reference): the first maximal index of each row,
NaN counting as the maximum (the first NaN wins, as in torch). One program per row walks the vocabulary
in ascending blocks and keeps the first strict improvement, so the answer never depends on scheduling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._admit import device_reason, dtype_reason

BLOCK_V = 4096
NUM_WARPS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _argmax_kernel(logits, out, stride, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    none = V  # "no index yet": past every real index
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32) + none
    nan_idx = tl.full([], 0, tl.int32) + none
    for v0 in range(0, V, BLOCK_V):  # V is a compile-time constant (one vocabulary per model)
        idx = v0 + tl.arange(0, BLOCK_V)
        live = idx < V
        x = tl.load(logits + row * stride + idx, mask=live, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where(is_nan & live, idx, none), axis=0))
        x = tl.where(is_nan, float("-inf"), x)
        top = tl.max(x, axis=0)
        top_idx = tl.min(tl.where((x == top) & live, idx, none), axis=0)
        # a later block wins only by a strictly larger value; the first block always sets an index
        # (a row of -inf answers 0, as torch does)
        take = (top > best) | (best_idx == none)
        best = tl.where(take, top, best)
        best_idx = tl.where(take, top_idx, best_idx)
    tl.store(out + row, tl.where(nan_idx < none, nan_idx, best_idx).to(tl.int64))


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def argmax_reason(logits: torch.Tensor) -> str | None:
    """Admission predicate: None admits, else why the call falls back to torch.argmax."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return f"logits must be a non-empty [B, V] tensor, got {tuple(logits.shape)}"
    if logits.stride(1) != 1:
        return "logits rows must be contiguous"
    if logits.shape[1] >= 2**31 - 1 or logits.shape[0] * logits.stride(0) >= 2**31:
        return "too large for 32-bit offsets"
    return device_reason(logits) or dtype_reason("logits", logits.dtype, DTYPES)


def argmax_batch(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of [B, V] logits as int64 [B]."""
    if argmax_reason(logits):
        return argmax_reference(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch(logits, out)
    return out


def _launch(logits: torch.Tensor, out: torch.Tensor):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    return _argmax_kernel[(logits.shape[0],)](logits, out, logits.stride(0), V=logits.shape[1],
                                              BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
