"""Stage `quality`: GSM8K (its first `quality.gsm8k.limit` rows) on each target, then the quality gate of every candidate against the reference.

Targets (`quality.targets`): `hf` (transformers' own model, in process, as the oracle loads it), `engine`
(this project's engine behind its OpenAI-compatible endpoint, `python -m evident.engine.serve`, started here on a
free port of 127.0.0.1, polled for readiness, always stopped; its log is logs/quality-engine-server.log), the name
of an `engines:` entry of kind openai (its url, or its serve command started and stopped as the engine's server is,
logged to logs/quality-<name>-server.log; workflow/plan/targets.py) and `{name, url}` (any OpenAI-compatible
`/v1/completions` endpoint). Same data, same contract for all
(workflow/parity/gsm8k.py). Outputs: quality/gsm8k-<target>.json, quality/gsm8k-<target>-rows.jsonl and
quality/gsm8k-gate.json; the verdict is the stage's tag `quality.verdict` (the gate fails the run on
anything but `pass`, after sealing, unless `quality.advisory`). On random weights (checkpoint.source synthetic) the
only claim is identical completions: anything else is `no_claim` (workflow/parity/gsm8k.py gate).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from evident.engine.config import read_config as read_hf_config  # a checkpoint's config.json
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args, write_text
from evident.workflow.core.gates import BY_NAME
from evident.workflow.core.verdicts import QUALITY
from evident.workflow.models import checkpoints, hf
from evident.workflow.parity import gsm8k
from evident.workflow.plan import environment, targets

QUALITY_GATE = BY_NAME["quality"]
ENGINE_LOG = layout.log("quality-engine-server")  # the engine's own server, which the stage starts
NOTE_RANDOM = ("the checkpoint has random (synthetic) weights: accuracy means nothing there, so the gate passes only "
               "on identical completions and otherwise makes no claim; it says nothing about model quality")


def target_name(t) -> str:
    return t if isinstance(t, str) else t["name"]


# --- targets -----------------------------------------------------------------------------------

class _StopOnText:
    """Stop once the decoded completion holds a stop string (the engine endpoint's rule; transformers' own
    stop_strings builds per-call tables over the vocabulary, seconds a call)."""

    def __init__(self, tok, start: int, stops: list[str]):
        self.tok, self.start, self.stops = tok, start, stops

    def __call__(self, input_ids, scores, **kwargs):
        text = self.tok.decode(input_ids[0, self.start:], skip_special_tokens=True)
        return torch.tensor([any(s in text for s in self.stops)], device=input_ids.device)


@torch.inference_mode()
def run_hf(ckpt: Path, items: list[dict], cfg: dict, dtype: str, device: str, log) -> tuple[list[str], dict]:
    import transformers
    from transformers import StoppingCriteria, StoppingCriteriaList

    StopOnText = type("StopOnText", (_StopOnText, StoppingCriteria), {})

    tok, model = hf.load(ckpt, dtype, device)
    out = []
    for i, it in enumerate(items, 1):
        ids = tok(it["prompt"])["input_ids"]
        gen = model.generate(torch.tensor([ids], device=device),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                             max_new_tokens=cfg["max_tokens"], do_sample=False, num_beams=1,
                             stopping_criteria=StoppingCriteriaList([StopOnText(tok, len(ids), list(cfg["stop"]))]))
        text = tok.decode(gen[0, len(ids):].tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        out.append(gsm8k.truncate(text, list(cfg["stop"])))
        log(f"hf {i}/{len(items)}")
    return out, {"implementation": f"transformers.{type(model).__name__} (native, eager), in process",
                 "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def complete(client: targets.Client, prompt: str, cfg: dict) -> str:
    doc = client.complete({"prompt": prompt, "max_tokens": cfg["max_tokens"], "stop": list(cfg["stop"]) or None})
    # An endpoint that ignores `stop` still gets the contract: cut at the first stop string.
    return gsm8k.truncate(doc["choices"][0]["text"], list(cfg["stop"]))


def run_endpoint(base: str, items: list[dict], cfg: dict, log, name: str) -> list[str]:
    client, out = targets.Client(base).connect(), []
    for i, it in enumerate(items, 1):
        out.append(complete(client, it["prompt"], cfg))
        log(f"{name} {i}/{len(items)}")
    return out


def run_engine(ckpt: Path, evidence: Path, items: list[dict], cfg: dict, dtype: str, device: str, log) -> tuple[list[str], dict]:
    """The engine behind its endpoint (engine_server), evaluated like any endpoint."""
    with targets.engine_server(ckpt, device, dtype, evidence / ENGINE_LOG) as (base, ready):
        log(f"engine server ready on 127.0.0.1 after {ready:.1f}s")
        texts = run_endpoint(base, items, cfg, log, "engine")
    return texts, {"implementation": "engine/ through its OpenAI-compatible endpoint (python -m evident.engine.serve, "
                                     "127.0.0.1, /v1/completions, greedy, batch 1)",
                   "server_ready_s": round(ready, 3), "versions": {"torch": torch.__version__}}


# --- the stage ---------------------------------------------------------------------------------

def run(ckpt: Path, evidence: Path, test_path: str | None = None, train_path: str | None = None,
        endpoints: dict[str, str] | None = None, engines: dict[str, dict] | None = None) -> dict:
    """endpoints: the URLs of `{name, url}` targets; engines: the `engines:` entries named as targets (their URLs and
    commands: the evidence config records hashes and redacted paths only)."""
    config = read_config(evidence / layout.CONFIG)
    q = config["quality"]
    cfg = q["gsm8k"]
    device = environment.resolve_device(config["device"])
    chosen = q["targets"]
    names = [target_name(t) for t in chosen]
    if q["reference"] not in names:
        raise ValueError(f"quality.reference {q['reference']!r} is not one of quality.targets {names}")
    params = {"targets": names, "reference": q["reference"], "tolerance": q["tolerance"],
              "fail_on_flips": q["fail_on_flips"], "advisory": q["advisory"], "source": cfg["source"],
              "limit": cfg["limit"], "shots": cfg["shots"], "max_tokens": cfg["max_tokens"], "match": cfg["match"], "device": device, "dtype": config["dtype"]}
    with Stage(evidence, "quality", params=params) as st:
        checkpoints.verify(ckpt, read_json(evidence / layout.CHECKPOINT))
        test, test_m = gsm8k.load_split(cfg, "test", test_path)
        train, train_m = gsm8k.load_split(cfg, "train", train_path)
        if len(test) < cfg["limit"]:
            raise gsm8k.DataError(f"quality.gsm8k.limit: {cfg['limit']} rows asked, the test data has {len(test)}")
        items = gsm8k.build_prompts(test, train, cfg["limit"], cfg["shots"])
        data = {"test": test_m, "train": train_m}
        contract = gsm8k.contract(cfg)
        limit = read_hf_config(ckpt).get("max_position_embeddings")
        if limit:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
            longest = max(len(tok.encode(it["prompt"]).ids) for it in items)
            if longest + cfg["max_tokens"] > limit:
                raise ValueError(f"quality.gsm8k: the longest prompt ({longest} tokens, {cfg['shots']} shots) + max_tokens "
                                 f"{cfg['max_tokens']} exceed the model's max_position_embeddings {limit}; lower "
                                 f"quality.gsm8k.shots or max_tokens, or use a model with a longer context")

        def log(msg: str) -> None:
            print(f"[quality] {msg}", flush=True)

        results, rows_of = {}, {}
        for t in chosen:
            name = target_name(t)
            t0 = time.perf_counter()
            if t == "hf":
                texts, meta = run_hf(ckpt, items, cfg, config["dtype"], device, log)
            elif t == "engine":
                texts, meta = run_engine(ckpt, evidence, items, cfg, config["dtype"], device, log)
                st.add_file(evidence / ENGINE_LOG)
            elif isinstance(t, str):  # an `engines:` entry: its url, or its server started here
                spec = (engines or {}).get(name)
                if spec is None:
                    raise ValueError(f"quality.targets: {name!r} needs its `engines:` entry (--engines JSON)")
                server_log = evidence / layout.log(f"quality-{name}-server")
                with targets.endpoint(spec, ckpt, spec.get("dtype") or config["dtype"], device, server_log) as base:
                    texts = run_endpoint(base, items, cfg, log, name)
                if server_log.is_file():
                    st.add_file(server_log)
                meta = {"implementation": f"engines: {name}, an OpenAI-compatible endpoint "
                                          + ("started by its serve command" if "serve" in spec else "(URL not recorded)")}
            else:
                url = (endpoints or {}).get(name) or t["url"]
                if url.startswith("<url>"):
                    raise ValueError(f"quality.targets: endpoint {name!r} needs its URL (--endpoint {name}=URL): "
                                     f"the evidence config records a hash of it only")
                texts = run_endpoint(url.rstrip("/"), items, cfg, log, name)
                meta = {"implementation": "an OpenAI-compatible endpoint (URL not recorded)"}
            rows, summary = gsm8k.score(items, texts, cfg["match"])
            res = {"target": name, **meta, "contract": contract, "data": data, **summary,
                   "seconds": round(time.perf_counter() - t0, 3), "device": device, "dtype": config["dtype"]}
            st.write_json(layout.quality_result(name), res)
            p = evidence / layout.quality_rows(name)
            st.add_file(write_text(p, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)))
            results[name], rows_of[name] = res, rows
            st.metrics[f"{name}_correct"] = res["correct"]
            st.metrics[f"{name}_accuracy"] = res["accuracy"]
            st.metrics[f"{name}_invalid"] = res["invalid"]
            log(f"{name}: {res['correct']}/{res['n']} correct ({cfg['match']}), {res['invalid']} invalid, "
                f"{res['seconds']:.1f}s")
        ref = q["reference"]
        random = config["checkpoint"]["source"] == checkpoints.RANDOM
        gates = [gsm8k.gate(results[ref], results[n], rows_of[ref], rows_of[n], q["tolerance"], q["fail_on_flips"],
                            random)
                 for n in names if n != ref]
        verdict = max((g["verdict"] for g in gates), key=QUALITY.index) if gates else "no_claim"
        doc = {"verdict": verdict, "advisory": q["advisory"], "reference": ref, "gates": gates,
               "random_weights": random, "note": NOTE_RANDOM if random else None,
               "reason": "; ".join(f"{g['candidate']}: {g['reason']}" for g in gates)
                         or "no candidate beside the reference: nothing compared"}
        st.write_json(layout.QUALITY_GATE, doc)
        st.tags[QUALITY_GATE.tag] = verdict
        st.metrics["flips"] = sum(len(g["flips"]) for g in gates)
        # completions that differ only in U+FFFD (undecodable bytes rendered otherwise): not identical, named apart
        st.metrics["replacement_only"] = sum(len(g.get("replacement_only") or []) for g in gates)
        log(f"gate {verdict}{' (advisory)' if q['advisory'] else ''}: {doc['reason']}")
    return doc


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__, checkpoint=True)
    ap.add_argument("--test", default=None, help="quality.gsm8k.test (source local): the evidence records its name only")
    ap.add_argument("--train", default=None, help="quality.gsm8k.train (source local)")
    ap.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                    help="the URL of an endpoint target (the evidence records a hash of it only)")
    ap.add_argument("--engines", type=json.loads, default=[], help="the `engines:` entries named as targets, as JSON")
    args = ap.parse_args(argv)
    try:
        endpoints = dict(e.split("=", 1) for e in args.endpoint)
        run(args.checkpoint, args.evidence, args.test, args.train, endpoints, {e["name"]: e for e in args.engines})
    except (gsm8k.DataError, checkpoints.CheckpointInvalid, ValueError, RuntimeError) as e:
        sys.exit(f"[quality] error: {e}")


if __name__ == "__main__":
    main()
