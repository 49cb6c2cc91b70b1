"""Stage `bench`: batched decode timing of the engine, per backend, for every batch size.

For each B: warm-up runs, then `bench.repeats` measured runs of one fixed prompt copied to B rows
and exactly `bench.new_tokens` new tokens (EOS ignored). Marks after the prefill and after every
batched decode step give TTFT, the first decode step and the steady TPOT samples. On a GPU the
marks are CUDA events. Rows must agree before any figure is written; bad samples fail closed.
Backends `hf`, `hf-grouped` and `hf-static` time transformers' own generate on the same checkpoint, prompt and
contract, each a path of its (workflow.runs.HF_PATHS: eager; experts as grouped_mm; grouped_mm with a static
cache, which transformers compiles on a GPU): the references the engine's figures stand beside, measured in the
same run. Every cell records the wall time of each warm-up and measured run, so a compile (in the first
warm-up) is recorded apart from the steady TPOT: `first_warmup_over_repeat_s`.
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import time

import torch

from engine.checkpoint import CheckpointError
from engine.generate import Generation, generate
from workflow.benchstats import BenchError, summarize_cell
from workflow.checkpoints import CheckpointInvalid
from workflow.evidence import read_json, sha256_bytes
from workflow.runs import BENCH_BACKENDS, HF_PATHS
from workflow.session import Session, engine_args, engine_stage


class Marks:
    """Timestamps on the device timeline (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.marks: list = []

    def mark(self, *_):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


class _TokenMarks:
    """transformers' streamer hook: generate() hands it the prompt once, then each step's new tokens."""

    def __init__(self, mark):
        self.mark, self.prompt_seen = mark, False

    def put(self, _):
        if self.prompt_seen:
            self.mark()
        self.prompt_seen = True

    def end(self):
        pass


def hf_generate(model, prompts: list[list[int]], new_tokens: int, eos_token_id=None, progress=None,
                **options) -> Generation:
    """transformers' own greedy generate, exactly new_tokens per row, marked after every token; options go to
    generate (`cache_implementation`)."""
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, streamer=_TokenMarks(progress), pad_token_id=0, **options)
    return Generation(tokens=out[:, ids.shape[1]:].tolist(), margins=[])


def measure(s: Session, prompt_ids: list[int], batch: int, new_tokens: int) -> dict:
    marks = Marks(s.device)
    decode = functools.partial(hf_generate, **HF_PATHS[s.backend][1]) if s.backend in HF_PATHS else generate
    gc.disable()  # as timeit does: a collector pause inside a step is not the engine's time
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            marks.mark()
            gen = decode(s.model, [prompt_ids] * batch, new_tokens, eos_token_id=None, progress=marks.mark)
            if marks.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        gc.enable()
    if any(row != gen.tokens[0] for row in gen.tokens) or any(len(row) != new_tokens for row in gen.tokens):
        raise BenchError(f"batch {batch}: rows of the same prompt differ or stopped early; no figure is written")
    iv = marks.intervals_ms()
    if len(iv) != new_tokens:
        raise BenchError(f"batch {batch}: {len(iv)} timed intervals, expected {new_tokens}")
    return {"ttft_ms": iv[0], "first_decode_ms": iv[1], "steady_ms": iv[2:], "wall_s": wall}


def bench_batch(s: Session, batch: int) -> dict:
    b = s.config["bench"]
    prompt_ids = s.tokenizer.encode(b["prompt"]).ids
    warmups = [measure(s, prompt_ids, batch, b["new_tokens"])["wall_s"] for _ in range(b["warmup"])]
    repeats = []
    for r in range(b["repeats"]):
        repeats.append(measure(s, prompt_ids, batch, b["new_tokens"]))
        if s.primary:
            steady = sorted(repeats[-1]["steady_ms"])
            print(f"[bench {s.backend}-b{batch}] repeat {r + 1}/{b['repeats']}: "
                  f"TPOT p50 {steady[len(steady) // 2]:.3f} ms", flush=True)
    return {
        "contract": {
            "prompt_sha256": sha256_bytes(b["prompt"].encode()), "prompt_tokens": len(prompt_ids),
            "new_tokens": b["new_tokens"], "warmup": b["warmup"], "repeats": b["repeats"],
            "dtype": s.config["dtype"], "timer": "cuda_events" if s.device.startswith("cuda") else "perf_counter",
            # how the engine ran: a claim across ranks, transports or host threads would compare setups
            "ep_size": s.params.get("ep_size", 1), "collective": s.params.get("collective"),
            "device": s.device.split(":")[0], "host_threads": torch.get_num_threads(),
        },
        "repeats": repeats,
        "stats": summarize_cell(repeats, batch, b["new_tokens"]),
        # a compile (transformers' static cache on a GPU, the engine's graph capture) lands in the first warm-up
        "warmup_wall_s": warmups,
        "first_warmup_over_repeat_s": (warmups[0] - statistics.median(r["wall_s"] for r in repeats)
                                       if warmups else None),
    }


def main(argv: list[str] | None = None) -> None:
    args = engine_args(__doc__, BENCH_BACKENDS).parse_args(argv)
    try:
        with engine_stage("bench", args) as (st, s):
            env = read_json(args.evidence / "env.json")
            versions = {**env["packages"], "cuda": env.get("cuda"), "gpus": env.get("gpus"), "driver": env.get("driver")}
            model = {n: f["sha256"] for n, f in read_json(args.evidence / "checkpoint.json")["files"].items()}
            for batch in args.batch_sizes:
                cell = bench_batch(s, batch)
                st.write_json(f"bench/{args.backend}-b{batch}.json", {
                    "backend": args.backend, "batch": batch, **s.params, **cell, "versions": versions, "model": model})
                st.metrics[f"b{batch}_tpot_p50_ms"] = cell["stats"]["tpot"]["p50"]
                st.metrics[f"b{batch}_decode_tok_s"] = cell["stats"]["decode_tok_s"]
    except (CheckpointError, CheckpointInvalid, BenchError) as e:
        sys.exit(f"[bench {args.backend}] error: {e}")


if __name__ == "__main__":
    main()
