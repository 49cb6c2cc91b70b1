"""DeepSeek-V4: sliding-window attention with one shared KV head and per-head sinks, compressed sparse attention
(CSA: a compressor, a lightning indexer, top-k of the compressed entries), heavily compressed attention (HCA), the
grouped output projection, hash-routed and sqrtsoftplus top-k MoE with the swiglu clamp, and manifold-constrained
hyper-connections (Sinkhorn) with the hyper head.

Numerics follow transformers' ``modeling_deepseek_v4`` (interleaved rope on the trailing rope dims in fp32, fp32
norms, hyper-connections and sinks, fp32 softmaxes); where transformers rounds to the model's dtype between two
steps this path may keep fp32, never the reverse. Module names are transformers' names with the leading ``model.``
removed (``engine/v4_checkpoint.py`` maps a checkpoint's names onto them).

The cache is static (``V4Cache``): a ring of the last ``sliding_window`` keys per layer, for each compressor and
indexer a ring of the source tokens of the open windows and preallocated slots for the compressed entries, the
entry written when its window closes, guarded on the device, and a fixed indexer top-k whose padding picks are
masked. So a decode step has no host synchronisation except the routed experts' loop of the torch path and the
overflow check, which the graph path (``engine/v4_graph.py``) replaces and skips.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import CSA, HASH_MOE, SLIDING, V4Args
from .model import Linear, cache_rows, project_pair, rope_inv_freq


# ---------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------
class Norm(nn.Module):
    """RMSNorm with an fp32 weight: normalised and scaled in fp32, rounded once to the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (transformers' DeepseekV4UnweightedRMSNorm): the scale in fp32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing cos.shape[-1] dims of x [..., D] in interleaved pairs (x_2i, x_2i+1), in fp32; cos/sin
    [..., rope] (each angle twice, as Rope gives them) broadcast over x's leading dims."""
    r = cos.shape[-1]
    nope, pe = x[..., :-r], x[..., -r:].float()
    turned = torch.stack((-pe[..., 1::2], pe[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (pe * cos + turned * sin).to(x.dtype)], dim=-1)


class Rope:
    """cos/sin of one rope (plain, or yarn) at integer positions, fp32 (a plain object: stays fp32 through .to)."""

    def __init__(self, rp: dict, dim: int, max_position: int):
        self.inv_freq, self.scaling = rope_inv_freq(rp, dim, max_position)
        self.on = {}  # device -> inv_freq there: copied once, before any graph capture

    def __call__(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., rope] at pos [...]: each pair's angle twice, the layout rope() rotates."""
        if pos.device not in self.on:
            self.on[pos.device] = self.inv_freq.repeat_interleave(2).to(pos.device)
        freqs = pos[..., None].float() * self.on[pos.device]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MLP(nn.Module):
    """The shared expert, with the swiglu clamp."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dim, inter, False), Linear(dim, inter, False), \
            Linear(inter, dim, False)
        self.limit = limit
        self.pair_kernel = None  # gate_proj and up_proj fused (engine/decode_kernels.py)

    def paired(self) -> tuple[Linear, Linear]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(*project_pair(x, self.gate_proj, self.up_proj, self.pair_kernel), self.limit))


# ---------------------------------------------------------------------------------------------
# the static cache
# ---------------------------------------------------------------------------------------------
class Series:
    """One compressor's (or indexer's) state: the source tokens of its open windows and its compressed entries.

    kv, gate: [rows, span, width] rings (slot = position mod span; span = 2 * ratio with the overlapping windows of
    CSA, else ratio); entries: [rows, max_len // ratio + 1, head] (the last slot takes the writes of tokens that
    close no window, so a guarded write never needs the host)."""

    def __init__(self, rows: int, span: int, width: int, slots: int, head: int, device, dtype):
        self.kv = torch.zeros(rows, span, width, device=device, dtype=dtype)
        self.gate = torch.zeros(rows, span, width, device=device, dtype=dtype)
        self.entries = torch.zeros(rows, slots + 1, head, device=device, dtype=dtype)


class V4Cache:
    """Static per-row state of every layer; ``lengths`` [rows] tokens already seen per row."""

    def __init__(self, args: V4Args, rows: int, max_len: int, device="cpu", dtype=torch.float32):
        self.max_len = max_len
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        d, W = args.head_dim, args.sliding_window
        self.window = [torch.zeros(rows, W, d, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.series: dict[tuple[int, str], Series] = {}
        for i, t in enumerate(args.layer_types):
            if t == SLIDING:
                continue
            m = args.compress_rates[t]
            span = 2 * m if t == CSA else m
            self.series[i, "compressor"] = Series(rows, span, span // m * d, max_len // m, d, device, dtype)
            if t == CSA:
                c = args.index_head_dim
                self.series[i, "indexer"] = Series(rows, span, 2 * c, max_len // m, c, device, dtype)

    @classmethod
    def for_model(cls, model: "V4Transformer", rows: int, max_len: int) -> "V4Cache":
        w = model.embed_tokens.weight
        return cls(model.args, rows, max_len, w.device, w.dtype)

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def reset(self) -> None:
        """Empty, in place (a captured graph holds the addresses). Masked positions still meet the values as a
        weight 0 times the value, so what an earlier sequence left (an inf would give a NaN) is zeroed too."""
        self.reset_rows(slice(None))

    def reset_rows(self, rows: list[int] | slice) -> None:
        """Empty these rows (for a new sequence each), the others untouched."""
        self.lengths[rows] = 0
        for t in [*self.window, *(x for s in self.series.values() for x in (s.kv, s.gate, s.entries))]:
            t[rows] = 0


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """Pools every ``ratio`` source tokens into one entry: a softmax over the window of (gate + position bias)
    weighting the tokens' kv, RMS-normalised, roped at the window's first position. With ``overlap`` (CSA) the
    projections are twice as wide: the first half of window w-1's tokens and the second half of window w's are
    pooled together (2 * ratio slots)."""

    def __init__(self, dim: int, head: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * head if overlap else head
        self.kv_proj, self.gate_proj = Linear(dim, width, False), Linear(dim, width, False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = Norm(head, eps)
        self.ratio, self.head, self.overlap = ratio, head, overlap

    def update(self, s: Series, rows, start, pos, kv, gate, cos_sin) -> None:
        """Append the new tokens' kv, gate [B, T, width] at positions pos [B, T] (rows continuing at start [B]) and
        write every entry whose window they close."""
        B, T, width = kv.shape
        span, m, d = s.kv.shape[1], self.ratio, self.head
        # the open windows in position order (start - span .. start - 1), then the new tokens
        order = ((start[:, None] + torch.arange(span, device=kv.device)) % span)[..., None].expand(B, span, width)
        hk = torch.cat([s.kv[rows].gather(1, order), kv], dim=1)
        hg = torch.cat([s.gate[rows].gather(1, order), gate], dim=1)
        keep = min(T, span)
        slots = pos[:, -keep:] % span
        s.kv[rows[:, None], slots] = kv[:, -keep:].to(s.kv.dtype)
        s.gate[rows[:, None], slots] = gate[:, -keep:].to(s.gate.dtype)
        # the window that ends at each new token: span source tokens, positions pos - span + 1 .. pos, on the last
        # dim (a softmax over the last dim: over another one torch's kernel took 28 us at V4-Flash's HCA width)
        wk = hk.unfold(1, span, 1)[:, 1:]  # [B, T, width, span]
        wg = hg.unfold(1, span, 1)[:, 1:]
        bias = self.position_bias.float().t()  # [width, ratio]
        if self.overlap:  # window w-1's first halves, then window w's second halves
            wk = torch.cat([wk[:, :, :d, :m], wk[:, :, d:, m:]], dim=-1)
            wg = torch.cat([wg[:, :, :d, :m] + bias[:d], wg[:, :, d:, m:] + bias[d:]], dim=-1)
        else:
            wg = wg + bias
        src = pos[..., None] - span + 1 + torch.arange(span, device=kv.device)  # [B, T, span]
        wg = wg.masked_fill((src < 0)[:, :, None, :], float("-inf"))  # before the first token: weight 0
        pooled = self.kv_norm((wk * wg.softmax(dim=-1, dtype=torch.float32).to(wk.dtype)).sum(dim=-1))
        window = pos // m
        cos, sin = cos_sin(window * m)
        entry = rope(pooled, cos, sin)
        closes = (pos + 1) % m == 0
        s.entries[rows[:, None], torch.where(closes, window, s.entries.shape[1] - 1)] = entry.to(s.entries.dtype)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: a compressor of its own (index_head_dim, overlapping windows), queries
    from q's low-rank residual, scores sum_h w_h * relu(q_h . k) over the compressed entries; of the entries a
    query may see, the index_topk best are kept."""

    def __init__(self, a: V4Args, ratio: int):
        super().__init__(a.hidden_size, a.index_head_dim, ratio, True, a.rms_norm_eps)
        self.n_heads, self.topk = a.index_n_heads, a.index_topk
        self.q_b_proj = Linear(a.q_lora_rank, self.n_heads * self.head, False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(a.hidden_size, self.n_heads, False)

    def select(self, entries: torch.Tensor, weights_x: torch.Tensor, q_res, cos, sin, visible) -> torch.Tensor:
        """entries [B, S, c], weights_x: weights_proj of the layer input [B, T, heads], visible [B, T, S] -> the
        kept entries [B, T, S] (bool)."""
        B, T = visible.shape[:2]
        q = rope(self.q_b_proj(q_res).view(B, T, self.n_heads, self.head), cos[:, :, None], sin[:, :, None])
        # the same ops as transformers' scorer, so that equal scores stay equal and near ties fall the same way
        scores = F.relu(torch.matmul(q.float(), entries.transpose(-1, -2).float().unsqueeze(1))) * self.head ** -0.5
        score = (scores * (weights_x.float() * self.n_heads ** -0.5).unsqueeze(-1)).sum(dim=2)
        top = score.masked_fill(~visible, float("-inf")).topk(min(self.topk, score.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter(-1, top, True) & visible  # fixed k: padding picks are not visible


class Attention(nn.Module):
    def __init__(self, a: V4Args, layer: int):
        super().__init__()
        self.kind = a.layer_types[layer]
        self.n_heads, self.head, self.window, self.groups = a.num_attention_heads, a.head_dim, a.sliding_window, a.o_groups
        self.eps, self.scale = a.rms_norm_eps, a.head_dim ** -0.5
        H, d = self.n_heads, self.head
        self.q_a_proj = Linear(a.hidden_size, a.q_lora_rank, False)
        self.q_a_norm = Norm(a.q_lora_rank, a.rms_norm_eps)
        self.q_b_proj = Linear(a.q_lora_rank, H * d, False)
        self.kv_proj = Linear(a.hidden_size, d, False)
        self.kv_norm = Norm(d, a.rms_norm_eps)
        # grouped output projection: o_a_proj holds the groups' blocks stacked ([groups * o_lora, H * d / groups])
        self.o_a_proj = Linear(H * d // a.o_groups, a.o_groups * a.o_lora_rank, False)
        self.o_b_proj = Linear(a.o_groups * a.o_lora_rank, a.hidden_size, False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.ratio = a.ratio(layer)
        self.pair_kernel = None  # q_a_proj and kv_proj fused (engine/decode_kernels.py)
        self.project = None  # x -> (q_a, kv, aux) or None: the graph path's projections of a decode step
        if self.kind != SLIDING:
            self.compressor = Compressor(a.hidden_size, d, self.ratio, self.kind == CSA, a.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(a, self.ratio)

    def paired(self) -> tuple[Linear, Linear]:
        return self.q_a_proj, self.kv_proj

    def projections(self, x):
        """(q_a_proj(x), kv_proj(x)): the two projections of the layer input besides the auxiliary ones."""
        return project_pair(x, self.q_a_proj, self.kv_proj, self.pair_kernel)

    def aux_modules(self) -> list[Linear]:
        """The compressor's and indexer's projections that read the layer input (the C4 auxiliary GEMVs), in the
        order ``aux`` returns them: kv_proj, gate_proj (compressor), kv_proj, gate_proj, weights_proj (indexer)."""
        c = self.compressor
        mods = [c.kv_proj, c.gate_proj]
        if self.kind == CSA:
            mods += [c.indexer.kv_proj, c.indexer.gate_proj, c.indexer.scorer.weights_proj]
        return mods

    def aux(self, x):
        return [m(x) for m in self.aux_modules()]

    def forward(self, x, ropes, cache: V4Cache, layer: int, rows, start, pos):
        """ropes: {"main", "compress"}: (cos, sin) at pos, and "compress_rope": the compress Rope itself."""
        B, T, _ = x.shape
        H, d, W = self.n_heads, self.head, self.window
        cos, sin = ropes["main" if self.kind == SLIDING else "compress"]
        proj = self.project(x) if self.project is not None else None
        if proj is None:
            proj = (*self.projections(x), self.aux(x) if self.kind != SLIDING else None)
        q_a, kv, aux = proj
        q_res = self.q_a_norm(q_a)
        q = rope(unit_rms(self.q_b_proj(q_res).view(B, T, H, d), self.eps), cos[:, :, None], sin[:, :, None])
        kv = rope(self.kv_norm(kv), cos, sin)

        # the sliding window: the ring's keys (slot s holds the latest position below start congruent to s), then
        # the new tokens'; a query sees the W positions up to its own
        ring = cache.window[layer]
        s = torch.arange(W, device=x.device)
        ring_pos = start[:, None] - 1 - (start[:, None] - 1 - s) % W
        keys = torch.cat([ring[rows], kv.to(ring.dtype)], dim=1)  # [B, W + T, d]
        kpos = torch.cat([ring_pos, pos], dim=1)
        visible = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[..., None]) & (pos[..., None] - kpos[:, None, :] < W)
        keep = min(T, W)
        ring[rows[:, None], pos[:, -keep:] % W] = kv[:, -keep:].to(ring.dtype)

        if self.kind != SLIDING:
            c, m = self.compressor, self.ratio
            ropes_c = ropes["compress_rope"]
            c.update(cache.series[layer, "compressor"], rows, start, pos, aux[0], aux[1], ropes_c)
            entries = cache.series[layer, "compressor"].entries[rows, :-1]  # [B, S, d]
            seen = torch.arange(entries.shape[1], device=x.device) < ((pos + 1) // m)[..., None]  # [B, T, S]
            if self.kind == CSA:
                ix = c.indexer
                ix.update(cache.series[layer, "indexer"], rows, start, pos, aux[2], aux[3], ropes_c)
                seen = ix.select(cache.series[layer, "indexer"].entries[rows, :-1], aux[4], q_res, cos, sin, seen)
            keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
            visible = torch.cat([visible, seen], dim=-1)

        # K = V (one shared head); scores and the softmax with the per-head sink in fp32
        scores = torch.einsum("bthd,bsd->bhts", q.float(), keys.float()) * self.scale
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        sink = self.sinks.float()[None, :, None, None].expand(B, H, T, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhts,bsd->bthd", probs.to(x.dtype), keys.to(x.dtype))
        out = rope(out, cos[:, :, None], -sin[:, :, None])  # V carried k's rope: turned back at the query's position
        g = self.groups
        w = self.o_a_proj.weight.view(g, -1, H * d // g)
        # one matmul a group, the weight's view transposed in the call (an einsum copied the 67 MB weight each step)
        grouped = torch.bmm(out.reshape(B * T, g, -1).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
        return self.o_b_proj(grouped.reshape(B, T, -1))


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------
class Gate(nn.Module):
    """The router: its weight, and the correction bias (top-k layers) or the token -> experts table (hash layers)."""

    def __init__(self, a: V4Args, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(a.n_routed_experts, a.hidden_size, dtype=torch.float32))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(a.vocab_size, a.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(a.n_routed_experts, dtype=torch.float32))


class Experts(nn.Module):
    """The routed experts as transformers stacks them: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I]."""

    def __init__(self, a: V4Args):
        super().__init__()
        E, I, D = a.n_routed_experts, a.moe_intermediate_size, a.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))
        self.limit = a.swiglu_limit

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> fp32 [N, D]: the weighted sum over each row's chosen experts (ascending expert order)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.limit), self.down_proj[e])
            out.index_add_(0, tok, y.float() * weights[tok, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, a: V4Args, layer: int):
        super().__init__()
        self.hashed = a.mlp_layer_types[layer] == HASH_MOE
        self.top_k, self.scale, self.scoring = a.num_experts_per_tok, a.routed_scaling_factor, a.scoring_func
        self.gate = Gate(a, self.hashed)
        self.experts = Experts(a)
        self.shared_experts = MLP(a.hidden_size, a.moe_intermediate_size, a.swiglu_limit)
        # (x, w13, w2, idx, weights, limit) -> fp32 [N, D], or None for the loop below; the graph path sets it
        self.experts_kernel = None

    def route(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], tokens [N] -> (fp32 weights [N, k], experts [N, k]); the router in fp32."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.hashed:
            idx = self.gate.tid2eid[tokens]
        else:
            idx = torch.topk(scores + self.gate.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, idx

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.route(flat, tokens.reshape(-1))
        ex = self.experts
        routed = None if self.experts_kernel is None else \
            self.experts_kernel(flat, ex.gate_up_proj, ex.down_proj, idx, weights, ex.limit)
        if routed is None:
            routed = ex(flat, idx, weights)
        return routed.to(x.dtype).view(shape) + self.shared_experts(x)


# ---------------------------------------------------------------------------------------------
# hyper-connections
# ---------------------------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """mHC: from the hc streams [B, T, n, D], the pre weights (collapse into the block's input), the post weights
    (expand its output) and the comb matrix (mix the streams), doubly stochastic by Sinkhorn; all fp32."""

    def __init__(self, a: V4Args):
        super().__init__()
        n = a.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * a.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.weights_kernel = None  # kernels.hc.hc_weights on the graph path: hyper_weights in one launch

    def forward(self, h: torch.Tensor):
        n, eps = self.n, self.hc_eps
        mix = F.linear(unit_rms(h.flatten(2).float(), self.eps), self.fn.float())
        weights = self.weights_kernel or hyper_weights
        pre, post, comb = weights(mix, self.base.float(), self.scale.float(), n, self.iters, eps)
        return post, comb, (pre[..., None] * h).sum(dim=2).to(h.dtype)


def hyper_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """(pre [..., n], post [..., n], comb [..., n, n]) from the mixing logits, fp32, as transformers computes them
    (kernels.hc.hc_weights is this in one launch; its hc_reference is this, bitwise: tests/test_hc_kernel.py)."""
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


def hc_merge(h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The block's output expanded by post plus the streams mixed by comb (transposed: out_k = sum_j comb_jk h_j),
    in the streams' dtype as transformers rounds them."""
    dt = h.dtype
    return post.to(dt)[..., None] * out[..., None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), h)


class HyperHead(nn.Module):
    def __init__(self, a: V4Args):
        super().__init__()
        n = a.hc_mult
        self.eps, self.hc_eps = a.rms_norm_eps, a.hc_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * a.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = F.linear(unit_rms(h.flatten(2).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre[..., None] * h).sum(dim=2).to(h.dtype)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, a: V4Args, layer: int):
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = MoE(a, layer)
        self.input_layernorm = Norm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = Norm(a.hidden_size, a.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(a), HyperConnection(a)

    def forward(self, h, tokens, ropes, cache, layer, rows, start, pos):
        post, comb, x = self.attn_hc(h)
        h = hc_merge(h, post, comb, self.self_attn(self.input_layernorm(x), ropes, cache, layer, rows, start, pos))
        post, comb, x = self.ffn_hc(h)
        return hc_merge(h, post, comb, self.mlp(self.post_attention_layernorm(x), tokens))


class V4Transformer(nn.Module):
    """DeepSeek-V4 with the engine's interface: forward(tokens, cache, rows) -> logits, new_cache(rows, max_len)."""

    def __init__(self, args: V4Args):
        super().__init__()
        args.validate()
        self.args, self.ep = args, None
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = Norm(args.hidden_size, args.rms_norm_eps)
        self.hc_head = HyperHead(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.pick_kernel = None
        self.graph_decode = None
        self.ropes = {k: Rope(rp, args.qk_rope_head_dim, args.max_position_embeddings)
                      for k, rp in args.rope_parameters.items()}

    # no right-padded rows: a padded token would enter the sliding window and the compressors (generate prefills one
    # forward per prompt length)
    takes_padding = False

    def new_cache(self, rows: int, max_len: int) -> V4Cache:
        return V4Cache.for_model(self, rows, max_len)

    def forward(self, tokens: torch.Tensor, cache: V4Cache, rows: torch.Tensor | None = None,
                checked: bool = True) -> torch.Tensor:
        """tokens [B, T] appended to cache rows [B] (default 0..B-1) -> logits [B, T, vocab]. ``checked``: refuse
        a cache overflow (a host read; the graph step, which never overflows by construction, skips it)."""
        B, T = tokens.shape
        dev = cache.lengths.device
        rows = cache_rows(B, rows, dev)
        start = cache.lengths[rows]
        if checked and int(start.max()) + T > cache.max_len:
            raise ValueError(f"cache overflow: need {int(start.max()) + T} positions, cache max_len is {cache.max_len}")
        pos = start[:, None] + torch.arange(T, device=dev)
        tokens = tokens.to(dev)
        h = self.embed_tokens(tokens)[:, :, None].expand(B, T, self.args.hc_mult, -1).contiguous()
        ropes = {kind: rope_at(pos) for kind, rope_at in self.ropes.items()}  # once a step, for every layer
        ropes["compress_rope"] = self.ropes["compress"]
        for i, layer in enumerate(self.layers):
            h = layer(h, tokens, ropes, cache, i, rows, start, pos)
        logits = self.lm_head(self.norm(self.hc_head(h)))
        cache.lengths[rows] += T
        return logits


__all__ = ["V4Transformer", "V4Cache", "Series"]
