"""DeepSeek-V2 transformer: MLA attention over a compressed latent KV cache, and DeepSeekMoE.

Numerics follow transformers' ``modeling_deepseek_v2`` (interleaved/complex RoPE on the rope
part of q/k only, fp32 RMSNorm, fp32 router). Module names match the HF checkpoint names
with the leading ``model.`` removed (``embed_tokens``, ``layers.{i}...``, ``norm``, ``lm_head``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs, yarn_factor, yarn_get_mscale
from .parallel import ExpertParallel


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def rope_inv_freq(rp: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_factor) of a standardised rope dict over ``dim`` rope dims, as HF default /
    yarn rope init."""
    base = rp["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    if rp.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    # yarn (HF _compute_yarn_parameters)
    orig = rp["original_max_position_embeddings"]
    factor = yarn_factor(rp, max_position)
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [..., D] by complex freqs_cis broadcastable to [..., D/2]: adjacent pairs (x0, x1), ... when
    interleave (DeepSeek-V2; V3's rope_interleave), else the halves (x_i, x_i+D/2) (transformers' rotate_half)."""
    if interleave:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)
    half = x.shape[-1] // 2
    r = torch.complex(x[..., :half].float(), x[..., half:].float()) * freqs_cis
    return torch.cat([r.real, r.imag], dim=-1).type_as(x)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------
class LatentCache:
    """Static per-row cache of the compressed MLA latent: normalised c_kv and roped k_pe.

    kv: (n_layers, max_rows, max_len, kv_lora_rank); pe: (n_layers, max_rows, max_len, qk_rope_head_dim);
    lengths: (max_rows,) tokens already cached per row.
    """

    def __init__(self, n_layers: int, max_rows: int, max_len: int, kv_lora_rank: int, rope_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.kv = torch.zeros(n_layers, max_rows, max_len, kv_lora_rank, device=device, dtype=dtype)
        self.pe = torch.zeros(n_layers, max_rows, max_len, rope_dim, device=device, dtype=dtype)
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)

    @classmethod
    def for_model(cls, model: "Transformer", max_rows: int, max_len: int) -> "LatentCache":
        a, w = model.args, model.embed_tokens.weight
        return cls(a.num_hidden_layers, max_rows, max_len, a.kv_lora_rank, a.qk_rope_head_dim, w.device, w.dtype)

    @property
    def max_len(self) -> int:
        return self.kv.shape[2]

    def reset(self) -> None:
        """Empty: positions past a row's length are never read."""
        self.lengths.zero_()

    def reset_rows(self, rows: list[int]) -> None:
        """Empty these rows (for a new sequence each), the others untouched."""
        self.lengths[rows] = 0

    def write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """Store c_kv [B,T,R] and k_pe [B,T,Dr] of rows [B] at positions pos [B,T]."""
        self.kv[layer, rows[:, None], pos] = c_kv.to(self.kv.dtype)
        self.pe[layer, rows[:, None], pos] = k_pe.to(self.pe.dtype)

    def read(self, layer: int, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, rows, :length], self.pe[layer, rows, :length]


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------
class Linear(nn.Linear):
    """nn.Linear; with a row kernel attached (engine/decode_kernels.py) inputs it admits go through it."""

    rows_kernel = None  # (x [M, K], weight) -> y [M, N], or None when the kernel does not admit x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and self.bias is None:
            y = self.rows_kernel(x.reshape(-1, x.shape[-1]), self.weight)
            if y is not None:
                return y.view(*x.shape[:-1], y.shape[-1])
        return super().forward(x)


def project_pair(x: torch.Tensor, a: Linear, b: Linear, pair_kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """a(x), b(x): two projections of one input, in one fused launch when a pair kernel admits x."""
    if pair_kernel is not None and (ys := pair_kernel(x)) is not None:
        return ys
    return a(x), b(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(dim, inter, bias=bias)
        self.up_proj = Linear(dim, inter, bias=bias)
        self.down_proj = Linear(inter, dim, bias=bias)
        self.pair_kernel = None  # gate_proj and up_proj fused (engine/decode_kernels.py)

    def paired(self) -> tuple[Linear, Linear]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_pair(x, self.gate_proj, self.up_proj, self.pair_kernel)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Multi-head latent attention. The cache holds only (c_kv, k_pe); K/V are expanded via kv_b_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        a = args
        self.n_heads, self.nope, self.rope, self.v_dim = (
            a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim)
        self.kv_lora_rank, self.qk_head_dim, self.scale = a.kv_lora_rank, a.qk_head_dim, a.softmax_scale
        self.rope_interleave = a.rope_interleave
        q_out = a.num_attention_heads * a.qk_head_dim
        if a.q_lora_rank is None:
            self.q_proj = Linear(a.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(a.hidden_size, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank)  # eps 1e-6, not rms_norm_eps (as HF)
            self.q_b_proj = Linear(a.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank)  # eps 1e-6 (as HF)
        self.kv_b_proj = Linear(a.kv_lora_rank, a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim),
                                bias=False)
        self.o_proj = Linear(a.num_attention_heads * a.v_head_dim, a.hidden_size, bias=a.attention_bias)
        self.pair_kernel = None  # the first q projection and kv_a_proj_with_mqa fused (engine/decode_kernels.py)

    @property
    def q_in(self) -> Linear:
        """The projection of q that reads the layer input."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def paired(self) -> tuple[Linear, Linear]:
        return self.q_in, self.kv_a_proj_with_mqa

    def forward(self, x, freqs_cis, cache: LatentCache, layer: int, rows, pos, length: int, mask):
        B, T, _ = x.shape
        H = self.n_heads
        q, kv_a = project_pair(x, self.q_in, self.kv_a_proj_with_mqa, self.pair_kernel)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(B, T, H, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = apply_rope(q_pe, freqs_cis[:, :, None], self.rope_interleave)
        k_pe = apply_rope(k_pe, freqs_cis, self.rope_interleave)

        cache.write(layer, rows, pos, c_kv, k_pe)
        c_all, pe_all = cache.read(layer, rows, length)  # [B,L,R], [B,L,Dr]
        L = c_all.shape[1]
        k_nope, v = self.kv_b_proj(c_all.to(x.dtype)).view(B, L, H, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, pe_all.to(x.dtype)[:, :, None].expand(B, L, H, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)

        # scores in fp32, as transformers' default (sdpa) and the graph path's kernel keep them: rounded to bf16
        # they made the torch path's bf16 error 1.22x transformers' at DeepSeek-V2-Lite shape (docs/decode-log.md)
        scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * self.v_dim)
        return self.o_proj(out)


class Gate(nn.Module):
    """Router weight (and DeepSeek-V3's score correction bias); kept in fp32 whatever the model dtype (HF
    _keep_in_fp32_modules_strict)."""

    def __init__(self, n_experts: int, dim: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim, dtype=torch.float32))
        if correction_bias:  # added to the scores for the choice of experts only, never to the weights
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))


class MoE(nn.Module):
    """Routed experts plus shared experts. Routing (``ModelArgs.routing``): greedy top-k of the softmax (V2-Lite),
    group-limited greedy (V2: the ``topk_group`` groups with the best expert kept, top-k inside them) or noaux_tc
    (V3: sigmoid scores, the correction bias added for the choice, the groups ranked by their top-2 sum).

    With ``ep`` (expert parallel) only this rank's shard of the routed experts exists (``experts`` is keyed by
    the global expert id, so parameter names stay ``experts.{e}.*``); the router is replicated, the local
    experts' contributions are summed into an fp32 partial and ``ep.combine`` adds up the ranks' partials.
    """

    def __init__(self, args: ModelArgs, ep: ExpertParallel | None = None):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = bool(args.norm_topk_prob)
        self.routed_scaling_factor = args.routed_scaling_factor
        self.routing, self.n_group, self.topk_group = args.routing, args.n_group, args.topk_group
        self.gate = Gate(args.n_routed_experts, args.hidden_size, correction_bias=self.routing == "noaux_tc")
        self.ep = ep
        local = range(args.n_routed_experts) if ep is None else ep.experts(args.n_routed_experts)
        self.experts = nn.ModuleDict(
            {str(e): MLP(args.hidden_size, args.moe_intermediate_size, args.mlp_bias) for e in local})
        n_shared = args.n_shared_experts or 0
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * n_shared, args.mlp_bias)
                               if n_shared > 0 else None)
        # (x [N, dim], idx, weights) -> the routed experts' weighted sum [N, dim] fp32 (this rank's partial), or None
        # for the loop below: kernels.moe's grouped experts, attached by the triton and graph paths
        self.experts_kernel = None

    def _groups_kept(self, scores: torch.Tensor, group_score, fill: float) -> torch.Tensor:
        """scores [N, E] with every expert outside the topk_group best groups (by group_score) set to fill."""
        if self.topk_group >= self.n_group:  # every group kept (Moonlight: one group)
            return scores
        by_group = scores.view(scores.shape[0], self.n_group, -1)
        kept = torch.topk(group_score(by_group), k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
        return scores.masked_fill(~mask.repeat_interleave(by_group.shape[-1], dim=1), fill)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (weights [N, k] fp32, expert indices [N, k]), in fp32 (the router's dtype in transformers)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.routing == "noaux_tc":
            scores = logits.sigmoid()
            choice = self._groups_kept(scores + self.gate.e_score_correction_bias.float(),
                                       lambda g: g.topk(2, dim=-1)[0].sum(dim=-1), float("-inf"))
            idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if self.norm_topk_prob:  # V3: renormalised, then scaled (transformers' DeepseekV3TopkRouter)
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * self.routed_scaling_factor, idx
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.routing == "group_limited_greedy":
            scores = self._groups_kept(scores, lambda g: g.max(dim=-1).values, 0.0)
        weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob and self.top_k > 1:
            # DeepSeek reference semantics. NOTE: HF native DeepseekV2 ignores norm_topk_prob (always
            # scales), so HF-parity tests use norm_topk_prob=False.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.routed_scaling_factor
        return weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.route(flat)
        # the weighted sum over the chosen experts in fp32, rounded once, as transformers' default experts path
        # (grouped_mm) does; under expert parallelism this is the rank's partial. Rounding after each expert's add
        # lost precision against transformers in bf16 (docs/decode-log.md, "Precision against transformers").
        out = None if self.experts_kernel is None else self.experts_kernel(flat, idx, weights)
        if out is None:
            out = torch.zeros_like(flat, dtype=torch.float32)
            for e in torch.unique(idx).tolist():  # ascending expert order, as HF; a host sync, and one an expert
                if str(e) not in self.experts:
                    continue  # another rank's expert
                tok, slot = torch.where(idx == e)
                y = self.experts[str(e)](flat[tok]) * weights[tok, slot, None]
                out.index_add_(0, tok, y.to(out.dtype))
        if self.ep is not None:
            out = self.ep.combine(out)
        out = out.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ep: ExpertParallel | None = None):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MoE(args, ep) if args.is_moe_layer(layer_idx) else MLP(
            args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, freqs_cis, cache, layer, rows, pos, length, mask):
        x = x + self.self_attn(self.input_layernorm(x), freqs_cis, cache, layer, rows, pos, length, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def cache_rows(batch: int, rows: torch.Tensor | None, device) -> torch.Tensor:
    """The cache rows [batch] a forward appends to: rows on the cache's device, else 0..batch-1."""
    rows = torch.arange(batch, device=device) if rows is None else rows.to(device)
    if rows.shape != (batch,):
        raise ValueError(f"rows must have shape ({batch},), got {tuple(rows.shape)}")
    return rows


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, ep: ExpertParallel | None = None):
        super().__init__()
        args.validate()
        self.args, self.ep = args, ep
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i, ep) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.pick_kernel = None  # greedy pick and margin over [B, V] logits (engine/decode_kernels.py); torch's if None
        self.graph_decode = None  # the CUDA-graph decode step (engine/graph_decode.py); the forward below if None
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # plain attribute, not a buffer: stays fp32 through model.to(dtype)
        self.inv_freq, self.attention_scaling = rope_inv_freq(args.rope_parameters, args.qk_rope_head_dim,
                                                              args.max_position_embeddings)

    def new_cache(self, rows: int, max_len: int) -> LatentCache:
        return LatentCache.for_model(self, rows, max_len)

    def freqs_cis(self, pos: torch.Tensor) -> torch.Tensor:
        """Complex rotations for integer positions pos [...] -> [..., rope_dim/2] (HF rotary_emb)."""
        freqs = pos[..., None].float() * self.inv_freq.to(pos.device)
        return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling

    # a forward takes right-padded rows (``lengths``): generate prefills a ragged batch in one forward
    takes_padding = True

    def forward(self, tokens: torch.Tensor, cache: LatentCache, rows: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
        """tokens [B,T] appended to cache rows [B] (default 0..B-1) -> logits [B,T,vocab].

        Each row continues at its own cache length; attention is causal within the new tokens. ``lengths`` [B]: the
        tokens each row really has (default T); the rest of the row is padding, computed and written to the cache past
        the row's length, where no query reads it before a later token of the row overwrites it (a query at position p
        sees positions <= p, and position p is written by the forward that brings it), and not counted in its length.
        ``start``: the rows' longest cache length, where the caller knows it (a prefill into emptied rows: 0); else it
        is read from the device, a host synchronisation that a CUDA-graph capture cannot hold (graph_decode's prefill).
        """
        B, T = tokens.shape
        dev = cache.lengths.device
        rows = cache_rows(B, rows, dev)
        starts = cache.lengths[rows]
        pos = starts[:, None] + torch.arange(T, device=dev)  # [B,T] absolute positions
        length = (int(starts.max()) if start is None else start) + T
        if length > cache.max_len:
            raise ValueError(f"cache overflow: need {length} positions, cache max_len is {cache.max_len}")
        mask = (torch.arange(length, device=dev)[None, None, :] <= pos[:, :, None])[:, None]  # [B,1,T,L]
        freqs_cis = self.freqs_cis(pos)
        h = self.embed_tokens(tokens.to(dev))
        for i, layer in enumerate(self.layers):
            h = layer(h, freqs_cis, cache, i, rows, pos, length, mask)
        logits = self.lm_head(self.norm(h))
        cache.lengths[rows] += T if lengths is None else lengths.to(dev)
        return logits


# ---------------------------------------------------------------------------------------------
# greedy pick
# ---------------------------------------------------------------------------------------------
def picks(logits: torch.Tensor, kernel=None, counter=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy over fp32 logits [B, V], on their device: ids [B] by argmax (first max on ties) and the top1 - top2
    margins [B] fp32; ``kernel`` (kernels.argmax.pick_batch, ``counter`` its scratch) the same in one launch."""
    if kernel is not None:
        return kernel(logits, fallback=lambda: picks(logits), counter=counter)
    logits = logits.float()
    ids = torch.argmax(logits, dim=-1)
    if logits.shape[-1] > 1:
        top2 = torch.topk(logits, 2, dim=-1).values
        return ids, top2[:, 0] - top2[:, 1]
    return ids, torch.full(ids.shape, float("inf"), device=logits.device)
