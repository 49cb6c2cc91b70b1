"""The engine's graph decode path (the `graph` kernels setting): one decode step of every batch row, static
shapes, no host synchronisation, captured once per (batch, cache length) in a CUDA graph and replayed.

- MLA in the latent space: kv_b_proj's up-projections are absorbed into the query (W_UK) and the output
  (W_UV), so attention reads the compressed cache itself, kv_lora_rank + rope dims per token, over the
  whole static cache with a position mask (no per-step slicing: the graph's shapes never change);
- routed experts through ``kernels.moe.moe_experts`` (each chosen expert's weights read once per step,
  whatever the number of rows that chose it), on weights stacked per layer: the experts' parameters are
  re-seated as views of the stacks, so nothing is held twice;
- every RMSNorm, with the residual add before it, is one launch (``kernels.norm``): eager torch spends
  about eight on each;
- the step reads its positions from the cache's lengths on the device and advances them itself.

Prefill stays on the model's ordinary forward, into the same cache. Without CUDA the same step runs eagerly
(the MoE kernel through Triton's interpreter, or its torch fallback), which is how CI tests it.
"""
from __future__ import annotations

import torch
from torch import nn

from . import decode_kernels
from .model import MoE, LatentCache, Transformer, apply_rope, project_pair


def _stack_experts(moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, D] (gate rows then up rows) and w2 [E, D, I]; each expert's weights become views of them."""
    experts = [moe.experts[str(e)] for e in range(len(moe.experts))]
    w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
    w2 = torch.stack([m.down_proj.weight for m in experts])
    inter = experts[0].gate_proj.weight.shape[0]
    for m, a, b in zip(experts, w13, w2):
        m.gate_proj.weight = nn.Parameter(a[:inter], requires_grad=False)
        m.up_proj.weight = nn.Parameter(a[inter:], requires_grad=False)
        m.down_proj.weight = nn.Parameter(b, requires_grad=False)
    return w13, w2


