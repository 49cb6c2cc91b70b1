"""How well conditioned a checkpoint is for parity: transformers' float32 top-1/top-2 logit margins, and its own
low-dtype error against its float32 run (mean |Δ log-prob| over the float32 top-8, top-1 agreement), along the
held-out generated GSM8K prompts with their gold answers (2 shots). For a trained checkpoint the synthetic
checkpoint of the same seed and config is measured beside it: that is the random-weight baseline (any other
checkpoint is measured alone).

    python tools/conditioning.py CKPT_DIR [--device cuda] [--dtype bfloat16] [--questions 16]

Prints one table: positions, margin quantiles, low-dtype error, top-1 agreement; over every position of the paths
and over the answer positions only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evident.workflow.core.evidence import read_json  # noqa: E402
from evident.workflow.models import checkpoints
from evident.workflow.parity import gsm8k, logprobs  # noqa: E402


def paths(tok, n: int) -> list[tuple[list[int], int]]:
    """(ids of prompt + gold answer, where the answer starts) of the first n held-out generated questions."""
    cfg = {"source": "generated", "seed": 0}
    test, train = gsm8k.load_split(cfg, "test")[0], gsm8k.load_split(cfg, "train")[0]
    out = []
    for it, row in zip(gsm8k.build_prompts(test, train, n, 2), test):
        prompt = tok(it["prompt"])["input_ids"]
        answer = tok(" " + row["answer"], add_special_tokens=False)["input_ids"]
        out.append((prompt + answer, len(prompt) - 1))  # position p predicts token p + 1
    return out


@torch.inference_mode()
def measure(ckpt: Path, device: str, dtype: str, n: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    along = paths(AutoTokenizer.from_pretrained(ckpt), n)
    runs = {}
    for dt in dict.fromkeys([logprobs.REFERENCE_DTYPE, dtype]):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=checkpoints.DTYPES[dt]).to(device).eval()
        runs[dt] = [model(torch.tensor([ids], device=device)).logits[0, :-1].float().cpu() for ids, _ in along]
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    out = {}
    for part in ("all", "answer"):
        margins, errs = [], []
        for (_, start), ref, low in zip(along, runs[logprobs.REFERENCE_DTYPE], runs[dtype]):
            keep = slice(0, None) if part == "all" else slice(start, None)
            ref, low = ref[keep], low[keep]
            top = ref.topk(2, dim=-1).values
            margins.append(top[:, 0] - top[:, 1])
            r = logprobs.reference(ref, 8)
            a = logprobs.at(low, r["top_ids"])
            errs.append(logprobs.errors(r, a["ref_logprobs"], a["top1"]))
        m = torch.cat(margins)
        q = torch.quantile(m, torch.tensor([0.1, 0.5, 0.9]))
        s = logprobs.stats(errs)
        out[part] = {"positions": s["positions"], "margin_p10": float(q[0]), "margin_median": float(q[1]),
                     "margin_p90": float(q[2]), "near_ties_below_0.5": float((m < 0.5).float().mean()),
                     f"{dtype}_mean_abs_delta": s["mean"], f"{dtype}_top1_agreement": s["top1_agreement"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    trained = (args.checkpoint / "evident_trained.json").is_file()
    results = {"trained" if trained else "given": measure(args.checkpoint, args.device, args.dtype, args.questions)}
    if trained:
        meta = read_json(args.checkpoint / "evident_trained.json")
        cfg = {k: v for k, v in read_json(args.checkpoint / "config.json").items()
               if k not in ("architectures", "model_type", "torch_dtype")}
        with tempfile.TemporaryDirectory() as tmp:
            random = checkpoints.write_synthetic(tmp, cfg, meta["seed"], meta["init_std"], meta["dtype"],
                                                 init_device=args.device)
            results["random (its init)"] = measure(random, args.device, args.dtype, args.questions)
    print(f"checkpoint | positions | margin p10 / median / p90 | share < 0.5 | {args.dtype} mean |Δ| | top-1 agreement")
    for name, by in results.items():
        for part, r in by.items():
            print(f"{name}, {part} | {r['positions']} | {r['margin_p10']:.3g} / {r['margin_median']:.3g} / "
                  f"{r['margin_p90']:.3g} | {r['near_ties_below_0.5']:.1%} | {r[f'{args.dtype}_mean_abs_delta']:.4g} | "
                  f"{r[f'{args.dtype}_top1_agreement']:.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
