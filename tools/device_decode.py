"""Decode-step probe on a lent GPU (issue 8), without a checkpoint on disk: the DeepSeek-V2-Lite shape with
random bf16 weights built on the GPU, the torch path against the graph path (same weights), then TPOT.

    python3 tools/device_decode.py [--layers 27] [--tokens 32] [--profile] [--projections torch,triton] [--pdl on,off]
        [--knobs "mla.SPLITS=1;moe.DOWN_BLOCK_N=2,moe.BLOCK_N=2;carveout.gemv._rows_kernel=30"] [--cache-len 2048]
    python3 tools/device_decode.py --knockout   # each kind of launch's share of the replayed step
    torchrun --nproc-per-node 2 tools/device_decode.py --ep      # expert parallelism, collective combine

Prints: tokens agreement, TPOT p50 per path and batch (a CUDA event at each step's end), the captured step replayed
back to back (the device's time alone: TPOT less that is the host's share), and with --profile
the eager step's top kernels (torch.profiler). With --knockout: the step captured again with one kind of launch left
out (its output left as it was: wrong values, the same shapes) and replayed; the drop against the whole step is
that launch's share of the step's critical path, which a fusion can save at most (it keeps the work). At batch 8
only the launches after the router read true: one left out before it makes the rows differ, and they route to more
experts. With --ep: the graph step on rank 0's GPU alone, then over the ranks (each holding its shard of the same
weights: every parameter is drawn from a generator seeded by its name), tokens compared. The pipeline's bench stage
makes the figures of record.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import functools
import importlib
import json
import statistics
import sys
import zlib
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evident.engine import generate as generate_module  # noqa: E402
from evident.engine import graph_decode
from evident.engine.config import ModelArgs  # noqa: E402
from evident.engine.generate import generate  # noqa: E402
from evident.engine.model import Transformer  # noqa: E402

SHAPE = Path(__file__).resolve().parents[1] / "config/campaigns/dsv2-lite-graph.yaml"


def build(layers: int, ep=None) -> Transformer:
    import yaml

    cfg = dict(yaml.safe_load(SHAPE.read_text())["checkpoint"]["config"], num_hidden_layers=layers)
    args = ModelArgs.from_hf(cfg)
    with torch.device("cuda"):
        model = Transformer(args, ep).to(torch.bfloat16)
    return randomize(model, "cuda")


def randomize(model: Transformer, device: str) -> Transformer:
    """Random weights in place, each parameter drawn from a generator seeded by its name (the same model on every
    rank and every build; std 0.08, as the DeepSeek-V2-Lite campaigns' synthetic checkpoints), the router in fp32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.08 if p.dim() > 1 else 0.02, generator=g)
            if "gate.weight" in name:
                p.data = p.data.float()
    return model.eval()


def tpot(model, batch: int, tokens: int, prompt: list[int]) -> tuple[float, list[int]]:
    marks = []

    @contextlib.contextmanager
    def mark(*_):  # generate's around: each step's end on the device
        yield
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)

    with torch.inference_mode():
        generate(model, [prompt] * batch, tokens, around=mark)  # warm-up (and graph capture)
        marks.clear()
        gen = generate(model, [prompt] * batch, tokens, around=mark)
    torch.cuda.synchronize()
    steps = [a.elapsed_time(b) for a, b in zip(marks[1:], marks[2:])]
    return statistics.median(steps), gen.tokens[0]


def replay_ms(dec, batch: int, start: int, n: int) -> float:
    """Median ms of the last captured graph of ``batch`` rows replayed back to back, no host work between: the
    step's own time on the device (its greedy pick included: it runs in the graph), against which TPOT shows the
    host's share."""
    held = next(h for h in dec.caches.values() if batch in h.last)
    cache, graph = held.cache, held.last[batch]["graph"]
    with torch.inference_mode():  # the cache was made in it
        cache.lengths.fill_(start)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for e in events[1:]:
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


CORES = ("_latent_attention_kernel", "_latent_attention_gluon")  # kernels/mla.py's two attention cores


