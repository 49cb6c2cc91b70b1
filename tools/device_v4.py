"""DeepSeek-V4 at V4-Flash width on one GPU, without the pipeline: transformers' model with random bf16 weights, the
engine on the same tensors; correctness first (teacher-forced log-probs of both against each other, the graph path
against the torch path, the C4 route fused against apart, bitwise, in a CUDA graph), then decode timing (CUDA events,
medians over steps after a warm-up) of the engine's graph and torch paths and transformers' eager generate, at
batch 1 and 8. A probe before the campaign (config/campaigns/v4-flash-graph.yaml), whose evidence is the record.

    python3 tools/device_v4.py [--layers 2] [--steps 24]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evident.engine import v4_graph  # noqa: E402
from evident.engine.config import CSA, HCA, args_from_hf  # noqa: E402
from evident.engine.deepseek_v4 import V4Transformer  # noqa: E402
from evident.engine.v4_checkpoint import FP32  # noqa: E402
from evident.engine.generate import forced, generate  # noqa: E402


def build(layers: int):
    import transformers

    types = ([HCA, CSA] * layers)[:layers]
    cfg = transformers.DeepseekV4Config(num_hidden_layers=layers, layer_types=types,
                                        mlp_layer_types=(["hash_moe", "moe"] * layers)[:layers])
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.DeepseekV4ForCausalLM(cfg).to(torch.bfloat16).eval()
    for name, p in hf.named_parameters():  # what transformers keeps in fp32 from a checkpoint, kept so here too
        if FP32.search(name.removeprefix("model.")):
            p.data = p.data.float()
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for key, t in hf.state_dict().items():
            if not t.is_floating_point():
                t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g, device="cuda"))
            elif key.endswith("norm.weight") or key.endswith("scale"):
                t.fill_(1.0)
            else:
                t.copy_(torch.randn(t.shape, generator=g, device="cuda") * 0.02)
    with torch.device("meta"):
        eng = V4Transformer(args_from_hf(cfg.to_dict()))
    eng.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, strict=True, assign=True)
    return cfg, hf, eng.eval()


def tf_logits(model, prompt, cont):
    seen = []
    forced(model, [prompt], [cont], seen.append)
    return torch.cat(seen, 1)[0].float()


def tpot_engine(model, rows: int, steps: int) -> float:
    """Median ms of a decode step (CUDA events around each step of a greedy generate after the prefill)."""
    times = []

    class Timer:
        def __init__(self, step):
            self.step = step

        def __enter__(self):
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()

        def __exit__(self, *exc):
            self.b.record()
            torch.cuda.synchronize()
            if self.step > 3:
                times.append(self.a.elapsed_time(self.b))

    prompts = [[(7 * r + 3 * i) % 1000 + 10 for i in range(32)] for r in range(rows)]
    generate(model, prompts, steps, around=lambda step, total: Timer(step))
    return statistics.median(times)


def tpot_hf(hf, rows: int, steps: int) -> float:
    ids = torch.tensor([[(7 * r + 3 * i) % 1000 + 10 for i in range(32)] for r in range(rows)], device="cuda")
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        out = []
        for n in (4, steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
    return (out[1] - out[0]) / (steps - 4) * 1e3  # the prefill cancels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile", action="store_true", help="also the kernels of one eager decode step, by time")
    ap.add_argument("--no-compile", action="store_true", help="the graph path without torch.compile")
    a = ap.parse_args()
    t0 = time.time()
    cfg, hf, eng = build(a.layers)
    print(f"built {a.layers} layers ({sum(p.numel() for p in hf.parameters()) / 1e9:.2f} B parameters) in "
          f"{time.time() - t0:.0f} s; {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    prompt, cont = list(range(100, 140)), list(range(500, 540))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + cont[:-1]], device="cuda")).logits[0].float(), -1)
    torch_lp = torch.log_softmax(tf_logits(eng, prompt, cont), -1)
    print(f"engine torch vs transformers bf16: mean |d logprob| {(torch_lp - ref).abs().mean():.4f}, "
          f"top1 agree {(torch_lp.argmax(-1) == ref.argmax(-1)).float().mean():.3f}", flush=True)
    tpot_torch = tpot_engine(eng, 1, 12)
    t1 = time.time()
    v4_graph.enable(eng, compiled=not a.no_compile)
    graph_lp = torch.log_softmax(tf_logits(eng, prompt, cont), -1)
    print(f"graph path ready (compiled: {not a.no_compile}) and first pass in {time.time() - t1:.0f} s", flush=True)
    print(f"graph vs torch path: max |d logprob| {(graph_lp - torch_lp).abs().max():.4f}, mean "
          f"{(graph_lp - torch_lp).abs().mean():.5f}", flush=True)
    g = eng.graph_decode
    runs = []
    for on in (True, False, True):
        g.fuse(on)
        runs.append(generate(eng, [prompt], 16).tokens[0])
        seen = []
        forced(eng, [prompt], [cont], seen.append)
        runs.append(torch.cat(seen[1:], 1))  # the decode steps (graph replays)
    print(f"C4 route fused vs apart in the graph: tokens equal {runs[0] == runs[2] == runs[4]}, decode logits bitwise "
          f"{torch.equal(runs[1], runs[3]) and torch.equal(runs[1], runs[5])}", flush=True)
    rows = []
    for b in (1, 8):
        g.fuse(True)
        fused = tpot_engine(eng, b, a.steps)
        g.fuse(False)
        apart = tpot_engine(eng, b, a.steps)
        g.fuse(True)
        rows.append((b, fused, apart, tpot_hf(hf, b, a.steps)))
    print("\n| batch | engine graph, C4 fused (ms) | C4 apart (ms) | transformers eager (ms) | engine x |\n|---|---|---|---|---|")
    for b, f, s, h in rows:
        print(f"| {b} | {f:.3f} | {s:.3f} | {h:.2f} | {h / f:.1f} |")
    print(f"engine torch path b1: {tpot_torch:.2f} ms; total {time.time() - t0:.0f} s")
    if a.profile:
        profile_step(eng)


def profile_step(eng) -> None:
    """The kernels of one eager decode step at batch 1 (torch.profiler), by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    g = eng.graph_decode
    cache = g.cache(1, 128)
    tok = torch.tensor([5], device="cuda")
    with torch.inference_mode():
        eng(torch.tensor([list(range(40))], device="cuda"), cache)
        for _ in range(3):
            g._step(cache, tok)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g._step(cache, tok)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events)
    print(f"\none eager step: {len(events)} kernels, {total / 1e3:.3f} ms of kernel time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
