"""Stage `parity`: the engine's own greedy generation, `batch` copies of each case's prompt.

For each batch size B writes parity/<run>-b<B>.json (run: the backend, `-triton` or `-graph` added for the
engine's Triton or CUDA-graph decode path) with every row's ids, text and hashes.
Rows of a same-prompt batch must be identical; the comparison stage checks that first. EP
backends run under torchrun; rank 0 writes.

Each batch also runs teacher-forced along the oracle's trace (oracle/hf.json: its prompt and generated ids)
through the same prefill, batched decode step and kernels, every row: per row and position the engine's
log-probs of the oracle reference's top-k ids and its own top-k. That runs in the campaign's dtype and, for a
bf16 or fp16 campaign, again in float32 (the model loaded a second time), the logic check's run.

A batch of B >= 2 also runs ragged, in float32 (`ragged`): row r the prompt of case r mod n, the prompts of different
lengths prefilled together, greedy; each row must decode as its prompt alone does through the same path, within the
logic tolerance (two float32 computations of a row cannot both prefer different tokens by more than it). A
same-prompt batch has no padding to get wrong; in bf16 on random weights rounding hides what float32 shows
(docs/decode-log.md, "Batched prefill").
"""

from __future__ import annotations

import sys

import torch

from evident.engine.checkpoint import CheckpointError
from evident.engine.generate import Generation, forced, generate
from evident.workflow.bench import replay
from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.models.checkpoints import CheckpointInvalid
from evident.workflow.models.session import Session, engine_args, engine_stage
from evident.workflow.parity import logprobs
from evident.workflow.parity.traces import first_difference, first_row_mismatch, token_row
from evident.workflow.plan.runs import label, run_name


def run_batch(s: Session, batch: int, name: str) -> list[dict]:
    out, cases = [], s.config["cases"]
    for i, case in enumerate(cases, 1):
        prompt_ids = s.tokenizer.encode(case["prompt"]).ids
        with torch.inference_mode():
            gen = generate(s.model, [prompt_ids] * batch, case["max_new_tokens"], eos_token_id=s.eos)
        rows = [token_row(s.tokenizer, ids) for ids in gen.tokens]
        mismatch = first_row_mismatch(gen.tokens)
        out.append({"name": case["name"], "prompt_ids": prompt_ids, "rows_identical": mismatch is None,
                    "first_row_mismatch": mismatch, "margins": gen.margins[0], "rows": rows})
        if s.primary:
            print(f"[parity {name}] case {i}/{len(cases)} {case['name']}: "
                  f"{len(gen.tokens[0])} tokens x {batch} rows, rows identical: {mismatch is None}", flush=True)
    return out


def run_forced(s: Session, oracle: dict, batch: int) -> dict[str, dict]:
    """Per case: every row's log-probs along the oracle's trace, teacher-forced, in the model's dtype now."""
    out = {}
    for case in oracle["cases"]:
        rows = logprobs.Positions(oracle["reference"]["top_k"], case["reference"]["top_ids"])
        forced(s.model, [case["prompt_ids"]] * batch, [case["generated_ids"]] * batch, rows)
        out[case["name"]] = {"rows": rows.rows}
    return out


def run_ragged(s: Session, batch: int, alone: dict[int, Generation]) -> dict | None:
    """The ragged batch in the model's dtype now (float32: parity's last load) against each of its prompts
    generated alone through the same path (so that only what batching changes can differ): where a row parts from
    its prompt alone, both runs' top-1/top-2 margins there decide, at the logic tolerance. Its cases, their prompt
    lengths and the check; None where the rows' prompts share one length (batch 1, or one case). `alone` keeps each
    case's run alone (by case index) for the next batch size."""
    cases = s.config["cases"]
    prompts = [s.tokenizer.encode(c["prompt"]).ids for c in cases]
    which = [r % len(cases) for r in range(batch)]
    if len({len(prompts[i]) for i in which}) < 2:
        return None
    n, tol = max(c["max_new_tokens"] for c in cases), s.config["parity"]["logic_tolerance"]
    with torch.inference_mode():
        gen = generate(s.model, [prompts[i] for i in which], n)
        for i in sorted(set(which) - alone.keys()):
            alone[i] = generate(s.model, [prompts[i]], n)
    diffs = []
    for r, i in enumerate(which):
        own, ref = gen.tokens[r], alone[i].tokens[0]
        if (at := first_difference(ref, own)) is not None:
            diffs.append({"row": r, "case": cases[i]["name"], "step": at, "token": own[at], "alone_token": ref[at],
                          "batch_margin": gen.margins[r][at], "alone_margin": alone[i].margins[0][at]})
    worst, verdict = replay.decide(diffs, lambda d: min(d["batch_margin"], d["alone_margin"]), tol)
    return {"cases": [cases[i]["name"] for i in which], "prompt_tokens": [len(prompts[i]) for i in which],
            "rule": "each row against its prompt alone, greedy through the same path: a first difference where both "
                    "runs prefer their own pick by more than the logic tolerance fails",
            "tolerance": tol, "verdict": verdict, "differences": diffs, "largest": worst}


def run_record(s: Session, batch: int, cases: list[dict], forced_runs: dict[str, dict], ragged: dict | None) -> dict:
    """parity/<run>-b<B>.json: the free-running cases, each with its forced runs per dtype, and the ragged batch."""
    for case in cases:
        case["forced"] = {dtype: runs[case["name"]] for dtype, runs in forced_runs.items()}
    return {"engine": "evident engine (engine/)", **s.params, "batch": batch, "cases": cases, "ragged": ragged}


def main(argv: list[str] | None = None) -> None:
    args = engine_args(__doc__).parse_args(argv)
    try:
        with engine_stage("parity", args) as (st, s):
            oracle = read_json(args.evidence / layout.ORACLE)  # the forced runs follow its traces
            dtypes, runs = logprobs.dtypes(s.config["dtype"]), {}
            for batch in args.batch_sizes:
                name = label(args.backend, args.kernels, batch)
                runs[batch] = (name, run_batch(s, batch, name), {dtypes[0]: run_forced(s, oracle, batch)})
            for dtype in dtypes[1:]:  # the logic check's run, after the campaign dtype's model is freed
                s.reload(dtype)
                for batch in args.batch_sizes:
                    runs[batch][2][dtype] = run_forced(s, oracle, batch)
            alone = {}  # the ragged batches' prompts alone, once for every batch size
            for batch, (name, cases, forced_runs) in runs.items():
                record = run_record(s, batch, cases, forced_runs, run_ragged(s, batch, alone))
                if s.primary and record["ragged"]:
                    print(f"[parity {name}] ragged batch in float32, each row against its prompt alone: "
                          f"{record['ragged']['verdict']}", flush=True)
                st.write_json(layout.parity_run(name), record)
                st.metrics[f"b{batch}_rows_identical"] = float(all(c["rows_identical"] for c in cases))
                if s.primary:
                    print(f"[parity {name}] teacher-forced along the oracle's traces in {', '.join(dtypes)}", flush=True)
    except (CheckpointError, CheckpointInvalid) as e:
        sys.exit(f"[parity {run_name(args.backend, args.kernels)}] error: {e}")


if __name__ == "__main__":
    main()
