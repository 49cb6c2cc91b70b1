"""The engine's graph decode path (engine/graph_decode.py) against the real transformers DeepseekV2.

The step absorbs MLA's up-projections and attends over the whole static cache with a mask, and routes
experts through kernels/moe.py: different arithmetic from HF's, so logits agree to fp32 rounding and greedy
tokens exactly on a micro model in fp32. On the CPU the step runs eagerly (the MoE kernel through Triton's
interpreter); on a GPU it is captured in a CUDA graph and replayed, and the same checks hold.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_engine_kernels import MICRO, N_NEW, PROMPT, micro_models  # noqa: E402
from test_engine_parity import hf_generate  # noqa: E402

from evident.engine import graph_decode  # noqa: E402
from evident.engine.generate import Rows, forced, generate  # noqa: E402

CUDA = torch.cuda.is_available()
LONGER = [5, 9, 60, 33, 12, 7, 81, 40]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return micro_models(tmp_path_factory, graph_decode.enable)


def test_graph_path_greedy_equals_hf(models):
    hf, _, fast = models
    for prompt in (PROMPT, LONGER):
        assert generate(fast, [prompt], N_NEW).tokens[0] == hf_generate(hf, prompt, N_NEW)


def test_graph_step_logits_close_to_hf(models):
    hf, _, fast = models
    dec = fast.graph_decode
    cache = dec.cache(1, len(LONGER) + 3)
    with torch.inference_mode():
        fast(torch.tensor([LONGER[:-2]], device=cache.kv.device), cache)  # prefill on the ordinary forward
        steps = [dec.step(cache, torch.tensor([t], device=cache.kv.device))[0].double().cpu().clone()
                 for t in LONGER[-2:]]
        ref = hf(torch.tensor([LONGER])).logits[0, -2:].double()
    assert cache.lengths[0].item() == len(LONGER)  # the step advanced the row itself
    for got, want in zip(steps, ref):
        assert (got - want).abs().max().item() < 1e-4


def test_the_steps_end_at_batch_1_is_one_launch(models):
    """At batch 1 the step's end is one launch (kernels/head.py): the vocabulary projection is the kernel's, never
    lm_head's module, and the logits and the pick written as the next input are still transformers'; at batch 2 it is
    lm_head's."""
    hf, _, fast = models
    dec, calls = fast.graph_decode, []
    hook = fast.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            cache = dec.cache(1, len(LONGER) + 1)
            fast(torch.tensor([LONGER[:-1]], device=cache.kv.device), cache)
            calls.clear()
            got = dec.step(cache, torch.tensor([LONGER[-1]], device=cache.kv.device))[0].double().cpu()
            ref = hf(torch.tensor([LONGER])).logits[0, -1].double()
            assert not calls and cache.lengths[0].item() == len(LONGER)
            assert (got - ref).abs().max().item() < 1e-4 and dec.inputs(cache).item() == ref.argmax().item()
            two = dec.cache(2, len(PROMPT) + 1)
            fast(torch.tensor([PROMPT, PROMPT]), two)
            dec.step(two, torch.tensor([7, 7]))
            assert calls
    finally:
        hook.remove()


def test_the_steps_end_without_logits_picks_through_the_screen_as_the_logits_step(models):
    """At batch 1 a step whose logits no one wants (generate without an observer) picks through the vocabulary
    projection's int8 screen (kernels/head.py), the one end of a step that makes no logits; its tokens and margins are
    those of the step that makes them (an observer asks for them), bit for bit."""
    _, _, fast = models
    dec = fast.graph_decode
    assert dec.screen is not None
    assert dec.screens(1) and not dec.screens(2)
    # what the bench's and the profile's floors count: this path at one row only, never the torch path's model
    assert graph_decode.screened(fast, 1) and not graph_decode.screened(fast, 2)
    assert not graph_decode.screened(models[1], 1)
    for prompt in (PROMPT, LONGER):
        quiet = generate(fast, [prompt], N_NEW)
        seen = generate(fast, [prompt], N_NEW, observe=lambda *_: None)
        assert quiet.tokens == seen.tokens and quiet.margins == seen.margins
        held = dec.caches[(1, len(prompt) + N_NEW)]
        assert held.widths[(1, False)]["logits"] is None and held.widths[(1, True)]["logits"] is not None


