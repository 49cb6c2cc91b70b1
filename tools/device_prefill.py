"""Prefill probe on a lent GPU (issue 66): the DeepSeek-V2-Lite shape (config/models/deepseek-v2-lite.yaml) with random
bf16 weights built on the GPU, the torch path against the kernel paths on the same weights (triton; graph, its prefill
captured in a CUDA graph, and graph-eager, its prefill the eager forward): correctness first, then TTFT against the
prefill's floor.

    python3 tools/device_prefill.py [--layers 27] [--prompt-len 24] [--batches 1,8]
        [--paths torch,triton,graph-eager,graph] [--check-layers 4] [--repeats 5] [--profile]
    python3 tools/device_prefill.py --tiny --batches 1 --repeats 1   # a dry run on the CPU (~1 min): config/models/
        tiny.yaml, float32, the kernels through Triton's interpreter

1. Correctness, float32 at --check-layers layers (cuBLAS's float32 is not TF32 by default; the experts kernel's float32
   dot neither): each kernel path's logits of one ragged batch's prefill (rows of prompt-len tokens and shorter, padded
   on the right as generate pads them) against the torch path's, ||d|| / ||ref|| at every real position, which must
   be under 1e-4; then the same in bf16 at --layers (reported: the kernels sum the experts in fp32, the torch loop
   rounds each expert's output to bf16), top-1 agreement beside it. A path that fails is not timed.
2. TTFT: generate(model, prompts, 1), the bench's TTFT (the prefill of every row, the pick of its first token and
   its copy to the host), batch B of distinct random prompts of --prompt-len tokens; the median of --repeats after
   two warm-ups, CUDA events (kernels/hbm.py median_seconds).
3. The floor (workflow/bench/floor.py prefill_floor): every weight and the experts those prompts chose (a hook on
   each MoE layer's router, each prompt alone) read once at the measured read bandwidth, or the FLOPs at a
   measured bf16 matrix product's rate, whichever binds. Then a table, and a JSON line (also $OUT/prefill.json).

Each path gets a fresh model (weights from a generator seeded by each parameter's name: the same weights), since the
kernel paths re-seat the weights they take. --profile: the top kernels of one graph-path prefill at the first batch
(each graph path's).
The pipeline's bench stage makes the figures of record (its cells' `prefill_floor`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # read when Triton compiles the kernels' decorators: before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evident.engine import decode_kernels, graph_decode  # noqa: E402
from evident.engine.config import ModelArgs  # noqa: E402
from evident.engine.generate import _prefill, generate  # noqa: E402
from evident.engine.model import MoE, Transformer  # noqa: E402
from evident.kernels.hbm import median_seconds  # noqa: E402
from evident.workflow.bench import floor  # noqa: E402
from evident.workflow.models.families import deepseek  # noqa: E402
from device_decode import randomize  # noqa: E402 - tools/, the script's own folder

MODELS = REPO / "config/models"
CHECK_TOL = 1e-4  # float32: the kernels' sums in another order
BF16_TOL = 5e-2  # bf16: reported, and a path above it is not timed (a wrong expert gives ~1: tests/test_engine_kernels)


def model_args(name: str, layers: int | None) -> ModelArgs:
    cfg = yaml.safe_load((MODELS / f"{name}.yaml").read_text())
    return ModelArgs.from_hf({**cfg, **({"num_hidden_layers": layers} if layers else {})})


def build(args: ModelArgs, device: str, dtype: torch.dtype, path: str) -> Transformer:
    """A model of device_decode's random weights (every build the same model), on `path`."""
    with torch.device(device):
        model = randomize(Transformer(args).to(dtype), device)
    if path == "triton":
        decode_kernels.enable(model)
    elif path in GRAPH:
        graph_decode.enable(model)
    return model


GRAPH = {"graph": True, "graph-eager": False}  # the graph path, its prefill captured or the eager forward


def on(path: str) -> None:
    """The prefill `path` runs (graph_decode.PREFILL_GRAPHS, read at each prefill)."""
    graph_decode.PREFILL_GRAPHS = GRAPH.get(path, True)


def prompts_of(args: ModelArgs, batch: int, length: int, ragged: bool = False) -> list[list[int]]:
    """`batch` distinct random prompts of `length` tokens (ragged: row r of length - 3r, at least 1)."""
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return [torch.randint(2, args.vocab_size, (max(1, length - 3 * r) if ragged else length,), generator=g).tolist()
            for r in range(batch)]


