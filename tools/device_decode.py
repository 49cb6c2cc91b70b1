"""Decode-step probe on a lent GPU (issue 8), without a checkpoint on disk: the DeepSeek-V2-Lite shape with
random bf16 weights built on the GPU, the torch path against the graph path (same weights), then TPOT.

    python3 tools/device_decode.py [--layers 27] [--tokens 32] [--profile] [--projections torch,triton] [--pdl on,off]
        [--knobs "mla.SPLITS=1;moe.DOWN_BLOCK_N=2,moe.BLOCK_N=2"]
    torchrun --nproc-per-node 2 tools/device_decode.py --ep      # expert parallelism, collective combine

Prints: tokens agreement, TPOT p50 per path and batch (a CUDA event at each step's end), the captured step replayed
back to back (the device's time alone: TPOT less that is the host's share), and with --profile
the eager step's top kernels (torch.profiler). With --ep: the graph step on rank 0's GPU alone, then over the
ranks (each holding its shard of the same weights: every parameter is drawn from a generator seeded by its
name), tokens compared. The pipeline's bench stage makes the figures of record.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import statistics
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import graph_decode  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.generate import generate  # noqa: E402
from engine.model import Transformer  # noqa: E402

SHAPE = Path(__file__).resolve().parents[1] / "config/campaigns/dsv2-lite-graph.yaml"


def build(layers: int, ep=None) -> Transformer:
    import yaml

    cfg = dict(yaml.safe_load(SHAPE.read_text())["checkpoint"]["config"], num_hidden_layers=layers)
    args = ModelArgs.from_hf(cfg)
    with torch.device("cuda"):
        model = Transformer(args, ep).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))  # the same on every rank
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
    step's own time on the device, against which TPOT shows the host's share."""
    cache, widths = next(v for v in dec.caches.values() if batch in v[1])
    graph = widths[batch]["graph"]
    with torch.inference_mode():  # the cache was made in it
        cache.lengths.fill_(start)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for e in events[1:]:
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


def expert_parallel(a, prompt: list[int]) -> None:
    """Single GPU then EP over the torchrun ranks, both through the graph step; rank 0 prints the table."""
    import torch.distributed as dist

    from engine.parallel import init_from_env

    import faulthandler
    import time

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="then the eager step's kernels (the last variant, PDL off)")
    ap.add_argument("--projections", default="torch,triton", help="the dense projections of the graph step (torch first)")
    ap.add_argument("--pdl", default="on", help="programmatic dependent launch of the step's kernels: on, off or both")
    ap.add_argument("--knobs", default="", help="more variants (triton projections, PDL on), ';' between variants: "
                    "module.CONSTANT=value of kernels/, ',' between settings")
    ap.add_argument("--ep", action="store_true", help="under torchrun: single GPU against expert parallelism")
    a = ap.parse_args()
    prompt = list(range(1000, 1012))
    if a.ep:
        return expert_parallel(a, prompt)
    model = build(a.layers)
    from kernels import pdl

    rows, dec = [], None
    torch_path = {batch: tpot(model, batch, a.tokens, prompt) for batch in (1, 8)}  # before any kernel is attached
    variants = [(p, o, "") for p in a.projections.split(",") for o in a.pdl.split(",")]
    variants += [("triton", "on", k) for k in a.knobs.split(";") if k]
    for projections, on, knobs in variants:
        model.graph_decode = dec = None  # frees the last variant's expert stacks and graphs (~30 GB)
        torch.cuda.empty_cache()
        pdl.ENABLED = on == "on"  # read at capture: each variant's graphs keep their own launches
        undo = []
        for setting in filter(None, knobs.split(",")):
            name, value = setting.split("=")
            mod, const = name.rsplit(".", 1)
            mod = importlib.import_module(f"kernels.{mod}")
            undo.append((mod, const, getattr(mod, const)))
            setattr(mod, const, type(getattr(mod, const))(ast.literal_eval(value)))  # "False" is not bool("False")
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
        for mod, const, value in undo:
            setattr(mod, const, value)

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        pdl.ENABLED = False  # eager launches timed alone: under PDL a kernel's duration includes its wait
        for pb in (1, 8):
            cache = dec.cache(pb, 64)
            with torch.inference_mode():
                model(torch.tensor([prompt] * pb, device="cuda"), cache)
                tok = torch.tensor([5] * pb, device="cuda")
                dec._step(cache, tok)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    dec._step(cache, tok)
                    torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"eager step, batch {pb}: {len(events)} kernels, {sum(e.device_time for e in events) / 1e3:.3f} ms of kernel time")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(f"\n{'variant':>34} {'batch':>5} {'torch TPOT ms':>14} {'graph TPOT ms':>14} {'replay ms':>10} "
          f"{'tok/s graph':>12}  tokens equal")
    for proj, batch, t0, t1, t_replay, same in rows:
        print(f"{proj:>34} {batch:5d} {t0:14.3f} {t1:14.3f} {t_replay:10.3f} {batch * 1e3 / t1:12.0f}  {same}")
    print(json.dumps({"layers": a.layers, "rows": rows}))


if __name__ == "__main__":
    main()