class _Skip:
    """A Triton kernel that launches nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def knockout(model, prompt: list[int]) -> None:
    """The replayed step at b1 and b8 with each kind of launch left out in turn."""
    from evident.kernels import mla, moe, norm, route

    made, args = {}, model.args
    slots = args.num_experts_per_tok + args.n_shared_experts  # the router's: routed, then shared slices
    q_dim, kv_dim = args.num_attention_heads * args.qk_head_dim, args.kv_lora_rank + args.qk_rope_head_dim

    def once(key, make):  # made on the warm-up step, before the capture, then the same tensor
        return made[key] if key in made else made.setdefault(key, make())

    def routes(h, delta, *_, **__):
        slot = list(range(args.num_experts_per_tok)) + [args.n_routed_experts + j for j in range(args.n_shared_experts)]
        ids = once(("ids", h.shape[0]), lambda: torch.tensor([slot] * h.shape[0], device="cuda"))
        return h, h, ids, once(("w", h.shape[0]), lambda: torch.full((h.shape[0], slots), 0.1, device="cuda"))

    def pair(x, *_):
        return (once(("q", x.shape[0]), lambda: torch.randn(x.shape[0], q_dim, device="cuda", dtype=x.dtype)),
                once(("kv", x.shape[0]), lambda: torch.randn(x.shape[0], kv_dim, device="cuda", dtype=x.dtype)))

    def down(x, *_):  # the slots' outputs, fp32 [B, slots, D]
        return once(("y", x.shape[0]), lambda: torch.zeros(x.shape[0], slots, x.shape[1], device="cuda"))

    o_proj = [(layer.self_attn, "o_proj", torch.nn.Identity()) for layer in model.layers]
    left_out = {
        "nothing": [],
        "q + kv_a projection": [(graph_decode, "project_pair", pair)],
        "mla q absorb + cache write": [(mla, "_q_latent_kernel", _Skip())],
        "mla attention core": [(mla, k, _Skip()) for k in CORES],
        "mla output absorb": [(mla, "_out_kernel", _Skip())],
        "mla, all three": [(mla, k, _Skip()) for k in ("_q_latent_kernel", *CORES, "_out_kernel")],
        "o_proj": o_proj,
        "add + norm + router": [(route, "add_norm_route", routes)],
        "experts (gate_up + down)": [(moe, "experts_gate_up", lambda x, *_: x), (moe, "experts_down", down)],
        "MoE sum + add + norm": [(norm, "moe_add_rms_norm", lambda h, *_: (h, h))],
    }
    rows = []
    for name, patches in left_out.items():
        model.graph_decode = None
        torch.cuda.empty_cache()
        dec = graph_decode.GraphDecode(model, "triton")
        ms = []
        with patched(patches):
            model.graph_decode = dec
            for batch in (1, 8):
                tpot(model, batch, 8, prompt)  # captures
                ms.append(replay_ms(dec, batch, len(prompt), 30))
        made.clear()
        rows.append((name, *ms))
    layers = len(model.layers)
    print(f"\n{'left out':>28} {'b1 replay ms':>13} {'us a layer':>11} {'b8 replay ms':>13} {'us a layer':>11}")
    for name, b1, b8 in rows:
        print(f"{name:>28} {b1:13.3f} {(rows[0][1] - b1) * 1e3 / layers:11.2f} {b8:13.3f} "
              f"{(rows[0][2] - b8) * 1e3 / layers:11.2f}")
    print(json.dumps({"layers": layers, "knockout": rows}))


def expert_parallel(a, prompt: list[int]) -> None:
    """Single GPU then EP over the torchrun ranks, both through the graph step; rank 0 prints the table."""
    import faulthandler
    import time

    import torch.distributed as dist

    from evident.engine.parallel import init_from_env

    faulthandler.dump_traceback_later(200, exit=True)  # a hung collective shows where it hangs
    ep = init_from_env("collective", "cuda")
    say = lambda *m: print(f"[rank {ep.rank} {time.strftime('%X')}]", *m, flush=True)  # noqa: E731
    rows, single = [], {}
    if ep.rank == 0:
        model = build(a.layers)
        graph_decode.enable(model)
        single = {b: tpot(model, b, a.tokens, prompt) for b in (1, 8)}
        say("single GPU:", {b: round(t, 3) for b, (t, _) in single.items()})
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    model = build(a.layers, ep)
    graph_decode.enable(model)
    say("EP model built")
    for b in (1, 8):
        t_ep, tok_ep = tpot(model, b, a.tokens, prompt)
        say(f"EP batch {b}: {t_ep:.3f} ms")
        if ep.rank == 0:
            t1, tok1 = single[b]
            same = next((i for i, (x, y) in enumerate(zip(tok1, tok_ep)) if x != y), None)
            rows.append((b, t1, t_ep, t_ep / t1, "all" if same is None else f"first {same}"))
    ep.close()
    if rows:
        print(f"\n{'batch':>5} {'1 GPU TPOT ms':>14} {f'EP{ep.world_size} TPOT ms':>14} {'ratio':>6}  tokens equal")
        for b, t1, t2, r, same in rows:
            print(f"{b:5d} {t1:14.3f} {t2:14.3f} {r:6.2f}  {same}")
        print(json.dumps({"layers": a.layers, "world_size": ep.world_size, "rows": rows}))


@contextlib.contextmanager
def patched(patches):
    """(object, attribute, value) triples in force inside the block; each put back by mock.patch.object, the last set
    first (an attribute set twice gets its value from before the first), on error too."""
    with contextlib.ExitStack() as stack:
        for obj, attr, value in patches:
            stack.enter_context(mock.patch.object(obj, attr, value))
        yield


def cache_at_least(positions: int):
    """``generate``'s caches hold at least ``positions`` a row inside the block (engine.serve's hold 2048 under
    --join step; docs/decode-log.md v29-v30 measured what that cost the attention core); 0: the run's length."""
    make = generate_module._cache

    def at_least(model, rows: int, max_len: int):
        return make(model, rows, max(max_len, positions))
    return patched([(generate_module, "_cache", at_least)] if positions else [])


