"""A `command` engine target for the tests (docs/engine-targets.md): the engine of the `engine` package on the path
(a scratch copy with a mutant, tests/mutants.py, where PYTHONPATH puts one first) reads a request and writes a trace.

    python tests/command_engine.py --checkpoint DIR --dtype float32 REQUEST OUT [--malformed]

Free rows: `batch` copies of each case's prompt through engine.generate. Forced rows: the same copies along the
request's forced_ids (engine.generate.forced), the log-probs of each position's score_ids and the top_k. With
--malformed it writes a trace whose first generated id is a string, and loads nothing.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("request")
    ap.add_argument("out")
    ap.add_argument("--malformed", action="store_true")
    args = ap.parse_args()
    req = json.loads(open(args.request).read())
    if args.malformed:
        bad = [{"name": c["name"], "rows": [{"generated_ids": ["seven"]}] * req["batch"]} for c in req["cases"]]
        open(args.out, "w").write(json.dumps({"cases": bad}))
        return
    import torch

    from evident.engine.checkpoint import load_model
    from evident.engine.generate import forced, generate
    from evident.workflow.parity.logprobs import Positions

    model = load_model(args.checkpoint, device="cpu", dtype=getattr(torch, args.dtype))
    cases = []
    for c in req["cases"]:
        prompts = [c["prompt_ids"]] * req["batch"]
        gen = generate(model, prompts, c["max_new_tokens"], eos_token_id=req.get("eos_token_ids"))
        case = {"name": c["name"], "rows": [{"generated_ids": ids} for ids in gen.tokens]}
        if "forced_ids" in c:
            pos = Positions(req["top_k"], c["score_ids"])
            forced(model, prompts, [c["forced_ids"]] * req["batch"], pos)
            case["forced_rows"] = [{"top_ids": r["top_ids"], "top_logprobs": r["top_logprobs"],
                                    "score_logprobs": r["ref_logprobs"]} for r in pos.rows]
        cases.append(case)
    open(args.out, "w").write(json.dumps({"engine": "tests/command_engine.py", "cases": cases}))


if __name__ == "__main__":
    main()
