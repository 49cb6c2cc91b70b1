"""Stage `bench`: batched decode timing of the engine, per backend, for every batch size and prompt contract.

For each B: warm-up runs, then `bench.repeats` measured runs of exactly `bench.new_tokens` new tokens a row (EOS
ignored). Marks after the prefill and after every batched decode step give TTFT, the first decode step and the
steady TPOT samples. On a GPU the marks are CUDA events, recorded behind each step's work (the engine launches a step
before the last one's tokens reach the host: a step's end is its end on the device). Bad samples fail closed. Two
prompt contracts (workflow.runs): same-prompt, one fixed prompt (`bench.prompt`) copied to B rows, whose rows must be
identical before any figure is written; and, where the campaign gives `bench.prompts`, distinct-prompts beside it (cells
`<backend>-distinct-b<B>`), row r the prompt prompts[r] (lengths may differ), each row checked against its prompt
alone (workflow.replay.alone_check: a decisive difference writes no figure).
Backends `hf`, `hf-grouped` and `hf-static` time transformers' own generate on the same checkpoint, prompts and
contract (prompts of different lengths left-padded to the longest, as transformers batches them), each a path of its
(workflow.runs.HF_PATHS: eager; experts as grouped_mm; grouped_mm with a static cache, which transformers compiles on
a GPU): the references the engine's figures stand beside, measured in the same run. Every cell records the wall
time of each warm-up and measured run, so a compile (in the first warm-up) is recorded apart from the steady TPOT:
`first_warmup_over_repeat_s`.
After the timing, untimed, each cell's rows are replayed (workflow/bench/replay.py) for the experts every steady decode
step chose, and the cell records its floor (workflow.floor.bench_floor: the bytes each step must read, the unique
experts a MoE layer, over the read bandwidth measured here once) against its steady TPOT p50, and its prefill's floor
(workflow.floor.prefill_floor: every weight and the experts the prompts' tokens chose read once, or the FLOPs over a
matrix product's rate measured here once, whichever binds) against its TTFT p50 (`prefill_floor`).
Before every measured run a machine probe (workflow/bench/machine.py: a fixed matmul and copy on the same device and threads) is timed
and recorded with it (`probe_ms`), so that a claim between two directories can tell a change of the machine (load,
clocks) from a change of the code (benchstats.directional_claim).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from evident.engine import graph_decode
from evident.engine.checkpoint import CheckpointError
from evident.engine.generate import Generation, generate
from evident.workflow.bench import floor, machine, replay
from evident.workflow.bench.benchstats import BenchError, measured_with, summarize_cell
from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.models.checkpoints import DTYPES, CheckpointInvalid
from evident.workflow.models.session import Session, engine_args, engine_stage
from evident.workflow.parity import logprobs
from evident.workflow.plan.runs import (
    BENCH_BACKENDS,
    DISTINCT,
    HF_PATHS,
    SAME,
    bench_cell,
    bench_contracts,
    prompt_keys,
    prompt_texts,
)


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

    @contextlib.contextmanager
    def around(self, step: int, total: int):
        """generate's hook: each step's work is enqueued inside it, so a mark on exit is the step's end on the device
        (the host hears of its tokens later, while the next step runs)."""
        yield
        self.mark()

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
    """transformers' own greedy generate, exactly new_tokens per row, marked after every token; prompts of different
    lengths left-padded (id 0, masked) to the longest; options go to generate (`cache_implementation`)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, streamer=_TokenMarks(progress), pad_token_id=0, **options)
    return Generation(tokens=out[:, width:].tolist(), margins=[])


def measure(s: Session, rows: list[list[int]], new_tokens: int, same: bool) -> tuple[dict, Generation]:
    """One timed run of `rows` (the prompt ids of each row): its marks, and what every row generated."""
    batch = len(rows)
    marks = Marks(s.device)
    if s.backend in HF_PATHS:
        decode = functools.partial(hf_generate, progress=marks.mark, **HF_PATHS[s.backend][1])
    else:
        decode = functools.partial(generate, around=marks.around)
    gc.disable()  # as timeit does: a collector pause inside a step is not the engine's time
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            marks.mark()
            gen = decode(s.model, rows, new_tokens, eos_token_id=None)
            if marks.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        gc.enable()
    if any(len(row) != new_tokens for row in gen.tokens):
        raise BenchError(f"batch {batch}: a row stopped early; no figure is written")
    if same and any(row != gen.tokens[0] for row in gen.tokens):
        raise BenchError(f"batch {batch}: rows of the same prompt differ; no figure is written")
    iv = marks.intervals_ms()
    if len(iv) != new_tokens:
        raise BenchError(f"batch {batch}: {len(iv)} timed intervals, expected {new_tokens}")
    return {"ttft_ms": iv[0], "first_decode_ms": iv[1], "steady_ms": iv[2:], "wall_s": wall}, gen


