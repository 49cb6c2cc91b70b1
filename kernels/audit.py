"""Resource audit: registers, spills and shared memory of the kernels in COVERED, as Triton compiled them.

Each kernel is launched once at the shapes a model needs (its K values, its vocabulary) and the figures
are read from the compiled kernel Triton returns. Spilled registers go to local memory, the slow path a
memory-bound kernel cannot afford: the audit fails on any spill. The interpreter compiles nothing, so
on a CPU there is nothing to audit.

    python -m evident.kernels.audit --k 2048,1408 --vocab 102400 --hidden 2048
"""
from __future__ import annotations

import argparse
import json

import torch

from . import argmax, gemv, hc as hc_kernel, head, moe, norm, skinny


# What the audit compiles (the `kernel` of its rows), and what it does not, with why: the evidence says both.
COVERED = ("gemv_exact", "gemm_per_token", "gemv_fused", "skinny_linear", "add_rms_norm", "experts_gate_up",
           "experts_down", "pick_batch", "head_pick", "head_screen", "head_check", "hc_weights")
NOT_COVERED = {
    "mla (cache write, q latent, latent attention, out)": "not launched here: it needs a model's latent cache",
    "route (logits, select)": "not launched here",
    "moe sort (_rank_kernel) and combine (_combine_kernel)": "not launched here; the experts' matmuls are",
}


def resources(name: str, compiled, **shape) -> dict:
    """What Triton's compiled metadata says of one specialisation."""
    meta = compiled.metadata
    return {"kernel": name, **shape, "registers": int(compiled.n_regs), "spills": int(compiled.n_spills),
            "shared_bytes": int(meta.shared), "num_warps": int(meta.num_warps)}


def audit(ks: list[int], vocab: int, hidden: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
          experts: tuple[int, int, int, int] | None = None, limit: float = 0.0,
          hc: tuple[int, int] | None = None) -> list[dict]:
    """Compile and launch each kernel at the given K values and vocabulary; one row per specialisation. The
    batch-1 vocabulary projection and pick (``head_pick``, and its screened two, ``head_screen`` and ``head_check``)
    only at ``hidden``, the one K the step gives it (its weight is [vocab, K]: 2.2 GB at DeepSeek-V2-Lite's
    intermediate size).
    ``experts`` (hidden, moe_intermediate, n_routed_experts, experts_per_token) adds the graph decode step's
    routed-experts kernels at batch 1 and 8, with the swiglu clamp ``limit`` when > 0 (DeepSeek-V4); ``hc``
    (hc_mult, hc_sinkhorn_iters) adds DeepSeek-V4's hyper-connection weights kernel; the norm kernel is compiled at
    every K."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=device).to(dt)

    rows, n = [], 64
    name = f"{dtype}".removeprefix("torch.")
    for k in sorted(set(ks)):
        x, w = rand(k), rand(n, k)
        out = torch.empty(n, dtype=dtype, device=device)
        rows.append(resources("gemv_exact", gemv._launch(x, w, [out], [n], 1, gemv.BLOCK_K), K=k, dtype=name))
        xm = rand(gemv.MAX_M, k)
        outm = torch.empty(gemv.MAX_M, n, dtype=dtype, device=device)
        rows.append(resources("gemm_per_token", gemv._launch(xm, w, [outm], [n], gemv.MAX_M, gemv.BLOCK_K),
                              K=k, dtype=name))
        halves = [torch.empty(n // 2, dtype=dtype, device=device) for _ in range(2)]
        rows.append(resources("gemv_fused", gemv._launch(x, w, halves, [n // 2, n], 1, gemv.BLOCK_K),
                              K=k, dtype=name, segments=2))
        xs = rand(8, k)
        parts = [torch.empty(8, n // 2, dtype=dtype, device=device) for _ in range(2)]
        rows.append(resources("skinny_linear", skinny._launch(xs, w, parts, [n // 2, n]), K=k, dtype=name, M=8,
                              segments=2))
    # the DeepSeek-V4 C4 auxiliary shape: three segments with fp32/fp32/fp16 outputs
    x, w = rand(4096, dt=torch.float16), rand(96, 4096, dt=torch.float16)
    outs = [torch.empty(32, dtype=d, device=device) for d in (torch.float32, torch.float32, torch.float16)]
    rows.append(resources("gemv_fused", gemv._launch(x, w, outs, [32, 64, 96], 1, gemv.BLOCK_K),
                          K=4096, dtype="float16", segments=3))
    for k in sorted(set(ks)):
        x = rand(8, k)
        rows.append(resources("add_rms_norm", norm._launch(x, x, rand(k), 1e-6, torch.empty_like(x),
                                                           torch.empty_like(x)), K=k, dtype=name))
    if experts is not None:
        d, inter, e, top = experts
        w13, w2 = rand(e, 2 * inter, d), rand(e, d, inter)
        for b in (1, 8):
            ids = torch.stack([torch.randperm(e, generator=g, device=device)[:top] for _ in range(b)])
            route = moe.route(ids)  # as the step launches them: at batch 1 none, the pairs in their own order
            h = torch.empty(b, top, inter, dtype=dtype, device=device)
            rows.append(resources("experts_gate_up", moe._launch(rand(b, d), w13, h, route, top, True, ids, limit),
                                  K=d, B=b, dtype=name, **({"limit": limit} if limit else {})))
            y = torch.empty(b, top, d, dtype=torch.float32, device=device)
            rows.append(resources("experts_down", moe._launch(h, w2, y, route, top, False, ids), K=inter, B=b,
                                  dtype=name))
    if hc is not None:
        n, iters = hc
        w = (2 + n) * n
        outs = (torch.empty(8, n, device=device), torch.empty(8, n, device=device), torch.empty(8, n, n, device=device))
        compiled = hc_kernel._launch(rand(8, w, dt=torch.float32), rand(w, dt=torch.float32), rand(3, dt=torch.float32),
                                     outs, n, iters, 1e-6)
        rows.append(resources("hc_weights", compiled, n=n, iters=iters, dtype="float32"))
    for dt in (torch.float32, dtype):
        logits = rand(8, vocab, dt=dt)
        ids, margins = torch.empty(8, dtype=torch.int64, device=device), torch.empty(8, device=device)
        compiled = argmax._launch(logits, ids, margins, torch.zeros(1, dtype=torch.int32, device=device))
        rows.append(resources("pick_batch", compiled, V=vocab, dtype=f"{dt}".removeprefix("torch.")))
    x, w = rand(1, hidden), rand(vocab, hidden)
    counts = torch.zeros(head.counts_for(vocab), dtype=torch.int32, device=device)
    nxt, lengths = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
    outs = (torch.empty(1, vocab, dtype=dtype, device=device), torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(1, device=device))
    rows.append(resources("head_pick", head._launch(x, w, *outs, counts, nxt, lengths), K=hidden, V=vocab,
                          dtype=name))
    screen = head.screen_of(w)
    for kernel, compiled in zip(("head_screen", "head_check"), head._launch_screened(x, w, screen, *outs[1:], nxt,
                                                                                     lengths)):
        rows.append(resources(kernel, compiled, K=hidden, V=vocab, dtype=name))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", default="2048,1408,10944,512", help="comma-separated K values")
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--hidden", type=int, default=2048, help="the hidden size: the vocabulary projection's K")
    args = ap.parse_args(argv)
    rows = audit([int(k) for k in args.k.split(",")], args.vocab, args.hidden)
    print(json.dumps(rows, indent=1))
    if any(r["spills"] for r in rows):
        raise SystemExit("audit failed: some kernel spills registers")


if __name__ == "__main__":
    main()
