"""Stage `parity_target`: one engine target of `engines:` (workflow/plan/targets.py) on the oracle's cases, as `parity` runs
the builtin engine: parity/<name>-b<B>.json per batch size, the same record where the target gives the same facts.

- `openai`: per case, B concurrent requests (greedy, max_tokens the case's max_new_tokens, no stop strings). Where
  the server takes a prompt of token ids and names its tokens as ids (level `token`), the prompt is the oracle's
  prompt ids and each row its ids, text and hashes, as the builtin engine's; where it also echoes a prompt's
  log-probs, B concurrent echo requests of the oracle's path (prompt + generated ids) are the teacher-forced run.
  A server that takes text only (level `text`) gets the case's prompt as text; its completions are compared as
  text (compare: `text_only`, never exact).
- `command`: one request per batch size holds every case, the oracle's path to follow (`forced_ids`) and, at each
  position, the ids to score (the oracle's top-k); the trace's rows are the free run, its forced rows the forced run.

A forced run is recorded in the target's dtype (the entry's `dtype`, else the campaign's): the logic check applies
where that is float32, the precision check where it is the campaign's bf16 or fp16. Where a server's top log-probs
leave out one of the oracle's top-k ids, the id's log-prob is at most the smallest listed: it is recorded as the
value nearest the oracle's that this allows (so its error is a lower bound) and counted in `bounded`.
What ran is recorded under `target`: the engine's name and version, its recipe and flags, its weights' and KV cache's
dtypes, a converted file's hash (`converted`), the server's model id (a path redacted) and what it offered.
Logs: logs/parity-<name>-server.log (a `serve` target), logs/parity-<name>-command.log and the requests and traces
under logs/parity-<name>/ (a `command` target), logs/<name>-gguf.log (a conversion).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from evident.engine.checkpoint import eos_ids
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args, text_sha256
from evident.workflow.models import checkpoints
from evident.workflow.parity.traces import first_row_mismatch
from evident.workflow.parity.traces import token_row as parity_row
from evident.workflow.plan import environment, recipes, targets


def token_row(tok: Tokenizer, ids: list[int], served: str | None = None) -> dict:
    row = parity_row(tok, ids)  # as the builtin engine's rows: compared with the oracle's text
    return row if served is None else {**row, "served_text": served}


def forced_row(reference: dict, tops: list[list[tuple[int, float]]]) -> dict:
    """A Positions-shaped row (logprobs.row_errors) from a server's top log-probs per position of the oracle's path:
    an oracle top-k id the server did not list gets min(the smallest listed, the oracle's value), a bound."""
    ref, bounded = [], 0
    for ids, want, top in zip(reference["top_ids"], reference["top_logprobs"], tops):
        have, floor = dict(top), min(v for _, v in top)
        bounded += sum(i not in have for i in ids)
        ref.append([have[i] if i in have else min(floor, w) for i, w in zip(ids, want)])
    return {"top_ids": [[i for i, _ in top] for top in tops], "top_logprobs": [[v for _, v in top] for top in tops],
            "ref_logprobs": ref, "bounded": bounded}


def echo_tops(choice: dict, path: list[int], name: str) -> list[list[tuple[int, float]]]:
    """Each position's top log-probs along the echoed path (position p predicts token p + 1), its token's included."""
    lp = choice["logprobs"]
    if (targets.token_ids(choice) or [])[:len(path)] != path:
        raise targets.TargetError(f"target {name}: the echoed prompt is not the path sent (token ids differ)")
    out = []
    for p in range(1, len(path)):
        top = dict(targets.top_entries(lp["top_logprobs"][p]))
        top.setdefault(path[p], float(lp["token_logprobs"][p]))
        out.append(sorted(top.items(), key=lambda e: -e[1]))
    return out


def openai_batch(client: targets.Client, name: str, oracle: dict, cases: list[dict], batch: int, offered: dict,
                 tok: Tokenizer, dtype: str) -> list[dict]:
    token, out = targets.level(offered) == "token", []
    for case in cases:
        o = oracle[case["name"]]
        body = {"max_tokens": case["max_new_tokens"]}
        if token:
            body |= {"prompt": o["prompt_ids"], "logprobs": min(2, offered["logprobs"]), "return_tokens_as_token_ids": True}
        else:
            body["prompt"] = case["prompt"]
        docs = client.complete_all([body] * batch)
        choices = [d["choices"][0] for d in docs]
        rec = {"name": case["name"], "prompt_ids": o["prompt_ids"] if token else None, "prompt": case["prompt"],
               "prompt_tokens": (docs[0].get("usage") or {}).get("prompt_tokens"), "margins": None}
        if token:
            ids = [targets.token_ids(c) for c in choices]
            if any(i is None for i in ids):
                raise targets.TargetError(f"target {name}: a completion's tokens were not named as token ids")
            rows = [token_row(tok, i, c["text"]) for i, c in zip(ids, choices)]
            if offered["logprobs"] >= 2:  # the target's own top-1/top-2 margins along row 0 (log-probs differ as logits do)
                tops = [targets.top_entries(t) for t in choices[0]["logprobs"]["top_logprobs"]]
                rec["margins"] = [t[0][1] - t[1][1] if len(t) > 1 else None for t in tops]
            mismatch = first_row_mismatch(ids)
        else:
            rows = [{"text": c["text"], "text_sha256": text_sha256(c["text"])} for c in choices]
            mismatch = first_row_mismatch([c["text"] for c in choices])
        rec |= {"rows_identical": mismatch is None, "first_row_mismatch": mismatch, "rows": rows}
        if token and offered["echo"]:
            path = o["prompt_ids"] + o["generated_ids"]
            echo = {"prompt": path, "max_tokens": offered["echo_max_tokens"], "echo": True,
                    "logprobs": offered["logprobs"], "return_tokens_as_token_ids": True}
            forced = [forced_row(o["reference"], echo_tops(d["choices"][0], path, name))
                      for d in client.complete_all([echo] * batch)]
            rec["forced"] = {dtype: {"rows": forced}}
        out.append(rec)
    return out


def command_batch(spec: dict, oracle: dict, cases: list[dict], batch: int, tok: Tokenizer, ckpt: Path, evidence: Path,
                  dtype: str, device: str, top_k: int, values: dict) -> tuple[list[dict], dict | None]:
    name = spec["name"]
    request = {"schema": "evident-request/1", "batch": batch, "top_k": top_k, "eos_token_ids": eos_ids(ckpt),
               "cases": [{"name": c["name"], "prompt_ids": oracle[c["name"]]["prompt_ids"],
                          "max_new_tokens": c["max_new_tokens"], "forced_ids": oracle[c["name"]]["generated_ids"],
                          "score_ids": oracle[c["name"]]["reference"]["top_ids"]} for c in cases]}
    trace = targets.run_command(spec, request, evidence / layout.LOGS / f"parity-{name}",
                                evidence / layout.log(f"parity-{name}-command"),
                                checkpoint=ckpt.resolve(), dtype=dtype, device=device, **values)
    out = []
    for case, got in zip(cases, trace["cases"]):
        ids = [r["generated_ids"] for r in got["rows"]]
        mismatch = first_row_mismatch(ids)
        rec = {"name": case["name"], "prompt_ids": oracle[case["name"]]["prompt_ids"], "prompt": case["prompt"],
               "margins": None, "rows_identical": mismatch is None, "first_row_mismatch": mismatch,
               "rows": [token_row(tok, i) for i in ids]}
        if got.get("forced_rows") is not None:
            rec["forced"] = {dtype: {"rows": [{"top_ids": r["top_ids"], "top_logprobs": r["top_logprobs"],
                                               "ref_logprobs": r["score_logprobs"], "bounded": 0}
                                              for r in got["forced_rows"]]}}
        out.append(rec)
    return out, trace.get("engine")


def run(ckpt: Path, evidence: Path, spec: dict, batch_sizes: list[int]) -> dict[int, dict]:
    config = read_config(evidence / layout.CONFIG)
    name, kind = spec["name"], spec["kind"]
    device = environment.resolve_device(config["device"])
    dtype = spec.get("dtype") or config["dtype"]
    with Stage(evidence, f"parity-{name}", params={"target": name, "kind": kind, "dtype": dtype, "device": device,
                                                  "batch_sizes": batch_sizes}) as st:
        checkpoints.verify(ckpt, read_json(evidence / layout.CHECKPOINT))
        oracle_doc = read_json(evidence / layout.ORACLE)
        oracle = {c["name"]: c for c in oracle_doc["cases"]}
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        cases, top_k = config["cases"], oracle_doc["reference"]["top_k"]
        values, converted = targets.prepared(spec, ckpt, dtype, evidence / "logs")
        info = {"name": name, "kind": kind, "dtype": dtype, **recipes.describe(spec, dtype), "converted": converted}
        print(f"[parity {name}] {info['engine'] or kind} {info['version'] or ''}".rstrip()
              + f"; weights {dtype}, KV cache {info['kv_cache_dtype']}", flush=True)
        records = {}
        if kind == "openai":
            log = evidence / layout.log(f"parity-{name}-server")
            with targets.endpoint(spec, ckpt, dtype, device, log, values) as base:
                client = targets.Client(base).connect()
                offered = targets.offers(client, oracle[cases[0]["name"]]["prompt_ids"], top_k, spec.get("dialect", "openai"))
                info |= {"level": targets.level(offered), "offers": offered, "model": targets.model_id(client.model)}
                print(f"[parity {name}] {'started' if 'serve' in spec else 'at its url'}; level {info['level']}, "
                      f"offers {offered}", flush=True)
                for b in batch_sizes:
                    records[b] = openai_batch(client, name, oracle, cases, b, offered, tok, dtype)
            if log.is_file():
                st.add_file(log)
        else:
            info["level"] = "token"
            for b in batch_sizes:
                records[b], engine = command_batch(spec, oracle, cases, b, tok, ckpt, evidence, dtype, device, top_k,
                                                   values)
                info["engine"] = info["engine"] or engine
        for b, recs in records.items():
            st.write_json(layout.parity_run(f"{name}-b{b}"), {
                "engine": f"engines: {name} ({kind})", "backend": name, "kernels": kind, "target": info,
                "dtype": config["dtype"], "device": device, "batch": b, "cases": recs})
            st.metrics[f"b{b}_rows_identical"] = float(all(c["rows_identical"] for c in recs))
            forced = "teacher-forced " + ("in " + dtype if all("forced" in c for c in recs) else "not offered")
            print(f"[parity {name}] b{b}: {len(recs)} cases at level {info['level']}, rows identical: "
                  f"{all(c['rows_identical'] for c in recs)}; {forced}", flush=True)
        st.params["level"] = info["level"]
    return records


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__, checkpoint=True)
    ap.add_argument("--spec", required=True, type=json.loads,
                    help="the `engines:` entry as JSON (its URL and commands travel here: the evidence config records "
                         "a hash of the URL and the commands with their paths redacted)")
    ap.add_argument("--batch-sizes", required=True, type=lambda text: [int(b) for b in text.split(",")])
    args: argparse.Namespace = ap.parse_args(argv)
    try:
        run(args.checkpoint, args.evidence, args.spec, args.batch_sizes)
    except (targets.TargetError, checkpoints.CheckpointInvalid, OSError) as e:
        sys.exit(f"[parity {args.spec.get('name')}] error: {e}")


if __name__ == "__main__":
    main()
