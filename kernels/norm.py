"""RMSNorm, with the residual add before it, in one launch per call (the graph decode step's norms).

Numerics as the engine's ``RMSNorm`` (and HF's): the residual sum is rounded to the model dtype first; the
norm runs in fp32 (mean of squares, rsqrt), is rounded to the model dtype, then multiplied by the weight and
rounded again. Only the order of the mean's additions differs from torch's reduction, so results agree to
fp32 rounding, not to the bit. Eager torch spends about seven launches on one RMSNorm and one on the add:
in a decode step of 27 layers that is ~600 launches this kernel takes down to ~80.

- ``rms_norm(x, weight, eps)``: y = weight * norm(x)
- ``embed_rms_norm(tokens, table, weight, eps)``: (h, y) with h = table[tokens] (the embedding's rows, exact), y =
  weight * norm(h): a decode step's first launch, in place of the embedding's and the first norm's
- ``add_rms_norm(x, delta, weight, eps)``: (h, y) with h = x + delta, y = weight * norm(h); a delta in another
  dtype (an fp32 MoE sum) is rounded to x's dtype first, as ``x + delta.to(x.dtype)``
- ``moe_add_rms_norm(x, y, slot_weights, weight, eps)``: the same with delta = sum over slots s ascending of
  slot_weights[b, s] * y[b, s] in fp32 (the routed experts' combine, fused: one launch instead of three)

Inputs a kernel does not admit (see ``norm_reason``) take the torch path, with the same results.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from ._admit import device_reason, dtype_reason

MAX_D = 16384  # one row per program, held whole in registers
WARPS = 16  # a row of 1024 or more, shorter ones one warp: 4 took the b1 step 1.75 -> 1.80 ms (docs/decode-log.md v11)


@triton.jit
def _norm_kernel(x, delta, slot_w, w, h_out, y_out, tokens, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                 ADD: tl.constexpr, SLOTS: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < D
    src = tl.load(tokens + row) if GATHER else row  # GATHER: x is an embedding table, the row its token's
    v = tl.load(x + src * D + cols, mask=keep, other=0.0)
    if GATHER:
        tl.store(h_out + row * D + cols, v, mask=keep)
    if ADD:  # the residual sum, rounded to the model dtype as torch's add does, then stored
        if SLOTS == 0:
            d = tl.load(delta + row * D + cols, mask=keep, other=0.0).to(tl.float32)
        else:  # delta [B, SLOTS, D] fp32, weighted per slot and summed in ascending slot order
            d = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SLOTS):
                ws = tl.load(slot_w + row * SLOTS + s)
                d += ws * tl.load(delta + (row * SLOTS + s) * D + cols, mask=keep, other=0.0)
        d = d.to(h_out.dtype.element_ty).to(tl.float32)
        v = (v.to(tl.float32) + d).to(h_out.dtype.element_ty)
        tl.store(h_out + row * D + cols, v, mask=keep)
    v = v.to(tl.float32)
    normed = v * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    normed = normed.to(y_out.dtype.element_ty).to(tl.float32)
    wt = tl.load(w + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(y_out + row * D + cols, (wt * normed).to(y_out.dtype.element_ty), mask=keep)


def _torch_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    v = h.float()
    return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def norm_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Admission predicate: None admits, else why the call takes the torch path."""
    if x.shape[-1] != weight.shape[0] or weight.dim() != 1:
        raise ValueError(f"expected x [..., D] and weight [D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    checks = [device_reason(x, weight), dtype_reason("x", x.dtype), dtype_reason("weight", weight.dtype)]
    if x.dtype != weight.dtype:
        checks.append(f"x dtype {x.dtype} differs from weight dtype {weight.dtype}")
    if not x.is_contiguous():
        checks.append("x must be contiguous")
    if not 1 <= x.shape[-1] <= MAX_D:
        checks.append(f"D={x.shape[-1]} outside 1..{MAX_D}")
    return next((c for c in checks if c), None)


def _launch(x, delta, weight, eps, h_out, y_out, slot_w=None, tokens=None):
    """One launch; returns Triton's compiled kernel (None under the interpreter)."""
    D = x.shape[-1]
    slots = 0 if slot_w is None else slot_w.shape[-1]
    rows = x.numel() // D if tokens is None else tokens.numel()
    return _norm_kernel[(rows,)](x, delta, slot_w, weight, h_out, y_out, tokens, eps, D=D,
                                 BLOCK=triton.next_power_of_2(D), ADD=delta is not None, SLOTS=slots,
                                 GATHER=tokens is not None, num_warps=WARPS if D >= 1024 else 1, **pdl.flags(x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if norm_reason(x, weight):
        return _torch_norm(x, weight, eps)
    y = torch.empty_like(x)
    _launch(x, None, weight, eps, x, y)
    return y


def embed_rms_norm(tokens: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """tokens [B] int64, table [V, D] -> (h, norm(h)) with h = table[tokens], [B, D] each."""
    if tokens.dim() != 1:
        raise ValueError(f"expected tokens [B], got {tuple(tokens.shape)}")
    if norm_reason(table, weight) or tokens.dtype != torch.int64 or device_reason(tokens, table):
        h = torch.nn.functional.embedding(tokens, table)
        return h, rms_norm(h, weight, eps)
    h, y = (torch.empty(tokens.shape[0], table.shape[1], dtype=table.dtype, device=table.device) for _ in range(2))
    _launch(table, None, weight, eps, h, y, tokens=tokens)
    return h, y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    if delta.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and delta {tuple(delta.shape)} differ in shape")
    if norm_reason(x, weight) or dtype_reason("delta", delta.dtype) or device_reason(x, delta) \
            or not delta.is_contiguous():
        h = x + delta.to(x.dtype)
        return h, _torch_norm(h, weight, eps)
    h, y = torch.empty_like(x), torch.empty_like(x)
    _launch(x, delta, weight, eps, h, y)
    return h, y


def moe_add_rms_norm(x: torch.Tensor, y: torch.Tensor, slot_weights: torch.Tensor, weight: torch.Tensor, eps: float):
    """x [B, D], y [B, S, D] fp32 (kernels.moe's per-slot outputs), slot_weights [B, S] fp32 -> (h, norm(h)) with
    h = x + (sum over s of slot_weights[b, s] * y[b, s]).to(x.dtype)."""
    if y.dim() != 3 or x.dim() != 2 or y.shape[0] != x.shape[0] or y.shape[2] != x.shape[1] \
            or tuple(slot_weights.shape) != tuple(y.shape[:2]):
        raise ValueError(f"expected x [B, D], y [B, S, D] and slot weights [B, S], got {tuple(x.shape)}, "
                         f"{tuple(y.shape)} and {tuple(slot_weights.shape)}")
    if norm_reason(x, weight) or y.dtype != torch.float32 or slot_weights.dtype != torch.float32 \
            or not (y.is_contiguous() and slot_weights.is_contiguous()) or device_reason(x, y, slot_weights):
        delta = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for s in range(y.shape[1]):  # ascending slots
            delta = delta + slot_weights[:, s, None] * y[:, s]
        return add_rms_norm(x, delta.contiguous(), weight, eps)
    h, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, y, weight, eps, h, out, slot_weights)
    return h, out


__all__ = ["rms_norm", "embed_rms_norm", "add_rms_norm", "moe_add_rms_norm", "norm_reason"]
