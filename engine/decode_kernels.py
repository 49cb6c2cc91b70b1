"""The engine's Triton decode path (the `triton` kernels setting): projections and the greedy pick through
the deterministic kernels of ``kernels/``.

- every bias-free projection of at most ``MAX_M`` rows goes through ``gemm_per_token``: a batched decode
  row is then computed exactly as the same row at batch 1;
- the two projections that read the same input (a module's ``paired()``: q and kv_a in attention, gate and up in
  an MLP) run as one ``gemv_fused`` launch for a single row, bitwise equal to running them apart;
- the greedy pick is ``pick_batch`` (lowest index on ties, as torch.argmax, and the top1 - top2 margin, in one
  launch): ``model.picks``, the engine's greedy pick, takes it where a model has it, else torch's.

With ``batched`` (the graph decode step), projections of more than ``max_rows`` rows, up to 16, go through
``kernels.skinny`` on the tensor cores instead (pairs as one launch too); rows then agree with batch 1 to fp32
rounding, not to the bit.

Inputs a kernel does not admit (more rows than ``MAX_M``, prefill of a long prompt, a CPU tensor
outside the Triton interpreter) take the plain torch path.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import Linear, Transformer


def enable(model: Transformer, skip=lambda module: False, pick: bool = True, max_rows: int | None = None,
           batched: bool = False) -> Transformer:
    """Attach the kernels to ``model`` in place, except to modules for which ``skip`` is true; projections of
    more than ``max_rows`` rows keep torch's path, or with ``batched`` take kernels.skinny. Imports Triton here,
    not at engine import: the interpreter switch (TRITON_INTERPRET) is read when Triton compiles the kernels'
    decorators."""
    from evident.kernels.argmax import pick_batch
    from evident.kernels.gemv import gemm_per_token, gemv_fused
    from evident.kernels.skinny import skinny_linear

    def wide(x: torch.Tensor) -> bool:
        return max_rows is not None and x.shape[0] > max_rows

    def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        if wide(x):
            return skinny_linear(x, w, fallback=lambda: None) if batched else None
        return gemm_per_token(x, w, fallback=lambda: None)  # None: the Linear takes its torch path

    def pair(a: Linear, b: Linear):
        """A kernel for a(x), b(x), after re-seating both weights as views of one [Na + Nb, K] tensor."""
        if a.bias is not None or b.bias is not None or a.weight.dtype != b.weight.dtype:
            return None
        joined = torch.cat([a.weight, b.weight])
        sizes = [a.weight.shape[0], b.weight.shape[0]]
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
            module.pair_kernel = pair(*module.paired())
    if pick:
        model.pick_kernel = pick_batch
    return model