def test_graph_path_rows_of_a_batch_agree_and_finished_rows_do_not_disturb(models):
    _, plain, fast = models
    many = generate(fast, [PROMPT] * 3, N_NEW)
    assert all(row == many.tokens[0] for row in many.tokens)
    # rows of different prompts (and lengths) decode together: each as the torch path decodes it alone
    mixed = generate(fast, [PROMPT, LONGER], N_NEW)
    assert mixed.tokens == [generate(plain, [p], N_NEW).tokens[0] for p in (PROMPT, LONGER)]
    # a row that stops early (EOS) is still stepped (at position 0); the other row's tokens do not change
    eos, other = mixed.tokens[0][0], mixed.tokens[1]
    cut = other.index(eos) + 1 if eos in other else len(other)
    assert generate(fast, [PROMPT, LONGER], N_NEW, eos_token_id=eos).tokens == [[eos], other[:cut]]


def test_the_step_picks_and_writes_each_rows_pick_as_its_next_input(models):
    """The greedy pick runs inside the step (its graph on a GPU) and is written over each row's input in the path's
    buffer, which Rows steps on: after generate it holds each row's last token; tokens given apart (forced's) are
    copied into it first."""
    _, _, fast = models
    dec = fast.graph_decode
    gen = generate(fast, [PROMPT, LONGER], N_NEW)
    cache = dec.caches[(2, len(LONGER) + N_NEW)].cache
    last = [row[-1] for row in gen.tokens]
    assert dec.inputs(cache).tolist() == last and dec.picks(cache, 2)[0].tolist() == last
    with torch.inference_mode():
        cache = dec.cache(2, len(PROMPT) + 2)
        dev = cache.kv.device
        fast(torch.tensor([PROMPT, PROMPT[::-1]], device=dev), cache)
        given, at = torch.tensor([7, 11], device=dev), cache.lengths.clone()
        apart = dec.step(cache, given).clone()
        pick = apart.argmax(-1)
        assert torch.equal(dec.inputs(cache), pick) and torch.equal(dec.picks(cache, 2)[0], pick)
        cache.lengths.copy_(at)
        dec.inputs(cache).copy_(given)
        assert torch.equal(dec.step(cache, dec.inputs(cache)), apart)


def test_forced_logits_are_the_observers_to_keep(models):
    """The step's logits are its graph's own buffer, rewritten by the next step: forced hands its observer copies (a
    list that kept them held the last step's logits at every step on the H200, 9.8 off the torch path's)."""
    _, plain, fast = models

    def kept(model):
        seen = []
        forced(model, [PROMPT] * 2, [LONGER] * 2, seen.append)
        return seen

    got, want = kept(fast), kept(plain)
    assert len(got) == len(LONGER)  # the prefill's, then one a step
    assert all((g - w).abs().max().item() < 1e-4 for g, w in zip(got, want))
    buffers = {state["logits"].untyped_storage().data_ptr()
               for held in fast.graph_decode.caches.values() for state in held.widths.values()
               if state["logits"] is not None}
    assert buffers and not buffers & {g.untyped_storage().data_ptr() for g in got}


def slot_reused(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Through generate.Rows, two slots: prompts 0 and 1 join together, row 0 leaves after its second token and its
    slot is stepped idle (the graph step advances every slot joined so far) for three steps, then prompt 2 joins into
    it. -> each row's tokens (row 0's two, the others' n)."""
    tokens, row_of = [[] for _ in prompts], {}

    def take(s: int, t: int, _margin: float) -> bool:
        tokens[row_of[s]].append(t)
        return len(tokens[row_of[s]]) == (2 if row_of[s] == 0 else n)

    def add(ks):
        slots, logits = rows.join([prompts[k] for k in ks])
        row_of.update(zip(slots, ks))
        rows.advance(slots, torch.stack([lg[-1] for lg in logits]), take)

    with torch.inference_mode():  # as generate's (a graph path's cache, made in an earlier one, is reset in it)
        rows = Rows(model, 2, max(len(p) for p in prompts) + n)
        add([0, 1])
        while rows.free() < 2:
            if len(tokens[1]) == 5 and not tokens[2]:
                assert rows.cache.lengths[0].item() == 1  # stepped idle from position 0, not on from its row's
                add([2])
            rows.advance(*rows.step(), take)
    return tokens


def test_a_slot_left_idle_and_reused_leaves_every_row_as_alone(models):
    _, plain, fast = models
    prompts, n = [PROMPT, LONGER, LONGER[:5]], 6  # 6: row 1 still steps beside the row that takes the slot
    alone = [generate(plain, [p], n).tokens[0] for p in prompts]
    assert slot_reused(fast, prompts, n) == [alone[0][:2], *alone[1:]]


def test_the_prefill_takes_the_experts_kernel_over_the_stacks(models, monkeypatch):
    """The graph path's prefill (the ordinary forward) runs each MoE layer's routed experts in one kernels.moe call
    over the step's stacks, at any row count, and its logits are the torch path's within fp32 rounding."""
    from evident.kernels import moe
    from test_engine_kernels import RAGGED, TOL, prefill_logits

    _, plain, fast = models
    calls, real = [], moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda x, w13, *a, **k: (calls.append((x.shape[0], w13)),
                                                                       real(x, w13, *a, **k))[1])
    got = prefill_logits(fast, RAGGED[1:])
    stacks = [fast.graph_decode.stacks[i][0] for i in sorted(fast.graph_decode.stacks)]
    assert [n for n, _ in calls] == [2 * 7] * len(stacks) and all(w is s for (_, w), s in zip(calls, stacks))
    assert all((a - b).abs().max() < TOL for a, b in zip(got, prefill_logits(plain, RAGGED[1:])))


