"""The engine's graph decode path (the `graph` kernels setting): one decode step of every batch row, static
shapes, no host synchronisation, captured once per (batch, cache length) in a CUDA graph and replayed.

A layer is about ten launches (docs/decode-log.md counts them), each launched with programmatic dependent
launch (``kernels.pdl``) so that it overlaps the tail of the one before:
- attention: the q and kv_a projections in one launch (``kernels.gemv`` at batch 1, ``kernels.skinny`` on the
  tensor cores at 2-16 rows), ``kernels.mla.mla_decode`` (three launches: the latent's RMSNorm, rope of k and q and
  the cache write riding with the query's absorption; MLA in the latent space: kv_b_proj's up-projections absorbed
  into the query and the output, so attention reads the compressed cache itself, kv_lora_rank + rope dims per token,
  up to each row's position; at batch 1 its last launch asks the next layer's q and kv_a weights into L2), o_proj
  (the same kernels);
- the residual add with the RMSNorm after it (``kernels.norm``), before a MoE in one launch with its router
  (``kernels.route.add_norm_route``: fp32 logits, softmax, top-k);
- the MoE: the routed pairs sorted by expert, and
  ``kernels.moe``'s two expert kernels. The shared experts ride along as extra experts of the stacks (slices of
  moe_intermediate_size, weight 1), so each chosen or shared expert's weights are read once per step. The
  weighted sum over slots is fused into the next residual add and norm.

Under expert parallelism each rank stacks its own experts and maps the router's ids to local ones (-1 for
another rank's; shared slice j is computed on rank j mod world); the fp32 partials are summed by the
collective combine (NCCL, captured in the graph) before the add. The host-staged combine copies through host
memory, which a graph cannot hold, so that backend runs the same step eagerly.

The routed experts' parameters are re-seated as views of the stacks, so nothing is held twice; the shared
slices are copies (the prefill keeps the shared MLP's own weights). Prefill stays on the model's ordinary
forward, into the same cache, with the dense projections' kernels of at most 16 rows attached and each MoE layer's
routed experts through ``kernels.moe`` over the stacks (``decode_kernels.experts_kernel``: no per-expert loop, no
host sync). Without CUDA the step runs eagerly (the kernels through Triton's interpreter, or
their torch fallbacks), which is how CI tests it. A model with rope on the halves (DeepSeek-V3's rope_interleave
false) has its rope rows permuted into interleaved pairs first (``_interleave_rope``), prefill included.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evident.kernels.graphs import capture  # torch only: no Triton at engine import

from . import decode_kernels
from .config import V4
from .model import LatentCache, MoE, Transformer, picks, project_pair


def _remap(moe: MoE, n_routed: int, n_shared: int, ep) -> torch.Tensor | None:
    """Router id (global expert, then E + shared slice) -> row of this rank's stacks, -1 where another rank
    computes it; None on one device, where the two agree."""
    if ep is None:
        return None
    local = sorted(int(e) for e in moe.experts)
    table = [-1] * (n_routed + n_shared)
    for i, e in enumerate(local):
        table[e] = i
    for j in range(n_shared):
        if j % ep.world_size == ep.rank:
            table[n_routed + j] = len(local) + j
    return torch.tensor(table, dtype=torch.long, device=moe.gate.weight.device)


def _interleave_rope(model: Transformer) -> None:
    """A model whose rope rotates the halves (x_i, x_i+D/2; DeepSeek-V3's rope_interleave false) made the same
    function with interleaved pairs (x_2i, x_2i+1), the only layout the MLA kernels rotate: the output rows of q's
    and k's rope dims are permuted so that pair i of the interleaved layout holds the halves' pair i, and every
    layer then rotates interleaved pairs, the prefill too. q·k sums the same products, in another order."""
    attn = model.layers[0].self_attn  # every layer has the same shape
    half, head = attn.rope // 2, attn.nope + attn.rope
    order = torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).flatten()  # 0, h, 1, h+1, ...
    q_rows = torch.arange(attn.n_heads * head).view(attn.n_heads, head)
    q_rows[:, attn.nope:] = q_rows[:, attn.nope:][:, order]
    q_rows = q_rows.flatten()
    k_rows = torch.cat([torch.arange(attn.kv_lora_rank), attn.kv_lora_rank + order])
    for layer in model.layers:
        attn = layer.self_attn
        if attn.rope_interleave:  # permuted already (a second GraphDecode on this model)
            continue
        q_last = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
        for linear, rows in ((q_last, q_rows), (attn.kv_a_proj_with_mqa, k_rows)):
            for t in (linear.weight, linear.bias):
                if t is not None:
                    t.data.copy_(t.data[rows.to(t.device)])
        attn.rope_interleave = True


@dataclass
class Held:
    """A cache the path keeps, with each of its rows' next input token and the state of each width stepped."""
    cache: object
    inputs: torch.Tensor  # [rows] int64 on the cache's device: the token each row's next step reads
    # (B, logits wanted) -> {"graph", "logits", "ids", "margins", "counter"}: a graph for each width and kind stepped
    widths: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)  # B -> the state of that width stepped last, whose picks ``picks`` gives
    # (B, W) -> {"graph", "logits", "tokens", "rows", "lengths"}: GraphDecode's captured prefills, the last used last
    prefills: dict = field(default_factory=dict)


