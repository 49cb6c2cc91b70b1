"""The tensor-core tile product the few-row kernels share (kernels/moe.py's experts, kernels/skinny.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(wt, xt, acc, F32: tl.constexpr):
    """acc [BLOCK_N, G] += wt [BLOCK_N, BLOCK_K] @ xt [G, BLOCK_K]^T, fp32 accumulation. F32: fp32 operands and an
    exact fp32 dot (fp32 inputs, where TF32 would be the default; and the interpreter, whose dot mishandles bf16)."""
    if F32:
        acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(wt, tl.trans(xt), acc)
    return acc