class Replays:
    """A CUDA graph's stand-in on the CPU (``stand_in_capture``): a replay runs the captured call again into the
    captured output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())

    def reset(self):
        pass


def test_the_prefill_is_captured_once_per_shape_and_replayed_on_new_inputs(models, monkeypatch):
    """GraphDecode.prefill with a stand-in for the graph: one capture per (rows, width rounded up to PREFILL_BUCKET),
    each prefill's inputs refilled into its buffers, the warm-up's advance undone; logits HF's for each prompt alone."""
    from test_engine_kernels import prefill_logits

    hf, _, fast = models
    captures = []

    def stand_in_capture(fn, undo=None, **_):
        fn()  # the warm-up, put back
        undo()
        out = fn()  # a capture records, it does not run: put back too
        undo()
        captures.append(fn)
        return Replays(fn, out), out

    monkeypatch.setattr(graph_decode, "capture", stand_in_capture)
    monkeypatch.setattr(fast.graph_decode, "graphs", True)
    monkeypatch.setattr(fast.graph_decode, "caches", {})  # this test's own (on a GPU, earlier tests captured theirs)
    with torch.inference_mode():
        for prompts in ([PROMPT, LONGER], [LONGER[:3], PROMPT + [7]]):  # widths 8 and 6: both 16
            rows = Rows(fast, 2, 20)
            _, got = rows.join(prompts)
            assert rows.cache.lengths.tolist() == [len(p) for p in prompts]
            for g, p in zip(got, prompts):
                with torch.no_grad():
                    assert (g.double().cpu() - hf(torch.tensor([p])).logits[0].double()).abs().max() < 1e-4
        # a cache not from the path's cache(): no graph may hold it, so the forward itself, nothing captured
        got = prefill_logits(fast, [PROMPT, LONGER])
    assert len(captures) == 1
    assert [list(h.prefills) for h in fast.graph_decode.caches.values() if h.prefills] == [[(2, 16)]]
    with torch.no_grad():
        assert all((g - hf(torch.tensor([p])).logits[0].double()).abs().max() < 1e-4 for g, p in zip(got, [PROMPT, LONGER]))


def test_experts_become_views_of_the_stacks(models):
    _, _, fast = models
    layer = next(i for i, l in enumerate(fast.layers) if hasattr(l.mlp, "experts"))
    w13, w2 = fast.graph_decode.stacks[layer]
    e1 = fast.layers[layer].mlp.experts["1"]
    assert e1.up_proj.weight.data_ptr() == w13[1, MICRO["moe_intermediate_size"]:].data_ptr()
    assert e1.down_proj.weight.data_ptr() == w2[1].data_ptr()


def test_shared_experts_are_the_last_slices_of_the_stacks(models):
    _, _, fast = models
    layer = next(i for i, l in enumerate(fast.layers) if hasattr(l.mlp, "experts"))
    w13, w2 = fast.graph_decode.stacks[layer]
    sh, inter = fast.layers[layer].mlp.shared_experts, MICRO["moe_intermediate_size"]
    assert w13.shape[0] == MICRO["n_routed_experts"] + MICRO["n_shared_experts"]
    for j in range(MICRO["n_shared_experts"]):
        rows = slice(j * inter, (j + 1) * inter)
        e = MICRO["n_routed_experts"] + j
        assert torch.equal(w13[e], torch.cat([sh.gate_proj.weight[rows], sh.up_proj.weight[rows]]))
        assert torch.equal(w2[e], sh.down_proj.weight[:, rows])


def test_the_shared_experts_start_early_at_batch_1_only(models):
    """At batch 1 every MoE layer's router publishes x (its layer's flag 1 after a step, kernels/pdl.py) for the
    shared experts' programs to start before its end; above batch 1 nothing is published."""
    _, _, fast = models
    dec = fast.graph_decode
    moe = [hasattr(layer.mlp, "experts") for layer in fast.layers]
    assert any(moe) and MICRO["n_shared_experts"]
    dec.ready.zero_()
    generate(fast, [PROMPT] * 2, 2)
    assert dec.ready.tolist() == [0] * len(moe)
    generate(fast, [PROMPT], 2)
    assert dec.ready.tolist() == [int(m) for m in moe]