def prefill_logits(model: Transformer, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each row's logits [len, vocab] (fp64, host) of generate's batched prefill."""
    with torch.inference_mode():
        cache = generate_cache(model, len(prompts), max(map(len, prompts)))
        return [t.double().cpu() for t in _prefill(model, cache, prompts, list(range(len(prompts))))]


def generate_cache(model: Transformer, rows: int, max_len: int):
    graph = model.graph_decode
    return graph.cache(rows, max_len) if graph is not None else model.new_cache(rows, max_len)


def agreement(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(||got - ref|| / ||ref|| over every real position, the share of positions whose top-1 agrees)."""
    d, r = torch.cat(got), torch.cat(ref)
    return ((d - r).norm() / r.norm()).item(), (d.argmax(-1) == r.argmax(-1)).double().mean().item()


def check(args: ModelArgs, device: str, dtype: torch.dtype, paths: list[str], prompts) -> dict:
    """Each kernel path's prefill logits against the torch path's: {path: (relative error, top-1 agreement)}, a line
    printed as each is known (a first build at full width compiles kernels: minutes)."""
    t0 = time.perf_counter()
    ref = prefill_logits(build(args, device, dtype, "torch"), prompts)
    release(device)
    out = {}
    for path in paths:
        if path != "torch":
            on(path)
            out[path] = agreement(prefill_logits(build(args, device, dtype, path), prompts), ref)
            release(device)
            print(f"check {str(dtype).removeprefix('torch.')}, {args.num_hidden_layers} layers, {path} against torch: "
                  f"relative error {out[path][0]:.3g}, top-1 {out[path][1]:.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return out


def release(device: str) -> None:
    """Let a model go (its graphs and stacks with it) before the next is built: one at a time fits the card."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prefill_experts(model: Transformer, prompts: list[list[int]]) -> list[set[int]]:
    """Per MoE layer, the experts the prompts' tokens chose: each prompt alone (no padding), its router on the layer's
    input (workflow/bench/replay.py's way)."""
    layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    chosen = [set() for _ in layers]
    hooks = [m.register_forward_hook(lambda m, a, o, ids=ids: ids.update(
        m.route(a[0].reshape(-1, a[0].shape[-1]))[1].flatten().tolist())) for m, ids in zip(layers, chosen)]
    try:
        with torch.inference_mode():
            for p in prompts:
                model(torch.tensor([p], device=model.embed_tokens.weight.device), model.new_cache(1, len(p)))
    finally:
        for h in hooks:
            h.remove()
    return chosen


def ttft_ms(model: Transformer, prompts: list[list[int]], device: str, repeats: int) -> float:
    def run():
        with torch.inference_mode():
            generate(model, prompts, 1)
    return median_seconds(run, device, repeats) * 1e3


def profile(model: Transformer, prompts: list[list[int]]) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    generate(model, prompts, 1)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            generate(model, prompts, 1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--paths", default="torch,triton,graph-eager,graph",
                    help="graph: its prefill captured in a CUDA graph; graph-eager: the forward itself")
    ap.add_argument("--check-layers", type=int, default=4, help="layers of the float32 correctness check")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: config/models/tiny.yaml, float32")
    a = ap.parse_args(argv)
    paths, batches = a.paths.split(","), [int(b) for b in a.batches.split(",")]
    if a.tiny:
        name, device, dtype, layers, check_layers = "tiny", "cpu", torch.float32, None, None
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU here: --tiny for a dry run on the CPU")
        name, device, dtype, layers, check_layers = "deepseek-v2-lite", "cuda", torch.bfloat16, a.layers, a.check_layers
    args = model_args(name, layers)
    ragged = prompts_of(args, 4, a.prompt_len, ragged=True)

    # 1. correctness, float32 first
    fp32 = check(model_args(name, check_layers), device, torch.float32, paths, ragged)
    low = check(args, device, dtype, paths, ragged) if dtype != torch.float32 else fp32
    wrong = [p for p in paths if p in fp32 and not (fp32[p][0] < CHECK_TOL and low[p][0] < BF16_TOL)]
    if wrong:
        print(f"not timed, their prefill is not the torch path's: {', '.join(wrong)}", flush=True)

    # 2. the floor's rates and chosen experts, 3. TTFT
    lay = floor.layout_of(deepseek.FAMILY, args, dtype)
    rates = floor.bandwidth(device), floor.matmul_rate(device, dtype)
    print(f"read {rates[0] / 1e9:,.0f} GB/s, matmul {rates[1] / 1e12:,.1f} TFLOP/s", flush=True)
    rows, floors = [], {}
    for path in [p for p in paths if p not in wrong]:
        model = build(args, device, dtype, path)
        on(path)
        for b in batches:
            prompts = prompts_of(args, b, a.prompt_len)
            if b not in floors:  # the torch path's router, before any kernel: every path routes alike
                experts = prefill_experts(build(args, device, dtype, "torch"), prompts) if path != "torch" else \
                    prefill_experts(model, prompts)
                floors[b] = (prompts, experts)
                release(device)
            ms = ttft_ms(model, prompts, device, a.repeats)
            fl = floor.prefill_floor(lay, prompts, floors[b][1], *rates, ms)
            rows.append({"path": path, "batch": b, "ttft_ms": ms, "floor": fl})
            print(f"{path} b{b}: TTFT {ms:.3f} ms, floor {fl['floor_ms']:.3f} ms ({fl['bound']}), "
                  f"{fl['ttft_over_floor']:.2f}x", flush=True)
        if a.profile and path in GRAPH and device == "cuda":
            profile(model, prompts_of(args, batches[0], a.prompt_len))
        del model
        release(device)

    print(f"\n{'path':>7} {'batch':>5} {'TTFT ms':>9} {'floor ms':>9} {'bound':>6} {'x floor':>8} {'MB':>9} "
          f"{'GFLOP':>8} {'experts/layer':>13}")
    for r in rows:
        fl = r["floor"]
        print(f"{r['path']:>7} {r['batch']:5d} {r['ttft_ms']:9.3f} {fl['floor_ms']:9.3f} {fl['bound']:>6} "
              f"{fl['ttft_over_floor']:8.2f} {fl['bytes']['total'] / 1e6:9.1f} {fl['flops'] / 1e9:8.1f} "
              f"{fl['unique_experts']['mean']:13.1f}")
    basis = rows[0]["floor"]["basis"] if rows else None
    for r in rows:  # the floor's basis once
        del r["floor"]["basis"]
    summary = {"model": name, "layers": args.num_hidden_layers, "dtype": str(dtype), "prompt_len": a.prompt_len,
               "check_float32": fp32, "check": low, "not_timed": wrong, "floor_basis": basis, "rows": rows}
    print(json.dumps(summary))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "prefill.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