class CapturedStep:
    """A decode step of the first B rows of a cache, captured once per (rows, max_len) cache and B in a CUDA graph
    and replayed (run eagerly without CUDA: ``graphs`` false); the ``MAX_CACHES`` caches used last are kept.
    Subclasses set ``model``, ``graphs`` and ``caches = {}`` and give ``_step(cache, tokens)`` (or ``_step_pick``);
    ``generate`` asks for a cache and steps through it.

    The step reads each row's input token from the cache's ``inputs`` buffer and ends with the greedy pick of each
    row (``picks``), written back there as that row's next input: ``generate.Rows`` steps on that buffer, so between
    two replays nothing but the picks' copies to the host runs outside the graph."""

    bucket = 1  # cache lengths rounded up to a multiple of it: fewer shapes to capture (and compile)
    pick_counts = 1  # the int32 counts of the step's pick launch (kernels/_count.py), zero after each launch
    # Caches kept, with their graphs: a server's batches ask for a new (rows, length) almost every time, and each
    # would otherwise hold its cache and graphs on the device for good; the least recently used goes first.
    MAX_CACHES = 8

    def cache(self, rows: int, max_len: int):
        """A cache of ``rows`` rows, reused across calls of the same shape (a captured graph holds its
        addresses), emptied (``reset``, its inputs zero). Asking for it makes it the most recently used."""
        key = (rows, -(-max_len // self.bucket) * self.bucket)  # the rounded length, which step() reads back
        if key not in self.caches:
            while len(self.caches) >= self.MAX_CACHES:
                self._drop(next(iter(self.caches)))
            cache = self.model.new_cache(*key)
            self.caches[key] = Held(cache, torch.zeros(rows, dtype=torch.long, device=cache.lengths.device))
        self.caches[key] = held = self.caches.pop(key)  # last in the dict's order: the most recently used
        held.cache.reset()
        held.inputs.zero_()
        return held.cache

    def _drop(self, key) -> None:
        held = self.caches.pop(key)
        for state in [*held.widths.values(), *held.prefills.values()]:
            if "graph" in state:  # not where its capture failed
                state["graph"].reset()

    def release(self) -> None:
        """Free the captured graphs (they hold NCCL work under expert parallelism) and the caches."""
        while self.caches:
            self._drop(next(iter(self.caches)))

    def _holding(self, cache) -> Held | None:
        """The path's record of ``cache``, or None where ``cache()`` did not make it."""
        held = self.caches.get((cache.lengths.shape[0], cache.max_len))
        return held if held is not None and held.cache is cache else None

    def _held(self, cache, what: str) -> Held:
        if (held := self._holding(cache)) is None:
            raise ValueError(f"{what}: the cache must come from this graph path's cache(): its graph holds that one")
        return held

    def inputs(self, cache) -> torch.Tensor:
        """The input token of each of the cache's rows [rows] int64, which its next step reads: ``step`` writes each
        row's greedy pick there, and a caller may write a row's (``generate.Rows``: a joining row's first token)."""
        return self._held(cache, "inputs").inputs

    def picks(self, cache, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [width] int64, margins [width] fp32): the greedy picks of the last ``step`` of ``width`` rows through
        this cache, the step's own tensors (rewritten by every step of that width)."""
        state = self._held(cache, "picks").last[width]
        return state["ids"], state["margins"]

    def step(self, cache, tokens: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """tokens [B] (one per cache row of the first B) -> logits [B, vocab], the step's own tensor (rewritten by the
        next step of that width); each row advances one position, and its greedy pick becomes its next input
        (``inputs``, ``picks``). ``logits`` False: a step that may leave them unmade (None) where its pick needs
        less (``GraphDecode``'s screened vocabulary projection), captured apart."""
        held = self._held(cache, "step")
        inputs = held.inputs[:tokens.shape[0]]
        if tokens.data_ptr() != inputs.data_ptr():  # given apart (``forced``): into the buffer the graph reads
            inputs.copy_(tokens)
        state = held.widths.setdefault((tokens.shape[0], logits), {})
        held.last[tokens.shape[0]] = state
        if "counter" not in state:  # the pick kernel's scratch, back at zero after each launch
            state["counter"] = torch.zeros(self.pick_counts, dtype=torch.int32, device=inputs.device)
        if not self.graphs:
            state["logits"], state["ids"], state["margins"] = self._step_pick(cache, inputs, state["counter"], logits)
            return state["logits"]
        if "graph" not in state:
            # the warm-up step advances every row and writes its picks over the inputs: both put back before the
            # capture, or the first replay would step from the warm-up's positions and tokens
            lengths, given = cache.lengths.clone(), inputs.clone()

            def undo():
                cache.lengths.copy_(lengths)
                inputs.copy_(given)

            state["graph"], (state["logits"], state["ids"], state["margins"]) = capture(
                lambda: self._step_pick(cache, inputs, state["counter"], logits), undo=undo)
        state["graph"].replay()
        return state["logits"]

    def _step_pick(self, cache, inputs: torch.Tensor, counter: torch.Tensor, logits: bool = True):
        """The step from ``inputs`` [B], then each row's greedy pick written over its input -> (logits, ids,
        margins); the logits are made whether wanted or not."""
        return self._pick(self._step(cache, inputs), inputs, counter)

    def _pick(self, logits: torch.Tensor, inputs: torch.Tensor, counter: torch.Tensor):
        """(logits, ids, margins), each row's greedy pick written over its input."""
        ids, margins = picks(logits, self.model.pick_kernel, counter)
        inputs.copy_(ids)  # each row's pick is its next input
        return logits, ids, margins


# The prefill (``GraphDecode.prefill``): captured in a CUDA graph per (rows, width rounded up to PREFILL_BUCKET) of at
# most PREFILL_TOKENS tokens, the PREFILLS shapes used last kept per cache (each holds its logits and activations);
# PREFILL_GRAPHS False: the eager forward (the A/B switch of tools/device_prefill.py).
PREFILL_GRAPHS = True
PREFILL_BUCKET = 16
PREFILL_TOKENS = 1024
PREFILLS = 4


class GraphDecode(CapturedStep):
    """Attached to a model by ``enable``; ``generate`` asks it for a cache, prefills into it and steps through it."""

    def __init__(self, model: Transformer, projections: str = "triton"):
        _interleave_rope(model)  # rope on the halves: before the projections' kernels take their weights
        self.model, self.ep = model, model.ep
        if projections == "triton":  # the dense projections through kernels/gemv.py at batch 1 (PDL, fused pairs:
            # 5.05 against cuBLAS's 5.30 ms a step on an H200) and kernels/skinny.py above it (docs/decode-log.md). The
            # routed experts have their own kernel over this path's stacks (the MoE layers' too, for the prefill), and
            # the vocabulary projection is cuBLAS's at any batch.
            routed = {id(m) for layer in model.layers if isinstance(layer.mlp, MoE) for m in layer.mlp.experts.modules()}
            decode_kernels.enable(model, skip=lambda mod: id(mod) in routed or mod is model.lm_head or
                                  isinstance(mod, MoE), max_rows=1, batched=True)
        # Triton is imported here, not with the engine: TRITON_INTERPRET is read when the kernels' decorators run
        from evident.kernels import head, mla, moe, norm, route

        self.head, self.mla, self.moe, self.norm, self.route = head, mla, moe, norm, route
        self.pick_counts = head.counts_for(model.lm_head.weight.shape[0])
        # the vocabulary projection's int8 screen, for a batch-1 step whose logits are not wanted (kernels/head.py;
        # docs/decode-log.md v34): of the weights as they are now, as the experts' stacks are
        head_kernel = model.pick_kernel is not None and model.lm_head.bias is None
        self.screen = head.screen_of(model.lm_head.weight) if head_kernel else None
        w = model.embed_tokens.weight
        self.device = w.device
        # a graph holds device work only: the host-staged combine runs eagerly
        self.graphs = torch.cuda.is_available() and w.is_cuda and (self.ep is None or self.ep.backend == "collective")
        self.inv_freq = model.inv_freq.to(self.device)  # on the device: a host copy cannot be captured
        model.inv_freq = self.inv_freq  # the forward's too: its prefill is captured
        self.stacks, self.routes = {}, {}
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mlp, MoE):
                moe = layer.mlp
                self.stacks[i] = decode_kernels.stack_experts(moe, shared=True)
                n_shared = self.stacks[i][0].shape[0] - len(moe.experts)
                # the router's arguments besides x, fixed per layer
                remap = _remap(moe, model.args.n_routed_experts, n_shared, self.ep)
                # the prefill's routed experts through the same stacks (the shared MLP stays the layer's own)
                moe.experts_kernel = decode_kernels.experts_kernel(*self.stacks[i], remap=remap)
                self.routes[i] = dict(shared=n_shared, remap=remap, method=moe.routing, n_group=moe.n_group or 1,
                                      topk_group=moe.topk_group or 1,
                                      bias=getattr(moe.gate, "e_score_correction_bias", None))
        # the router's launch counts its programs in one of these (each back at zero after it), one a layer; at
        # batch 1 it publishes x through another (kernels/pdl.py's publish), so the shared experts start early
        self.counters = torch.zeros(len(model.layers), dtype=torch.int32, device=self.device)
        self.ready = torch.zeros(len(model.layers), dtype=torch.int32, device=self.device)
        self.caches: dict[tuple[int, int], Held] = {}  # (rows, max_len) -> its cache, graphs and inputs
        if self.ep is not None:
            self.ep.before_close(self.release)

    def release(self) -> None:
        """Free what the path holds of its own on the device (the expert parameters stay, views of the stacks)."""
        super().release()
        self.stacks.clear()

    # --- the prefill -------------------------------------------------------------------------
    def prefill(self, cache: LatentCache, tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor
                ) -> torch.Tensor:
        """tokens [B, W] (right-padded, ``lengths`` [B] each row's own) into emptied ``rows`` [B] of a cache from
        ``cache()`` -> logits [B, W, vocab]: the model's forward, without a host synchronisation (the rows start at
        0), captured once per (B, W rounded up) in a CUDA graph and replayed on the new inputs (their padding to the
        rounded width computed, written past each row's length and never read). Without CUDA, or for more than
        PREFILL_TOKENS tokens, or into a cache not from ``cache()`` (no graph may hold it), the forward itself."""
        B, W = tokens.shape
        width = min(-(-W // PREFILL_BUCKET) * PREFILL_BUCKET, cache.max_len)
        held = self._holding(cache)
        if not (self.graphs and PREFILL_GRAPHS) or B * width > PREFILL_TOKENS or held is None:
            return self.model(tokens, cache, rows, lengths, start=0)
        state = held.prefills.pop((B, width), None)
        if state is None:
            while len(held.prefills) >= PREFILLS:
                held.prefills.pop(next(iter(held.prefills)))["graph"].reset()
            state = {k: torch.zeros(*shape, dtype=torch.long, device=self.device)
                     for k, shape in (("tokens", (B, width)), ("rows", (B,)), ("lengths", (B,)))}
        state["tokens"][:, :W].copy_(tokens)
        state["tokens"][:, W:].copy_(tokens[:, -1:].expand(B, width - W))
        state["rows"].copy_(rows)
        state["lengths"].copy_(lengths)
        if "graph" not in state:
            before = cache.lengths.clone()  # the warm-up's advance, put back before the capture
            state["graph"], state["logits"] = capture(
                lambda: self.model(state["tokens"], cache, state["rows"], state["lengths"], start=0),
                undo=lambda: cache.lengths.copy_(before))
        held.prefills[(B, width)] = state  # the most recently used last
        state["graph"].replay()
        return state["logits"][:, :W].clone()  # the graph's own buffer, rewritten by the next replay

    # --- the step ----------------------------------------------------------------------------
    def _step_pick(self, cache: LatentCache, inputs: torch.Tensor, counter: torch.Tensor, logits: bool = True):
        """The step; at batch 1 with the kernels attached its end (the vocabulary projection, the pick, its write
        over the input, the position's advance) is one launch (kernels/head.py), or where the logits are not wanted
        two through the projection's screen (no logits made: None), else torch's projection and ``CapturedStep``'s
        pick."""
        x, pos, lm_head = self._hidden(cache, inputs), cache.lengths[:inputs.shape[0]], self.model.lm_head

        def apart():
            logits = lm_head(x)
            pos.add_(1)
            return self._pick(logits, inputs, counter)

        if self.model.pick_kernel is None or lm_head.bias is not None:
            return apart()
        w = lm_head.weight
        if not logits and self.screens(x.shape[0]) and not self.head.screen_reason(x, w, self.screen, inputs, pos):
            return None, *self.head.head_pick_screened(x, w, self.screen, inputs, pos, fallback=None)
        return self.head.head_pick(x, w, counter, inputs, pos, fallback=apart)

    def screens(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows whose logits are not wanted picks through the vocabulary projection's
        screen (the bench's floor counts the screen's bytes in place of the projection's then)."""
        return rows == 1 and self.head.SCREEN and self.screen is not None and self.model.pick_kernel is not None

    def _hidden(self, cache: LatentCache, tokens: torch.Tensor) -> torch.Tensor:
        """The step up to the final norm's output [B, D]; the positions not yet advanced."""
        m, norm = self.model, self.norm
        pos = cache.lengths[:tokens.shape[0]]
        first = m.layers[0].input_layernorm
        h, x = norm.embed_rms_norm(tokens, m.embed_tokens.weight, first.weight, first.eps)
        for i, layer in enumerate(m.layers):  # each residual add runs fused with the norm after it
            attn = self._attention(layer.self_attn, x, cache, i, pos)
            post = layer.post_attention_layernorm
            after = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
            if isinstance(layer.mlp, MoE):
                h, x = self._moe(layer.mlp, h, attn, post, i, after)
            else:
                h, x = norm.add_rms_norm(h, attn, post.weight, post.eps)
                h, x = norm.add_rms_norm(h, layer.mlp(x), after.weight, after.eps)
        return x

    def _attention(self, attn, x, cache: LatentCache, layer: int, pos) -> torch.Tensor:
        q, kv_a = project_pair(x, attn.q_in, attn.kv_a_proj_with_mqa, attn.pair_kernel)
        if not hasattr(attn, "q_proj"):
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q = q.view(x.shape[0], attn.n_heads, -1)
        w_kv = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope + attn.v_dim, attn.kv_lora_rank)
        return attn.o_proj(self.mla.mla_decode(q, kv_a, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps,
                                               self.inv_freq, self.model.attention_scaling, w_kv, cache.kv, cache.pe,
                                               layer, pos, attn.scale, ahead=self._ahead(layer, x.shape[0])))

    def _ahead(self, layer: int, rows: int) -> tuple[torch.Tensor, ...]:
        """At batch 1, the next layer's q and kv_a projection weights, for this layer's attention to ask into L2 while
        HBM is idle (docs/decode-log.md v25; at batch 8 it made the step slower)."""
        if rows != 1 or layer + 1 >= len(self.model.layers):
            return ()
        attn = self.model.layers[layer + 1].self_attn
        return attn.q_in.weight, attn.kv_a_proj_with_mqa.weight

    def _moe(self, moe: MoE, h: torch.Tensor, attn: torch.Tensor, post, layer: int, after):
        """The post-attention add and norm with the router (one launch), then (h + the MoE's output, its norm):
        routed and shared experts through the stacks."""
        w13, w2 = self.stacks[layer]
        n_shared = self.routes[layer]["shared"]
        # At batch 1 on one device the shared experts' gate/up programs need only x: they start once the router has
        # published it, beside its logits and selection (docs/decode-log.md v23). Their output buffer is made before
        # the router's launch, so that it cannot reuse memory the router's launch still reads.
        ready = self.ready[layer:layer + 1] if h.shape[0] == 1 and n_shared and self.ep is None else None
        out = None if ready is None else self.moe.gate_up_out(h, w13, moe.top_k + n_shared)  # x is h's shape and dtype
        # Then down's programs start on the slots gate_up has written, h's buffer marked unwritten by the router (v28).
        early = n_shared if ready is not None and self.moe.EARLY_DOWN else 0
        h_reset = (out, self.moe.sentinel(out.dtype)) if early else None
        h, x, ids, weights = self.route.add_norm_route(h, attn, post.weight, post.eps, moe.gate.weight, moe.top_k,
                                                       moe.norm_topk_prob, moe.routed_scaling_factor,
                                                       counter=self.counters[layer:layer + 1], ready=ready,
                                                       h_reset=h_reset, **self.routes[layer])
        if self.ep is not None:  # this rank's fp32 partial, summed over ranks, then the add
            partial = self.ep.combine(self.moe.moe_experts(x, w13, w2, ids, weights))
            return self.norm.add_rms_norm(h, partial, after.weight, after.eps)
        pairs = self.moe.route(ids)  # sorted by expert once, for both kernels
        shared = None if ready is None else (ready, n_shared)
        y = self.moe.experts_down(self.moe.experts_gate_up(x, w13, ids, pairs, shared=shared, out=out), w2, ids, pairs,
                                  early=early)
        return self.norm.moe_add_rms_norm(h, y, weights, after.weight, after.eps)


def enable(model: Transformer) -> Transformer:
    """Attach the graph decode path to ``model`` in place (``generate`` then decodes through it). A DeepSeek-V4 model
    has its own (engine/v4_graph.py, which builds on this module; checkpoint.enable_decode_path picks it)."""
    if model.args.model_type == V4:
        raise ValueError("DeepSeek-V4's graph decode path is engine.v4_graph.enable")
    model.graph_decode = GraphDecode(model)
    return model


def screened(model, rows: int) -> bool:
    """Whether ``model``'s decode step of ``rows`` rows, its logits not wanted, picks through the vocabulary
    projection's screen (the floors count the screen's bytes then): only GraphDecode's can; DeepSeek-V4's graph step,
    the torch path and transformers' models read the projection's weight."""
    dec = getattr(model, "graph_decode", None)
    return isinstance(dec, GraphDecode) and dec.screens(rows)


__all__ = ["GraphDecode", "enable", "screened"]