@pytest.mark.parametrize("rank", [0, 1])
def test_router_ids_map_to_this_ranks_stack_rows(rank):
    """Expert parallelism over 2 ranks, 4 routed experts and 3 shared slices: a rank's own experts map to its
    stack rows in order, shared slice j to the rank j mod 2, everything else to -1 (not computed here)."""
    from evident.engine.config import ModelArgs
    from evident.engine.model import MoE
    from evident.engine.parallel import ExpertParallel

    ep = ExpertParallel(rank, 2, "collective")
    moe = MoE(ModelArgs.from_hf({**MICRO, "n_shared_experts": 3}), ep)
    table = graph_decode._remap(moe, 4, 3, ep).tolist()
    want = [0, 1, -1, -1, 2, -1, 4] if rank == 0 else [-1, -1, 0, 1, -1, 3, -1]
    assert table == want
    assert graph_decode._remap(moe, 4, 3, None) is None


def test_closing_the_expert_parallel_group_releases_the_graphs(models):
    """Captured NCCL work must be freed before the communicator is destroyed (pytorch#115388): the step
    registers its release with the group, which runs it first on close()."""
    from evident.engine.parallel import ExpertParallel

    _, plain, _ = models
    ep, saved = ExpertParallel(0, 1, "collective"), plain.ep
    plain.ep = ep
    try:
        dec = graph_decode.GraphDecode(plain, projections="torch")
        dec.cache(1, 8)
        assert dec.caches
        ep.close()
        assert not dec.caches and ep._before_close == []
    finally:
        plain.ep = saved


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_graph_is_captured_once_per_shape_and_replayed(models):
    _, _, fast = models
    dec = fast.graph_decode
    generate(fast, [PROMPT] * 2, N_NEW)
    def graphs():
        return [s["graph"] for held in dec.caches.values() for s in held.widths.values()]

    before = graphs()
    again = generate(fast, [PROMPT] * 2, N_NEW)
    assert graphs() == before and before
    assert again.tokens == generate(fast, [PROMPT] * 2, N_NEW).tokens


def test_the_path_keeps_a_bounded_number_of_caches_the_least_recently_used_going(models, monkeypatch):
    """A server asks for a new (rows, length) almost every batch: the path keeps MAX_CACHES caches (with their graphs),
    dropping the least recently used; a cache asked for again is the same one, and decodes as a fresh one."""
    _, _, fast = models
    dec = fast.graph_decode
    monkeypatch.setattr(dec, "MAX_CACHES", 3)
    monkeypatch.setattr(dec, "caches", {})  # the other tests' caches stay theirs
    with torch.inference_mode():  # as generate makes them
        first = dec.cache(1, 40)
        for n in (41, 42):
            dec.cache(1, n)
        assert dec.cache(1, 40) is first  # now the most recently used: 41 goes next
        for n in (43, 44):
            dec.cache(1, n)
    assert list(dec.caches) == [(1, 40), (1, 43), (1, 44)]
    assert generate(fast, [PROMPT], N_NEW).tokens == generate(fast, [PROMPT], N_NEW).tokens
    assert len(dec.caches) == 3


def test_profile_captures_the_graph_step(models, monkeypatch):
    """bench.kernels: graph profiles the step the benchmark times, not the model's ordinary forward."""
    from evident.workflow.bench import profilers

    _, _, fast = models
    calls = []
    real = fast.graph_decode.step
    monkeypatch.setattr(fast.graph_decode, "step",
                        lambda c, t, **kw: (calls.append(tuple(t.shape)), real(c, t, **kw))[1])
    assert len(profilers.decode_steps(fast, PROMPT, 2, 3, cuda=False)) == 3
    assert calls == [(2,)] * 3


