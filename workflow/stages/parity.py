"""Stage `parity`: the engine's own greedy generation, `batch` copies of each case's prompt.

For each batch size B writes parity/<run>-b<B>.json (run: the backend, `-triton` added for the engine's
Triton decode path) with every row's ids, text and hashes.
Rows of a same-prompt batch must be identical; the comparison stage checks that first. EP
backends run under torchrun; rank 0 writes.
"""

from __future__ import annotations

import sys

import torch

from engine.checkpoint import CheckpointError
from engine.generate import generate
from workflow.checkpoints import CheckpointInvalid
from workflow.evidence import text_sha256, token_sha256
from workflow.traces import first_difference, token_at
from workflow.session import Session, engine_args, engine_stage, run_name


def first_row_mismatch(rows: list[list[int]]) -> dict | None:
    for r, ids in enumerate(rows[1:], 1):
        step = first_difference(rows[0], ids)
        if step is not None:
            return {"row": r, "step": step, "row0_token": token_at(rows[0], step), "row_token": token_at(ids, step)}
    return None


def run_batch(s: Session, batch: int, label: str) -> list[dict]:
    out, cases = [], s.config["cases"]
    for i, case in enumerate(cases, 1):
        prompt_ids = s.tokenizer.encode(case["prompt"]).ids
        with torch.inference_mode():
            gen = generate(s.model, [prompt_ids] * batch, case["max_new_tokens"], eos_token_id=s.eos)
        rows = []
        for ids in gen.tokens:
            text = s.tokenizer.decode(ids, skip_special_tokens=False)
            rows.append({"generated_ids": ids, "text": text, "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text)})
        mismatch = first_row_mismatch(gen.tokens)
        out.append({"name": case["name"], "prompt_ids": prompt_ids, "rows_identical": mismatch is None,
                    "first_row_mismatch": mismatch, "margins": gen.margins[0], "rows": rows})
        if s.primary:
            print(f"[parity {label}] case {i}/{len(cases)} {case['name']}: "
                  f"{len(gen.tokens[0])} tokens x {batch} rows, rows identical: {mismatch is None}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = engine_args(__doc__).parse_args(argv)
    try:
        with engine_stage("parity", args) as (st, s):
            for batch in args.batch_sizes:
                label = f"{run_name(args.backend, args.kernels)}-b{batch}"
                cases = run_batch(s, batch, label)
                st.write_json(f"parity/{label}.json", {"engine": "evident engine (engine/)", **s.params,
                                                        "batch": batch, "cases": cases})
                st.metrics[f"b{batch}_rows_identical"] = float(all(c["rows_identical"] for c in cases))
    except (CheckpointError, CheckpointInvalid) as e:
        sys.exit(f"[parity {run_name(args.backend, args.kernels)}] error: {e}")


if __name__ == "__main__":
    main()
