"""Stage `oracle`: greedy generation with the real transformers DeepseekV2 (no remote code).

Writes oracle/hf.json: per case the prompt ids, generated ids, decoded text, their hashes and
the top-1/top-2 logit margin at every step, which decides later whether a divergence is a near-tie.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from workflow import checkpoints, environment
from workflow.evidence import Stage, read_config, read_json, text_sha256, token_sha256




def load(ckpt_dir: Path, dtype: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt_dir)
    # device_map loads straight onto the GPU (no 31 GB host copy first); accelerate does that part
    placement = {"device_map": device} if device != "cpu" else {}
    model, info = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=checkpoints.DTYPES[dtype], output_loading_info=True, **placement)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:  # a silent random init of a missing tensor would make the oracle meaningless
        raise checkpoints.CheckpointInvalid(f"transformers could not load {ckpt_dir} cleanly: {bad}")
    return tok, model.to(device).eval()


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@torch.inference_mode()
def run_case(tok, model, case: dict, device: str) -> dict:
    prompt_ids = tok(case["prompt"])["input_ids"]
    out = model.generate(
        torch.tensor([prompt_ids], device=device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
        max_new_tokens=case["max_new_tokens"], do_sample=False, num_beams=1,
        output_logits=True, return_dict_in_generate=True,
    )
    ids = out.sequences[0, len(prompt_ids):].tolist()
    top = [step[0].float().topk(2) for step in out.logits]
    text = decode(tok, ids)
    return {
        "name": case["name"],
        "prompt": case["prompt"],
        "prompt_ids": prompt_ids,
        "generated_ids": ids,
        "text": text,
        "token_sha256": token_sha256(ids),
        "text_sha256": text_sha256(text),
        "margins": [float(t.values[0] - t.values[1]) for t in top],
        "top2_ids": [t.indices.tolist() for t in top],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--evidence", required=True, type=Path)
    args = ap.parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    device = environment.resolve_device(config["device"])
    try:
        with Stage(args.evidence, "oracle", params={"dtype": config["dtype"], "device": device}) as st:
            checkpoints.verify(args.checkpoint, read_json(args.evidence / "checkpoint.json"))
            torch.manual_seed(0)
            tok, model = load(args.checkpoint, config["dtype"], device)
            cases = []
            for i, case in enumerate(config["cases"], 1):
                cases.append(run_case(tok, model, case, device))
                print(f"[oracle] case {i}/{len(config['cases'])} {case['name']}: {len(cases[-1]['generated_ids'])} tokens, "
                      f"min margin {min(cases[-1]['margins'], default=float('nan')):.4g}", flush=True)
            import transformers

            st.write_json("oracle/hf.json", {
                "implementation": "transformers.DeepseekV2ForCausalLM (native, eager)",
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "dtype": config["dtype"],
                "device": device,
                "cases": cases,
            })
            st.metrics["tokens"] = sum(len(c["generated_ids"]) for c in cases)
            st.metrics["min_margin"] = min(m for c in cases for m in c["margins"] or [float("inf")])
    except checkpoints.CheckpointInvalid as e:
        sys.exit(f"[oracle] error: {e}")


if __name__ == "__main__":
    main()
