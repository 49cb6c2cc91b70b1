"""Stage `parity`: the engine's own greedy generation, `batch` copies of each case's prompt.

For each batch size B writes parity/<backend>-b<B>.json with every row's ids, text and hashes. Rows of a same-prompt
batch must be identical; the comparison stage checks that before anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.checkpoint import CheckpointError, load_model
from engine.generate import generate
from workflow import checkpoints, environment
from workflow.evidence import Stage, read_config, read_json, text_sha256, token_sha256


def eos_ids(ckpt_dir: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        p = ckpt_dir / name
        if p.is_file() and (eos := json.loads(p.read_text()).get("eos_token_id")) is not None:
            return eos if isinstance(eos, list) else [eos]
    return []


def first_row_mismatch(rows: list[list[int]]) -> dict | None:
    for r, ids in enumerate(rows[1:], 1):
        if ids != rows[0]:
            step = next((i for i, (a, b) in enumerate(zip(rows[0], ids)) if a != b), min(len(ids), len(rows[0])))
            at = lambda seq: seq[step] if step < len(seq) else None  # noqa: E731 - None: the row had ended
            return {"row": r, "step": step, "row0_token": at(rows[0]), "row_token": at(ids)}
    return None


def run_batch(model, tok, cases: list[dict], batch: int, eos: list[int], label: str) -> list[dict]:
    out = []
    for i, case in enumerate(cases, 1):
        prompt_ids = tok.encode(case["prompt"]).ids
        with torch.inference_mode():
            gen = generate(model, [prompt_ids] * batch, case["max_new_tokens"], eos_token_id=eos)
        rows = []
        for ids in gen.tokens:
            text = tok.decode(ids, skip_special_tokens=False)
            rows.append({"generated_ids": ids, "text": text, "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text)})
        mismatch = first_row_mismatch(gen.tokens)
        out.append({"name": case["name"], "prompt_ids": prompt_ids, "rows_identical": mismatch is None,
                    "first_row_mismatch": mismatch, "margins": gen.margins[0], "rows": rows})
        print(f"[parity {label}] case {i}/{len(cases)} {case['name']}: "
              f"{len(gen.tokens[0])} tokens x {batch} rows, rows identical: {mismatch is None}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--backend", required=True, choices=["single"])
    ap.add_argument("--batch-sizes", required=True, type=lambda s: [int(b) for b in s.split(",")])
    args = ap.parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    device = environment.resolve_device(config["device"])
    params = {"backend": args.backend, "batch_sizes": args.batch_sizes, "dtype": config["dtype"], "device": device}
    try:
        # One process per backend: the model is loaded once for every batch size.
        with Stage(args.evidence, f"parity-{args.backend}", params=params) as st:
            checkpoints.verify(args.checkpoint, read_json(args.evidence / "checkpoint.json"))
            # The tokenizer library itself (not transformers): the engine path imports no transformers code.
            tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
            model = load_model(args.checkpoint, device=device, dtype=checkpoints.DTYPES[config["dtype"]])
            eos = eos_ids(args.checkpoint)
            for batch in args.batch_sizes:
                label = f"{args.backend}-b{batch}"
                cases = run_batch(model, tok, config["cases"], batch, eos, label)
                st.write_json(f"parity/{label}.json", {
                    "engine": "evident engine (engine/)", "backend": args.backend, "batch": batch,
                    "dtype": config["dtype"], "device": device, "cases": cases,
                })
                st.metrics[f"b{batch}_rows_identical"] = float(all(c["rows_identical"] for c in cases))
    except (CheckpointError, checkpoints.CheckpointInvalid) as e:
        sys.exit(f"[parity {args.backend}] error: {e}")


if __name__ == "__main__":
    main()