def prompt_rows(s: Session, batch: int, prompts: str) -> tuple[list[str], list[list[int]]]:
    """The prompt of each row, as text and as ids: bench.prompt on every row, or bench.prompts[r] on row r."""
    texts = prompt_texts(s.config["bench"], batch, prompts)
    return texts, [s.tokenizer.encode(t).ids for t in texts]


def contract(s: Session, texts: list[str], rows: list[list[int]], prompts: str) -> dict:
    """What a cell measured. The same-prompt contract keeps the keys it always had, so that its cells compare with
    those of earlier evidence; a distinct-prompts cell names its contract, the prompts' hash and each row's length."""
    b = s.config["bench"]
    what = prompt_keys(texts, rows, prompts)
    if prompts != SAME:
        what = {"prompts": DISTINCT, **what}
        if s.backend in HF_PATHS:
            what["padding"] = "left, to the longest prompt"
    return {
        **what,
        "new_tokens": b["new_tokens"], "warmup": b["warmup"], "repeats": b["repeats"],
        "dtype": s.config["dtype"], "timer": "cuda_events" if s.device.startswith("cuda") else "perf_counter",
        # how the engine ran: a claim across ranks, transports or host threads would compare setups
        "ep_size": s.params.get("ep_size", 1), "collective": s.params.get("collective"),
        "device": s.device.split(":")[0], "host_threads": torch.get_num_threads(),
    }


def rows_margin(evidence: Path, config: dict) -> tuple[float, dict | None]:
    """The rows check's near-tie margin: parity's, measured from the oracle's record where there is one (a campaign
    that runs the oracle stage: bench.smk waits for it), else the dtype's floor. On random weights in bf16 the floor
    (0.5) is under the noise: transformers' own batch of 4 distinct prompts, left-padded, parted from a row alone by
    0.875 on the DeepSeek-V2-Lite shape (H200)."""
    oracle = evidence / layout.ORACLE
    transformers = logprobs.transformers_errors(read_json(oracle)) if oracle.is_file() else {}
    return logprobs.near_tie_margin(config["dtype"], transformers, config["parity"].get("near_tie_margin"))


def check_and_floor(s: Session, rows: list[list[int]], gen: Generation, prompts: str, lay: floor.Layout,
                    rates: tuple[float, float], stats: dict, near_tie: tuple[float, dict | None]
                    ) -> tuple[dict, dict, dict]:
    """Untimed, after the cell's timing: its rows check, its decode floor and its prefill floor, from a replay of each
    row (only the first of a same-prompt batch, whose rows were identical on every run) along what the last measured
    run generated; `rates`: the read bandwidth (bytes/s) and the matrix product's rate (FLOP/s)."""
    bandwidth, flop_rate = rates
    same, tokens = prompts == SAME, gen.tokens
    replayed = replay.replay(s.model, rows[:1] if same else rows, tokens[:1] if same else tokens,
                             hf=s.backend in HF_PATHS)
    if same:
        check = {"rule": "every row of the one prompt identical, on every run", "verdict": "rows_identical"}
    else:
        check = replay.alone_check(replayed, tokens, s.config["dtype"], gen.margins or None, near_tie)
        if check["verdict"] == replay.MISMATCH:
            d = check["largest"]
            raise BenchError(f"batch {len(rows)}, distinct prompts: row {d['row']} picked token {d['token']} at step "
                             f"{d['step']} where its prompt alone picks {d['alone_token']}, preferred by {d['gap']:.3g}"
                             + ("" if d["batch_margin"] is None else f" (the batch's margin {d['batch_margin']:.3g})")
                             + f", beyond the near-tie margin {check['near_tie_margin']:g}; no figure is written")
    # steady step s = 3..N (steady_ms) reads each row's prompt and s - 1 tokens; replay's experts start at step 2
    steps = [([len(p) + step - 1 for p in rows],
              [set().union(*(r.experts[step - 2][layer] for r in replayed)) for layer in range(len(lay.expert))])
             for step in range(3, len(tokens[0]) + 1)]
    ranks = s.params.get("ep_size", 1)
    prefill = [set().union(*(r.prefill[layer] for r in replayed)) for layer in range(len(lay.expert))]
    return (check, floor.bench_floor(lay, steps, bandwidth, stats["tpot"]["p50"], ranks,
                                     screened=graph_decode.screened(s.model, len(rows))),
            floor.prefill_floor(lay, rows, prefill, bandwidth, flop_rate, stats["ttft"]["p50"], ranks))


