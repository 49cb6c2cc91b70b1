"""The engine's Triton decode path (the `triton` kernels setting): projections and the greedy pick through
the deterministic kernels of ``kernels/``.

- every bias-free projection of at most ``MAX_M`` rows goes through ``gemm_per_token``: a batched decode
  row is then computed exactly as the same row at batch 1;
- the two projections that read the same input (a module's ``paired()``: q and kv_a in attention, gate and up in
  an MLP) run as one ``gemv_fused`` launch for a single row, bitwise equal to running them apart;
- the greedy pick is ``pick_batch`` (lowest index on ties, as torch.argmax, and the top1 - top2 margin, in one
  launch): ``model.picks``, the engine's greedy pick, takes it where a model has it, else torch's.

A forward of more rows than ``gemm_per_token`` takes (a prefill: B prompts x their length) runs each MoE layer's
routed experts through ``kernels.moe.moe_experts`` (one grouped launch each for gate/up and down, every chosen
expert's weights read once per 16 of its tokens, no host sync) instead of the per-expert loop; the experts' weights
become views of its stacks (``stack_experts``), so nothing is held twice. Up to ``MAX_M`` rows (a decode step) the
loop's row kernels keep a batched row bitwise its batch-1 self.

With ``batched`` (the graph decode step), projections of more than ``max_rows`` rows, up to 16, go through
``kernels.skinny`` on the tensor cores instead (pairs as one launch too); rows then agree with batch 1 to fp32
rounding, not to the bit.

Inputs a kernel does not admit (more rows than ``MAX_M``, prefill of a long prompt, a CPU tensor
outside the Triton interpreter) take the plain torch path.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import Linear, MoE, Transformer


def stack_experts(moe: MoE, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E_local (+ S), 2I, D] (gate rows then up rows) and w2 [E_local (+ S), D, I]: this rank's routed experts in
    ascending id, then with ``shared`` the shared MLP cut into S slices of I (copies). The routed experts' weights
    become views of them, so nothing is held twice."""
    experts = [moe.experts[e] for e in sorted(moe.experts, key=int)]
    inter = experts[0].gate_proj.weight.shape[0]
    pairs = [(torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight) for m in experts]
    if shared and moe.shared_experts is not None:
        sh = moe.shared_experts
        for j in range(sh.gate_proj.weight.shape[0] // inter):
            rows = slice(j * inter, (j + 1) * inter)
            pairs.append((torch.cat([sh.gate_proj.weight[rows], sh.up_proj.weight[rows]]),
                          sh.down_proj.weight[:, rows]))
    w13, w2 = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
    for m, a, b in zip(experts, w13, w2):
        m.gate_proj.weight = nn.Parameter(a[:inter], requires_grad=False)
        m.up_proj.weight = nn.Parameter(a[inter:], requires_grad=False)
        m.down_proj.weight = nn.Parameter(b, requires_grad=False)
    return w13, w2


def experts_kernel(w13: torch.Tensor, w2: torch.Tensor, min_rows: int = 1, remap: torch.Tensor | None = None):
    """A MoE layer's ``experts_kernel`` over its stacks: forwards of at least ``min_rows`` tokens through
    ``moe_experts`` where it admits them (None: the layer's loop); ``remap``: router id -> stack row, -1 for another
    rank's expert (graph_decode._remap). Imports Triton here, as ``enable``."""
    from evident.kernels import moe

    def kernel(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        ids = idx if remap is None else remap[idx]
        if x.shape[0] < min_rows or moe.moe_reason(x, w13, w2, ids, weights):
            return None
        return moe.moe_experts(x, w13, w2, ids, weights)

    return kernel


def enable(model: Transformer, skip=lambda module: False, pick: bool = True, max_rows: int | None = None,
           batched: bool = False) -> Transformer:
    """Attach the kernels to ``model`` in place, except to modules for which ``skip`` is true; projections of
    more than ``max_rows`` rows keep torch's path, or with ``batched`` take kernels.skinny. Imports Triton here,
    not at engine import: the interpreter switch (TRITON_INTERPRET) is read when Triton compiles the kernels'
    decorators."""
    from evident.kernels import gemv
    from evident.kernels.argmax import pick_batch
    from evident.kernels.gemv import gemm_per_token, gemv_fused
    from evident.kernels.skinny import skinny_linear

    def wide(x: torch.Tensor) -> bool:
        return max_rows is not None and x.shape[0] > max_rows

    def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        if wide(x):
            return skinny_linear(x, w, fallback=lambda: None) if batched else None
        return gemm_per_token(x, w, fallback=lambda: None)  # None: the Linear takes its torch path

    # a forward of more rows than the row kernel takes: a prefill, its routed experts through kernels.moe
    joined_of = {}  # a stacked expert's gate/up module -> its w13 slice, already the pair's joined weight
    for module in list(model.modules()):
        if isinstance(module, MoE) and module.ep is None and not skip(module):
            w13, w2 = stack_experts(module)
            module.experts_kernel = experts_kernel(w13, w2, min_rows=gemv.MAX_M + 1)
            for e, m in zip(sorted(module.experts, key=int), w13):
                joined_of[id(module.experts[e])] = m

    def pair(a: Linear, b: Linear, joined: torch.Tensor | None = None):
        """A kernel for a(x), b(x), after re-seating both weights as views of one [Na + Nb, K] tensor (``joined``
        where they are views of it already)."""
        if a.bias is not None or b.bias is not None or a.weight.dtype != b.weight.dtype:
            return None
        sizes = [a.weight.shape[0], b.weight.shape[0]]
        if joined is None:
            joined = torch.cat([a.weight, b.weight])
            a.weight, b.weight = (nn.Parameter(v, requires_grad=False) for v in joined.split(sizes))

        def kernel(x: torch.Tensor):
            flat = x.reshape(-1, x.shape[-1])
            if batched and wide(flat):
                ys = skinny_linear(flat, joined, sizes, fallback=lambda: None)
            elif flat.shape[0] == 1:
                ys = gemv_fused(flat[0], joined, sizes, [x.dtype] * 2, fallback=lambda: None)
            else:
                return None
            return None if ys is None else tuple(y.view(*x.shape[:-1], -1) for y in ys)

        return kernel

    for module in model.modules():
        if skip(module):
            continue
        if isinstance(module, Linear):
            module.rows_kernel = rows
        if hasattr(module, "paired"):
            module.pair_kernel = pair(*module.paired(), joined=joined_of.get(id(module)))
    if pick:
        model.pick_kernel = pick_batch
    return model
