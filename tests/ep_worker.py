"""Expert-parallel worker for tests/test_engine_parallel.py (not a test module itself).

Launched as ``torchrun --nproc_per_node N tests/ep_worker.py SPEC.json``. Every rank runs every backend in
lockstep and writes ``<out>/rank<R>.pt`` (torch.save of plain lists/dicts/tensors) for the test to assert on.
Each backend also decodes the prompts as one batch through the graph decode step (half the tokens). SPEC keys: ckpt, packed_ckpt,
odd_ckpt (expert count not divisible by the world size), prompts, n_new, batches, out, optionally device (default
cpu; cuda runs NCCL plus a gloo group for host staging) and group: checkpoints of the group routings (DeepSeek-V2's
group_limited_greedy, DeepSeek-V3's noaux_tc) under "ckpts" with their own prompt, n_new and batch, each generated
on the torch path at B=1 and at that batch, then through the graph step at that batch.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys

import torch

from evident.engine import graph_decode
from evident.engine.checkpoint import load_model
from evident.engine.generate import generate
from evident.engine.generate import main as cli_main
from evident.engine.model import LatentCache, MoE
from evident.engine.parallel import BACKENDS, init_from_env


def sequence_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Prefill logits of the prompt, then one decode step per continuation token through the cache."""
    cache = LatentCache.for_model(model, max_rows=1, max_len=len(prompt) + len(continuation))
    with torch.inference_mode():
        steps = [model(torch.tensor([prompt]), cache)[0]]
        steps += [model(torch.tensor([[t]]), cache)[0] for t in continuation[:-1]]
    return torch.cat(steps).cpu()


def shard_facts(model) -> dict:
    moe = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)}
    return {
        "experts": {i: sorted(int(e) for e in m.experts) for i, m in moe.items()},
        "n_expert_modules": sum(len(m.experts) for m in moe.values()),
        "n_expert_params": sum(p.numel() for m in moe.values() for p in m.experts.parameters()),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_state_tensors": len(model.state_dict()),
    }


def group_routing(path: str, g: dict, ep) -> dict:
    """A group-routing checkpoint under expert parallelism: torch path at B=1 (tokens, sequence logits) and at
    g["batch"], then the graph step at g["batch"]."""
    model = load_model(path, device=ep.device, ep=ep)
    prompt, n_new, b = g["prompt"], g["n_new"], g["batch"]
    one = generate(model, [prompt], n_new)
    out = {"experts": shard_facts(model)["experts"], "tokens": one.tokens[0], "margins": one.margins[0],
           "logits": sequence_logits(model, prompt, one.tokens[0]),
           "batch": generate(model, [prompt] * b, n_new).tokens}
    graph_decode.enable(model)
    graph = generate(model, [prompt] * b, n_new)
    out["graph"], out["graph_margins"] = graph.tokens, graph.margins
    return out


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    prompts, n_new, device = spec["prompts"], spec["n_new"], spec.get("device", "cpu")
    result: dict = {"backends": {}}
    for backend in BACKENDS:
        ep = init_from_env(backend, device)  # a fresh default group per backend: exercises close()
        result.update(rank=ep.rank, world_size=ep.world_size)
        model = load_model(spec["ckpt"], device=ep.device, ep=ep)
        r: dict = {"describe": ep.describe(), **shard_facts(model), "gen": {}, "margins": {}, "logits": {}}
        for pi, prompt in enumerate(prompts):
            single = generate(model, [prompt], n_new)
            r["logits"][pi] = sequence_logits(model, prompt, single.tokens[0])
            r["margins"][pi] = single.margins[0]
            for b in spec["batches"]:
                r["gen"][f"{pi}-b{b}"] = generate(model, [prompt] * b, n_new).tokens
        r["mixed"] = generate(model, prompts, n_new).tokens  # different prompts in one batch
        graph_decode.enable(model)  # the graph step's routing, stacked experts and combine (eager on a CPU)
        r["graph"] = generate(model, prompts, n_new // 2).tokens  # half the tokens: the step runs eagerly on a CPU
        group = spec.get("group", {})
        r["group"] = {name: group_routing(path, group, ep) for name, path in group.get("ckpts", {}).items()}
        if backend == "host-staged":  # packed transformers-5 expert tensors, sliced per rank
            packed = load_model(spec["packed_ckpt"], device=ep.device, ep=ep)
            r["packed_logits"] = sequence_logits(packed, prompts[0], r["gen"]["0-b1"][0])
            r["packed_experts"] = shard_facts(packed)["experts"]
            try:
                load_model(spec["odd_ckpt"], device=ep.device, ep=ep)
                r["odd_error"] = None
            except ValueError as e:
                r["odd_error"] = f"{type(e).__name__}: {e}"
        result["backends"][backend] = r
        ep.close()
        # the CLI, as `torchrun ... -m evident.engine.generate --backend B` runs it (its own init_from_env and close)
        argv = ["--checkpoint", spec["ckpt"], "--max-new-tokens", str(n_new), "--backend", backend, "--device", device]
        for p in prompts:
            argv += ["--prompt-ids", ",".join(map(str, p))]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli_main(argv)
        r["cli_stdout"] = buf.getvalue()
    torch.save(result, f"{spec['out']}/rank{result['rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
