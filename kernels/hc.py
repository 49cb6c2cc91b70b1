"""DeepSeek-V4's hyper-connection weights in one launch: from a token's mixing logits, the pre and post weights and
the Sinkhorn-normalised comb matrix.

Contract (transformers' DeepseekV4HyperConnection, fp32 throughout), per row of ``mix`` [N, (2 + n) n]:
- pre = sigmoid(mix[:n] * scale[0] + base[:n]) + eps;
- post = 2 sigmoid(mix[n:2n] * scale[1] + base[n:2n]);
- comb = softmax over each row of (mix[2n:] * scale[2] + base[2n:]) viewed [n, n], plus eps; then its columns
  normalised (x / (column sum + eps)), then ``iters - 1`` times its rows and its columns in turn.
The torch path is torch's softmax and sums (``hc_reference``); the kernel's exp and sums over n <= 16 elements may
differ from it in the last bits. Without a GPU it runs under Triton's interpreter. The torch path takes rows the
kernel does not admit (a CPU tensor outside the interpreter, n above MAX_N). The engine's torch path
(deepseek_v4.hyper_weights) is its own copy, as importing this module would import Triton with the engine;
tests/test_hc_kernel.py holds the two bitwise equal.

A decode step of the torch path spends ~6 launches on each Sinkhorn iteration (20 in DeepSeek-V4-Flash), twice a
layer; this is one (docs/decode-log.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from ._admit import device_reason

MAX_N = 16


def hc_reference(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """The torch path: (pre [..., n], post [..., n], comb [..., n, n]) from the mixing logits, fp32."""
    mix, base, scale = mix.float(), base.float(), scale.float()
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@triton.jit
def _hc_kernel(mix, base, scale, pre, post, comb, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
               EPS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = (2 + N) * N
    i = tl.arange(0, NP)
    live = i < N
    src = mix + row * W
    s0, s1, s2 = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)
    p = tl.sigmoid(tl.load(src + i, mask=live, other=0.0) * s0 + tl.load(base + i, mask=live, other=0.0)) + EPS
    q = 2 * tl.sigmoid(tl.load(src + N + i, mask=live, other=0.0) * s1 + tl.load(base + N + i, mask=live, other=0.0))
    tl.store(pre + row * N + i, p, mask=live)
    tl.store(post + row * N + i, q, mask=live)
    r, c = i[:, None], i[None, :]
    both = live[:, None] & live[None, :]
    z = tl.load(src + 2 * N + r * N + c, mask=both, other=0.0) * s2 + tl.load(base + 2 * N + r * N + c, mask=both,
                                                                               other=0.0)
    z = tl.where(both, z, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    m = tl.where(both, e / tl.sum(e, axis=1)[:, None] + EPS, 0.0)
    m = m / (tl.sum(m, axis=0)[None, :] + EPS)
    for _ in tl.static_range(ITERS - 1):
        m = m / (tl.sum(m, axis=1)[:, None] + EPS)
        m = m / (tl.sum(m, axis=0)[None, :] + EPS)
    tl.store(comb + row * N * N + r * N + c, m, mask=both)


def _check(mix, base, scale, n: int, iters: int):
    if n < 1 or iters < 1 or mix.shape[-1] != (2 + n) * n or tuple(base.shape) != ((2 + n) * n,) \
            or tuple(scale.shape) != (3,):
        raise ValueError(f"expected mix [..., {(2 + n) * n}], base [{(2 + n) * n}], scale [3] and iters >= 1 for "
                         f"n={n}, got {tuple(mix.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}, iters={iters}")


def hc_reason(mix, base, scale, n: int, iters: int) -> str | None:
    """Admission predicate of hc_weights: None admits, else why it takes the torch path."""
    _check(mix, base, scale, n, iters)
    if n > MAX_N:
        return f"n={n} above {MAX_N}"
    if not all(t.dtype == torch.float32 for t in (mix, base, scale)):
        return "mix, base and scale must be fp32"
    return device_reason(mix, base, scale)


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """(pre, post, comb) of hc_reference, one program a row."""
    if hc_reason(mix, base, scale, n, iters):
        return hc_reference(mix, base, scale, n, iters, eps)
    lead = mix.shape[:-1]
    flat = mix.reshape(-1, mix.shape[-1]).contiguous()
    rows = flat.shape[0]
    pre = torch.empty(rows, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=mix.device)
    _launch(flat, base.contiguous(), scale.contiguous(), (pre, post, comb), n, iters, eps)
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def _launch(mix, base, scale, outs, n: int, iters: int, eps: float):
    """One launch over mix's rows into outs (pre, post, comb); returns Triton's compiled kernel (None under the
    interpreter)."""
    return _hc_kernel[(mix.shape[0],)](mix, base, scale, *outs, N=n, NP=max(2, triton.next_power_of_2(n)),
                                       ITERS=iters, EPS=float(eps), num_warps=1, **pdl.flags(mix.device))


__all__ = ["MAX_N", "hc_weights", "hc_reference", "hc_reason"]