def bench_batch(s: Session, batch: int, prompts: str, lay: floor.Layout, rates: tuple[float, float],
                near_tie: tuple[float, dict | None]) -> dict:
    b = s.config["bench"]
    texts, rows = prompt_rows(s, batch, prompts)
    same = prompts == SAME
    machine.probe_ms(s.device)  # its first run pays for the allocations
    warmups = [measure(s, rows, b["new_tokens"], same)[0]["wall_s"] for _ in range(b["warmup"])]
    repeats = []
    for r in range(b["repeats"]):
        probe = machine.probe_ms(s.device)  # right before the repeat: the load it ran under
        timing, gen = measure(s, rows, b["new_tokens"], same)
        repeats.append({**timing, "probe_ms": probe})
        if s.primary:
            steady = sorted(timing["steady_ms"])
            print(f"[bench {s.backend}-b{batch} {prompts}] repeat {r + 1}/{b['repeats']}: "
                  f"TPOT p50 {steady[len(steady) // 2]:.3f} ms, probe {probe:.3f} ms", flush=True)
    stats = summarize_cell(repeats, batch, b["new_tokens"])
    check, fl, pf = check_and_floor(s, rows, gen, prompts, lay, rates, stats, near_tie)
    return {
        "contract": contract(s, texts, rows, prompts),
        "probe": machine.WORKLOAD,  # outside the contract: cells recorded before the probe still compare
        "repeats": repeats,
        "stats": stats,
        "rows_check": check,
        "floor": fl,
        "prefill_floor": pf,
        # a compile (transformers' static cache on a GPU, the engine's graph capture) lands in the first warm-up
        "warmup_wall_s": warmups,
        "first_warmup_over_repeat_s": (warmups[0] - statistics.median(r["wall_s"] for r in repeats)
                                       if warmups else None),
    }


def main(argv: list[str] | None = None) -> None:
    args = engine_args(__doc__, BENCH_BACKENDS).parse_args(argv)
    try:
        with engine_stage("bench", args) as (st, s):
            versions, model = measured_with(args.evidence)
            dtype = DTYPES[s.config["dtype"]]
            lay = floor.layout(args.checkpoint, dtype)
            rates = floor.bandwidth(s.device), floor.matmul_rate(s.device, dtype)
            near_tie = rows_margin(args.evidence, s.config)
            for prompts in bench_contracts(s.config["bench"]):
                for batch in args.batch_sizes:
                    cell = bench_batch(s, batch, prompts, lay, rates, near_tie)
                    st.write_json(layout.bench_cell(bench_cell(args.backend, batch, prompts)), {
                        "backend": args.backend, "batch": batch, **s.params, **cell, "versions": versions,
                        "model": model})
                    key = f"b{batch}" if prompts == SAME else f"distinct_b{batch}"
                    st.metrics[f"{key}_tpot_p50_ms"] = cell["stats"]["tpot"]["p50"]
                    st.metrics[f"{key}_decode_tok_s"] = cell["stats"]["decode_tok_s"]
                    st.metrics[f"{key}_floor_fraction"] = cell["floor"]["floor_fraction"]
                    st.metrics[f"{key}_ttft_over_floor"] = cell["prefill_floor"]["ttft_over_floor"]
                    if s.primary:
                        fl = cell["floor"]
                        print(f"[bench {args.backend}-b{batch} {prompts}] floor {fl['floor_ms']:.3f} ms a steady step "
                              f"({fl['bytes']['total'] / 1e6:.1f} MB at {fl[floor.BANDWIDTH_KEY]:.0f} GB/s), "
                              f"{100 * fl['floor_fraction']:.0f}% of TPOT p50; rows: {cell['rows_check']['verdict']}",
                              flush=True)
                        pf = cell["prefill_floor"]
                        print(f"[bench {args.backend}-b{batch} {prompts}] prefill floor {pf['floor_ms']:.3f} ms "
                              f"({pf['bound']}: {pf['bytes']['total'] / 1e6:.1f} MB, {pf['flops'] / 1e9:.3g} GFLOP at "
                              f"{pf[floor.FLOP_RATE_KEY]:.3g} TFLOP/s); TTFT p50 {pf['ttft_p50_ms']:.3f} ms, "
                              f"{pf['ttft_over_floor']:.1f}x the floor", flush=True)
    except (CheckpointError, CheckpointInvalid, BenchError, replay.ReplayError) as e:
        sys.exit(f"[bench {args.backend}] error: {e}")


if __name__ == "__main__":
    main()