CARVEOUTS: dict = {}  # Triton kernel (its JITFunction) -> the shared-memory carveout it is launched with, in percent
CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; -1: the driver's choice


@contextlib.contextmanager
def knobs_set(settings: str):
    """``module.CONSTANT=value`` settings of kernels/, ',' between them, in force inside the block (``patched``);
    ``carveout.module.kernel=percent`` launches that Triton kernel (a ``@triton.jit`` function) with that
    shared-memory carveout: the SM's split between L1 and shared memory, in percent of the most shared memory
    (``carveouts``)."""
    from triton.runtime.interpreter import InterpretedFunction  # a @triton.jit kernel under TRITON_INTERPRET=1
    from triton.runtime.jit import JITFunction

    patches, carve = [], {}
    for setting in filter(None, settings.split(",")):
        name, value = setting.split("=", 1)
        mod, const = name.removeprefix("carveout.").rsplit(".", 1)
        mod = importlib.import_module(f"evident.kernels.{mod}")
        if name.startswith("carveout."):
            kernel = getattr(mod, const)
            if not isinstance(kernel, (JITFunction, InterpretedFunction)) or not 0 <= int(value) <= 100:
                raise ValueError(f"{setting}: a carveout is a percent, 0 to 100, of a @triton.jit kernel")
            carve[kernel] = int(value)
        else:  # "False" is not bool("False")
            patches.append((mod, const, type(getattr(mod, const))(ast.literal_eval(value))))
    if carve and torch.cuda.is_available():
        carveouts()
    with patched(patches), mock.patch.dict(CARVEOUTS, carve):
        yield


@functools.cache
def carveouts() -> None:
    """From now on each Triton launch sets its kernel's carveout (CARVEOUTS, else the driver's choice) on the compiled
    function after it, where it differs from the last one set: the next launch runs under it, so a variant's graphs,
    captured after their eager warm-up step, hold its own."""
    from triton.runtime import jit

    cuda, last, run = ctypes.CDLL("libcuda.so.1"), {}, jit.JITFunction.run

    def carved(fn, *args, **kwargs):
        kernel = run(fn, *args, **kwargs)
        value = CARVEOUTS.get(fn, -1)
        if kernel is not None and not kwargs.get("warmup") and last.get(kernel.function, -1) != value:
            rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), CARVEOUT_ATTRIBUTE, ctypes.c_int(value))
            if rc:
                raise RuntimeError(f"cuFuncSetAttribute(carveout {value}) of {fn.fn.__name__}: CUDA error {rc}")
            last[kernel.function] = value
        return kernel

    jit.JITFunction.run = carved


PROBE_ONLY = ("profile", "projections", "pdl", "knobs", "cache_len")  # read by the timed variants alone