def test_rope_on_the_halves_becomes_interleaved_pairs_computing_the_same(tmp_path):
    """DeepSeek-V3 with rope_interleave false (q LoRA set, yarn): enabling the graph path permutes q's and k's rope
    rows into interleaved pairs; the ordinary forward then rotates interleaved pairs, to the same logits."""
    from test_engine_parity import CONFIGS, hf_model

    from evident.engine.checkpoint import load_model
    from evident.engine.model import LatentCache

    hf = hf_model({**CONFIGS["v3-q_direct-e16-g4-t1-k3-yarn4-halves"], "q_lora_rank": 16})
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = torch.tensor([LONGER])
    with torch.inference_mode():
        before = model(ids, LatentCache.for_model(model, 1, len(LONGER)))
        graph_decode.enable(model)
        after = model(ids, LatentCache.for_model(model, 1, len(LONGER)))
        graph_decode.enable(model)  # a second graph path on the same model permutes nothing again
        again = model(ids, LatentCache.for_model(model, 1, len(LONGER)))
        want = hf(ids).logits
    assert torch.equal(again, after)
    assert all(layer.self_attn.rope_interleave for layer in model.layers) and not model.args.rope_interleave
    assert (after - before).abs().max().item() < 1e-5 and (after - want).abs().max().item() < 1e-4
    assert generate(model, [PROMPT], N_NEW).tokens[0] == hf_generate(hf, PROMPT, N_NEW)


@pytest.mark.parametrize("name", ["v2group-q_direct-e8-g4-t2-k3-yarn4", "v3-q_lora-e8-g4-t2-k3-interleave",
                                  "v3-q_direct-e16-g4-t1-k3-yarn4-halves"])
def test_graph_path_of_the_group_routings_equals_hf(name, tmp_path):
    """DeepSeek-V2's group-limited and DeepSeek-V3's noaux_tc routing through the graph step: transformers' greedy
    tokens, and every row of a batch alike. One step of a B=8 batch (4 prompts of different lengths, each in two
    rows; on a CPU, where the interpreter's time grows with the rows, 3 prompts: B=6) against each prompt's B=1
    step: alike rows of the batch bitwise equal, each row its prompt's B=1 logits to fp32 rounding and the same
    argmax. Not bitwise across batch sizes: the step's projections take kernels.gemv at B=1 and kernels.skinny at
    2-16 rows, the routed experts a one-row and a tensor-core kernel, which sum in other orders (kernels/KERNELS.md,
    "Numerics"), and on a CPU the lm_head's torch matmul differs by batch too. On a CPU it can differ by row as well
    (MKL's AVX2 kernel rounds equal rows of one block by their place in it), so there the alike rows are compared
    bitwise at the lm_head's input, where the engine's own work ends (the step runs eagerly there: a hook sees it),
    and their logits to that matmul's rounding."""
    from test_engine_parity import CONFIGS, hf_model

    from evident.engine.checkpoint import load_model

    hf = hf_model(CONFIGS[name])
    hf.save_pretrained(tmp_path)
    fast = graph_decode.enable(load_model(tmp_path, device="cuda" if CUDA else "cpu"))
    want = hf_generate(hf, PROMPT, N_NEW)
    gen = generate(fast, [PROMPT] * 3, N_NEW)
    assert gen.tokens == [want] * 3

    dec, dev = fast.graph_decode, fast.embed_tokens.weight.device
    prompts = [PROMPT, LONGER, LONGER[::-1][:3], [200, *PROMPT]][:4 if CUDA else 3]
    n = len(prompts)
    max_len = len(LONGER) + 1  # one cache length at both batch sizes: the same attention sums
    with torch.inference_mode():
        batch, alone = dec.cache(2 * n, max_len), []
        for r, p in enumerate(prompts):  # each prompt prefilled once, alone, its cache row copied to rows r and r + n
            one = dec.cache(1, max_len)
            fast(torch.tensor([p], device=dev), one)
            for row in (r, r + n):
                batch.kv[:, row], batch.pe[:, row], batch.lengths[row] = one.kv[:, 0], one.pe[:, 0], one.lengths[0]
            alone.append(dec.step(one, torch.tensor([want[0]], device=dev))[0].double().cpu())
        heads = []  # the batch step's lm_head input, where the step runs eagerly
        hook = None if dec.graphs else fast.lm_head.register_forward_hook(lambda mod, args, out: heads.append(args[0]))
        got = dec.step(batch, torch.tensor([want[0]] * 2 * n, device=dev)).double().cpu()
    if hook is not None:
        hook.remove()
    alike = got if dec.graphs else heads[-1]
    assert batch.lengths.tolist() == [len(p) + 1 for p in prompts] * 2 and alike.shape[0] == 2 * n
    for r in range(n):
        assert torch.equal(alike[r], alike[r + n]), f"{name}: alike rows {r} and {r + n}"
        assert (got[r] - got[r + n]).abs().max() <= 1e-6 * got[r].abs().max(), f"{name}: logits {r} and {r + n}"
        diff = (got[r] - alone[r]).abs().max().item()
        assert diff < 1e-5 and got[r].argmax() == alone[r].argmax(), f"{name}: prompt {r}: B=8 vs B=1 {diff:.3g}"
