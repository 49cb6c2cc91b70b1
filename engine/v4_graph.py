"""DeepSeek-V4's graph decode path (the `graph` kernels setting): the model's own decode step, which has no host
synchronisation (``engine/deepseek_v4.py``'s static cache), captured once per (batch, cache length) in a CUDA graph
and replayed.

What changes against the torch path:
- the hyper-connections' pre, post and Sinkhorn comb weights are one ``kernels.hc`` launch (the torch path spends
  about 6 launches on each of 20 Sinkhorn iterations);
- the routed experts go through ``kernels.moe`` (the swiglu clamp in the kernel; up to ``kernels.moe.MAX_B`` rows:
  a longer prefill keeps the torch loop);
- the bias-free projections of a decode step go through ``kernels.gemv`` at batch 1 and ``kernels.skinny`` at 2-16
  rows (``engine/decode_kernels.py``), q_a_proj and kv_proj of a layer as one fused launch; the vocabulary
  projection stays cuBLAS's;
- with ``fuse_aux`` (the default), at batch 1 a compressed layer's projections that read the layer input beside
  q_a_proj and kv_proj (the C4 auxiliary GEMVs: the compressor's kv_proj and gate_proj and, in a CSA layer, the
  indexer's kv_proj, gate_proj and weights_proj) run as one ``gemv_fused`` launch on an auxiliary stream,
  overlapped with q_a_proj and kv_proj on the main stream and joined before their first use. Off, they run one
  ``gemv`` launch each on the main stream: the same kernel's rows, so both are bitwise equal
  (tests/test_v4_graph.py).

Without CUDA the step runs eagerly, the kernels through Triton's interpreter (or their torch fallbacks).
"""
from __future__ import annotations

import torch
from torch import nn

from . import decode_kernels
from .config import SLIDING
from .graph_decode import CapturedStep, Held
from .deepseek_v4 import V4Cache, V4Transformer


class AuxRoute:
    """One layer's projections of a decode step at batch 1: q_a_proj and kv_proj on the main stream, the auxiliary
    projections fused on ``stream`` (or apart on the main stream when ``fused`` is off). Their weights are re-seated
    as row views of one tensor, so nothing is held twice."""

    def __init__(self, attn, gemv, stream):
        self.attn, self.gemv, self.stream, self.fused = attn, gemv, stream, True
        self.mods = attn.aux_modules()
        self.widths = [m.weight.shape[0] for m in self.mods]
        # gemv_fused takes up to 4 segments: each kv/gate pair is one (the same output dtype), weights_proj one
        self.pairs = [self.widths[i:i + 2] for i in range(0, len(self.widths), 2)]
        self.segments = [sum(p) for p in self.pairs]
        self.weight = torch.cat([m.weight for m in self.mods])
        for m, v in zip(self.mods, self.weight.split(self.widths)):
            m.weight = nn.Parameter(v, requires_grad=False)

    @torch.compiler.disable  # streams stay out of torch.compile's graph: the compiled step breaks around this
    def __call__(self, x: torch.Tensor):
        if x.shape[0] * x.shape[1] != 1:
            return None  # prefill, or a batch: the module's own projections
        if not self.fused:
            return None  # the module's own projections, one launch each
        a = self.attn
        flat = x.reshape(-1)
        main = torch.cuda.current_stream(x.device) if self.stream is not None else None
        if main is not None:
            self.stream.wait_stream(main)  # fork: the fused GEMV reads this step's input
            with torch.cuda.stream(self.stream):
                segs = self.gemv.gemv_fused(flat, self.weight, self.segments, [x.dtype] * len(self.segments))
        else:
            segs = self.gemv.gemv_fused(flat, self.weight, self.segments, [x.dtype] * len(self.segments))
        q_a, kv = a.projections(x)
        if main is not None:
            # join before the first use. The outputs come from the aux stream's pool; the next fork waits for the
            # main stream's work so far, their reads included, so the pool cannot hand them out again too early
            main.wait_stream(self.stream)
        aux = [part for seg, p in zip(segs, self.pairs) for part in seg.split(p)]
        return q_a, kv, [t.view(1, 1, -1) for t in aux]


class V4GraphDecode(CapturedStep):
    """Attached to a V4Transformer by ``enable``; ``generate`` asks it for a cache and steps through it."""

    def __init__(self, model: V4Transformer, fuse_aux: bool = True, compiled: bool | None = None):
        # Triton is imported here, not with the engine: TRITON_INTERPRET is read when the kernels' decorators run
        from evident.kernels import gemv, hc, moe

        self.model, self.ep = model, None
        self.bucket = 256  # a new prompt length would otherwise be a new cache shape: a new capture and compile
        decode_kernels.enable(model, skip=lambda mod: mod is model.lm_head, max_rows=1, batched=True)
        w = model.embed_tokens.weight
        self.graphs = torch.cuda.is_available() and w.is_cuda
        # the step's torch ops fused by torch.compile (inductor) before the capture, on a GPU only; the project's
        # Triton kernels are called as they are, outside its graphs (inductor re-emits a traced kernel without the
        # helpers it calls)
        self.compiled = self.graphs if compiled is None else compiled
        self.forward = torch.compile(model.forward, dynamic=False) if self.compiled else model.forward
        outside = torch.compiler.disable
        stream = torch.cuda.Stream(device=w.device) if self.graphs else None
        self.routes = [AuxRoute(layer.self_attn, gemv, stream) for layer in model.layers
                       if layer.self_attn.kind != SLIDING]
        for r in self.routes:
            r.attn.project = r
        self.caches: dict[tuple[int, int], Held] = {}
        self.fuse(fuse_aux)

        def experts_kernel(x, w13, w2, idx, weights, limit):
            if x.shape[0] > moe.MAX_B:
                return None  # a prefill: the torch loop reads each chosen expert once
            return moe.moe_experts(x, w13, w2, idx, weights, limit=limit)

        for layer in model.layers:
            layer.mlp.experts_kernel = outside(experts_kernel)
            layer.attn_hc.weights_kernel = layer.ffn_hc.weights_kernel = outside(hc.hc_weights)
        for m in model.modules():
            for hook in ("rows_kernel", "pair_kernel"):
                if getattr(m, hook, None) is not None:
                    setattr(m, hook, outside(getattr(m, hook)))

    def fuse(self, on: bool) -> None:
        """The C4 auxiliary projections fused on the auxiliary stream (on) or apart on the main stream (off)."""
        for r in self.routes:
            r.fused = on
        for held in self.caches.values():  # a captured graph holds the other route
            held.widths.clear()
            held.last.clear()

    def _step(self, cache: V4Cache, tokens: torch.Tensor) -> torch.Tensor:
        # the warm-up step and the replay write the same ring slots and entries with the same values: only the
        # lengths (and the inputs, which the pick overwrites) need putting back (CapturedStep.step)
        return self.forward(tokens[:, None], cache, checked=False)[:, -1]


def enable(model: V4Transformer, fuse_aux: bool = True, compiled: bool | None = None) -> V4Transformer:
    """Attach the graph decode path to ``model`` in place (``generate`` then decodes through it)."""
    model.graph_decode = V4GraphDecode(model, fuse_aux, compiled)
    return model


__all__ = ["V4GraphDecode", "AuxRoute", "enable"]