def refuse_ignored(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--ep and --knockout run their own step: a setting only the timed variants read is refused before the model is
    built, so no figure is taken for one made with a setting that was never applied."""
    if a.ep and a.knockout:
        ap.error("--ep and --knockout are separate runs: give one of them")
    mode = "--ep" if a.ep else "--knockout" if a.knockout else None
    unread = [f"--{name.replace('_', '-')}" for name in PROBE_ONLY if getattr(a, name) != ap.get_default(name)]
    if mode and unread:
        ap.error(f"{', '.join(unread)} not read with {mode}: run the probe without {mode} for those")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="then the eager step's kernels (the last variant, PDL off)")
    ap.add_argument("--projections", default="torch,triton", help="the dense projections of the graph step (torch first)")
    ap.add_argument("--pdl", default="on", help="programmatic dependent launch of the step's kernels: on, off or both")
    ap.add_argument("--knobs", default="", help="more variants (triton projections, PDL on), ';' between variants: "
                    "module.CONSTANT=value of kernels/, or carveout.module.kernel=percent, ',' between settings")
    ap.add_argument("--ep", action="store_true", help="under torchrun: single GPU against expert parallelism")
    ap.add_argument("--knockout", action="store_true", help="only: each kind of launch's share of the replayed step")
    ap.add_argument("--cache-len", type=int, default=0,
                    help="positions a row's cache holds at least, every path and variant (0: the run's length)")
    a = ap.parse_args(argv)
    refuse_ignored(ap, a)
    prompt = list(range(1000, 1012))
    if a.ep:
        return expert_parallel(a, prompt)
    model = build(a.layers)
    if a.knockout:
        return knockout(model, prompt)
    from evident.kernels import pdl

    rows, dec = [], None
    with cache_at_least(a.cache_len):  # every measured step's cache (the profile below sizes its own)
        torch_path = {batch: tpot(model, batch, a.tokens, prompt) for batch in (1, 8)}  # before any kernel is attached
        variants = [(p, o, "") for p in a.projections.split(",") for o in a.pdl.split(",")]
        variants += [("triton", "on", k) for k in a.knobs.split(";") if k]
        for projections, on, knobs in variants:
            model.graph_decode = dec = None  # frees the last variant's expert stacks and graphs (~30 GB)
            torch.cuda.empty_cache()
            pdl.ENABLED = on == "on"  # read at capture: each variant's graphs keep their own launches
            with knobs_set(knobs):
                dec = graph_decode.GraphDecode(model, projections)
                label = knobs or f"{projections}{'' if on == 'on' else ' no PDL'}"
                for batch in (1, 8):
                    t_torch, tok_torch = torch_path[batch]
                    model.graph_decode = dec
                    t_graph, tok_graph = tpot(model, batch, a.tokens, prompt)
                    t_replay = replay_ms(dec, batch, len(prompt), a.tokens - 2) if dec.graphs else float("nan")
                    same = next((i for i, (x, y) in enumerate(zip(tok_torch, tok_graph)) if x != y), None)
                    rows.append((label, batch, t_torch, t_graph, t_replay,
                                 "all" if same is None else f"first {same}"))

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        pdl.ENABLED = False  # eager launches timed alone: under PDL a kernel's duration includes its wait
        for pb in (1, 8):
            cache = dec.cache(pb, 64)
            with torch.inference_mode():
                model(torch.tensor([prompt] * pb, device="cuda"), cache)
                tok = torch.tensor([5] * pb, device="cuda")
                counts = torch.zeros(dec.pick_counts, dtype=torch.int32, device="cuda")
                dec._step_pick(cache, tok, counts)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    dec._step_pick(cache, tok, counts)
                    torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"eager step, batch {pb}: {len(events)} kernels, {sum(e.device_time for e in events) / 1e3:.3f} ms of kernel time")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(f"\n{'variant':>34} {'batch':>5} {'torch TPOT ms':>14} {'graph TPOT ms':>14} {'replay ms':>10} "
          f"{'tok/s graph':>12}  tokens equal")
    for proj, batch, t0, t1, t_replay, same in rows:
        print(f"{proj:>34} {batch:5d} {t0:14.3f} {t1:14.3f} {t_replay:10.3f} {batch * 1e3 / t1:12.0f}  {same}")
    print(f"cache: at least {a.cache_len} positions a row" if a.cache_len else "cache: the run's length a row")
    print(json.dumps({"layers": a.layers, "cache_len": a.cache_len, "rows": rows}))


if __name__ == "__main__":
    main()