class GraphDecode:
    """Attached to a model by ``enable``; ``generate`` asks it for a cache and steps through it."""

    def __init__(self, model: Transformer, projections: str = "triton"):
        if model.ep is not None:
            raise ValueError("the graph decode path runs on the single backend (no expert parallelism)")
        self.model = model
        if projections == "triton":  # batch 1's dense projections through kernels/gemv.py (PDL, fused pairs):
            # 5.05 against 5.30 ms a step on an H200, while at batch 8 cuBLAS is faster (engine/DECODE.md). The
            # routed experts have their own kernel, and the vocabulary projection is cuBLAS's at any batch.
            routed = {id(m) for layer in model.layers if isinstance(layer.mlp, MoE) for m in layer.mlp.experts.modules()}
            decode_kernels.enable(model, skip=lambda mod: id(mod) in routed or mod is model.lm_head, argmax=False,
                                  max_rows=1)
        # Triton is imported here, not with the engine: TRITON_INTERPRET is read when the kernels' decorators run
        from kernels.moe import moe_experts
        from kernels.norm import add_rms_norm, rms_norm

        self.moe_experts, self.add_rms_norm, self.rms_norm = moe_experts, add_rms_norm, rms_norm
        a, w = model.args, model.embed_tokens.weight
        self.device = w.device
        self.graphs = torch.cuda.is_available() and w.is_cuda
        self.inv_freq = model.inv_freq.to(self.device)  # on the device: a host copy cannot be captured
        self.stacks = {i: _stack_experts(layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)}
        self.heads, self.nope, self.v_dim, self.rank = (a.num_attention_heads, a.qk_nope_head_dim, a.v_head_dim,
                                                        a.kv_lora_rank)
        self.caches: dict[tuple[int, int], tuple[LatentCache, dict]] = {}

    def cache(self, rows: int, max_len: int) -> LatentCache:
        """A cache of ``rows`` rows, reused across calls of the same shape (a captured graph holds its
        addresses); its lengths start at zero. Positions past a row's length are masked, so stale ones are
        never read."""
        key = (rows, max_len)
        if key not in self.caches:
            self.caches[key] = (LatentCache.for_model(self.model, rows, max_len), {})
        cache = self.caches[key][0]
        cache.lengths.zero_()
        return cache

    def step(self, cache: LatentCache, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one per cache row) -> logits [B, vocab]; every row advances one position."""
        if not self.graphs:
            return self._step(cache, tokens)
        state = self.caches[(cache.kv.shape[1], cache.max_len)][1]
        if "graph" not in state:
            state["tokens"] = tokens.clone()
            lengths = cache.lengths.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(cache, state["tokens"])  # compile and warm up outside the capture; undone below
            torch.cuda.current_stream().wait_stream(side)
            cache.lengths.copy_(lengths)
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["logits"] = self._step(cache, state["tokens"])
        state["tokens"].copy_(tokens)
        state["graph"].replay()
        return state["logits"]

    # --- the step ----------------------------------------------------------------------------
    def _step(self, cache: LatentCache, tokens: torch.Tensor) -> torch.Tensor:
        m, add_rms_norm, rms_norm = self.model, self.add_rms_norm, self.rms_norm
        B = tokens.shape[0]
        pos = cache.lengths[:B]
        freqs = pos[:, None].float() * self.inv_freq
        freqs = torch.polar(torch.ones_like(freqs), freqs) * m.attention_scaling  # as Transformer.freqs_cis
        valid = torch.arange(cache.max_len, device=self.device)[None, :] <= pos[:, None]  # [B, L]
        rows = torch.arange(B, device=self.device)  # once a step, not once a layer: each is a launch in the graph
        h = m.embed_tokens(tokens)
        x = rms_norm(h, m.layers[0].input_layernorm.weight, m.layers[0].input_layernorm.eps)
        for i, layer in enumerate(m.layers):  # each residual add runs fused with the norm after it
            attn = self._attention(layer.self_attn, x, freqs, cache, i, rows, pos, valid)
            h, x = add_rms_norm(h, attn, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            out = self._moe(layer.mlp, x, i) if isinstance(layer.mlp, MoE) else layer.mlp(x)
            after = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
            h, x = add_rms_norm(h, out, after.weight, after.eps)
        logits = m.lm_head(x)
        cache.lengths[:B] += 1
        return logits

    def _attention(self, attn, x, freqs, cache: LatentCache, layer: int, rows, pos, valid) -> torch.Tensor:
        B, H = x.shape[0], self.heads
        q, kv_a = project_pair(x, attn.q_in, attn.kv_a_proj_with_mqa, attn.pair_kernel)
        if not hasattr(attn, "q_proj"):
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q_nope, q_pe = q.view(B, H, -1).split([self.nope, attn.rope], dim=-1)
        c_kv, k_pe = kv_a.split([self.rank, attn.rope], dim=-1)
        cache.kv[layer, rows, pos] = self.rms_norm(c_kv.contiguous(), attn.kv_a_layernorm.weight,
                                              attn.kv_a_layernorm.eps).to(cache.kv.dtype)
        cache.pe[layer, rows, pos] = apply_rope(k_pe, freqs).to(cache.pe.dtype)
        q_pe = apply_rope(q_pe, freqs[:, None])
        kv, pe = cache.kv[layer, :B], cache.pe[layer, :B]  # [B, L, R], [B, L, Dr]
        w_kv = attn.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_kv[:, :self.nope])  # W_UK absorbed into the query
        scores = (torch.einsum("bhr,blr->bhl", q_lat, kv) + torch.einsum("bhd,bld->bhl", q_pe, pe)).float()
        scores = (scores * attn.scale).masked_fill(~valid[:, None], float("-inf"))
        probs = scores.softmax(dim=-1).to(x.dtype)
        o_lat = torch.einsum("bhl,blr->bhr", probs, kv)
        out = torch.einsum("bhr,hvr->bhv", o_lat, w_kv[:, self.nope:])  # W_UV absorbed into the output
        return attn.o_proj(out.reshape(B, H * self.v_dim))

    def _moe(self, moe: MoE, x: torch.Tensor, layer: int) -> torch.Tensor:
        weights, idx = moe.route(x)
        w13, w2 = self.stacks[layer]
        out = self.moe_experts(x, w13, w2, idx, weights).to(x.dtype)
        return out if moe.shared_experts is None else out + moe.shared_experts(x)


def enable(model: Transformer) -> Transformer:
    """Attach the graph decode path to ``model`` in place (``generate`` then decodes through it)."""
    model.graph_decode = GraphDecode(model)
    return model


__all__ = ["GraphDecode", "enable"]
