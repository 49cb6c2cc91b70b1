"""Stage `oracle`: greedy generation with transformers' own model of the checkpoint (DeepseekV2, DeepseekV3, DeepseekV4; no
remote code).

Writes oracle/hf.json: per case the prompt ids, generated ids, decoded text, their hashes and
the top-1/top-2 logit margin at every step, which decides later whether a divergence is a near-tie.

Along each greedy trace (prompt plus generated ids, one forward) it also records the reference log-probs the
engine's teacher-forced runs are held to: at every position the top-k ids (`parity.top_k`) and their
log-probabilities, computed in float32 whatever the campaign's dtype. For a bf16 or fp16 campaign that is a
second load of the same checkpoint in float32, on the campaign's device where it fits, else on the CPU; the
campaign-dtype model's own log-probs of those ids are kept beside it (transformers' own rounding error, the
yardstick of the precision check).
"""

from __future__ import annotations

import sys

import torch

from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args, text_sha256, token_sha256
from evident.workflow.models import checkpoints, hf
from evident.workflow.parity import logprobs
from evident.workflow.parity.logprobs import REFERENCE_DTYPE
from evident.workflow.plan import environment


def reference_device(model, device: str) -> tuple[str, str]:
    """Where the float32 reference fits: (device, why). Called with the campaign-dtype model still loaded."""
    if not device.startswith("cuda") or model.dtype == torch.float32:
        return device, "the campaign's device"
    need = sum(p.numel() for p in model.parameters()) * 4
    have = torch.cuda.mem_get_info()[0] + sum(p.numel() * p.element_size() for p in model.parameters())
    if need * 1.1 < have:  # 10% for activations of one forward of a short path
        return device, "the campaign's device"
    return "cpu", f"the CPU: float32 weights ({need / 2**30:.1f} GiB) do not fit the {have / 2**30:.1f} GiB free on {device}"


@torch.inference_mode()
def path_logits(model, ids: list[int], device: str) -> torch.Tensor:
    """Logits [T - 1, vocab] of one forward over the path: position p predicts ids[p + 1]."""
    return model(torch.tensor([ids], device=device)).logits[0, :-1].float().cpu()


def decode(tok, ids: list[int], skip_special_tokens: bool = False) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def served(tok, ids: list[int]) -> dict:
    """The completion as an OpenAI-compatible server returns it (special tokens skipped, EOS among them), and where
    each token's text ends in it: what a text-level target is compared with (compare.text_case)."""
    return {"served_text": decode(tok, ids, True), "served_text_ends": [len(decode(tok, ids[:i + 1], True))
                                                                        for i in range(len(ids))]}


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
        **served(tok, ids),
        "margins": [float(t.values[0] - t.values[1]) for t in top],
        "top2_ids": [t.indices.tolist() for t in top],
    }


def main(argv: list[str] | None = None) -> None:
    args = stage_args(__doc__, checkpoint=True).parse_args(argv)
    config = read_config(args.evidence / layout.CONFIG)
    device = environment.resolve_device(config["device"])
    top_k = config["parity"]["top_k"]
    try:
        with Stage(args.evidence, "oracle", params={"dtype": config["dtype"], "device": device, "top_k": top_k}) as st:
            checkpoints.verify(args.checkpoint, read_json(args.evidence / layout.CHECKPOINT))
            torch.manual_seed(0)
            tok, model = hf.load(args.checkpoint, config["dtype"], device)
            cases, same = [], []
            for i, case in enumerate(config["cases"], 1):
                cases.append(run_case(tok, model, case, device))
                same.append(path_logits(model, cases[-1]["prompt_ids"] + cases[-1]["generated_ids"], device))
                print(f"[oracle] case {i}/{len(config['cases'])} {case['name']}: {len(cases[-1]['generated_ids'])} tokens, "
                      f"min margin {min(cases[-1]['margins'], default=float('nan')):.4g}", flush=True)
            ref_device, where = reference_device(model, device)
            if config["dtype"] != REFERENCE_DTYPE:
                hf.free(model)
                print(f"[oracle] float32 reference on {where}", flush=True)
                _, model = hf.load(args.checkpoint, REFERENCE_DTYPE, ref_device)
            for case, logits in zip(cases, same):
                ref = path_logits(model, case["prompt_ids"] + case["generated_ids"], ref_device)
                case["reference"] = logprobs.reference(ref, top_k)
                if config["dtype"] != REFERENCE_DTYPE:  # transformers' own log-probs in the campaign's dtype
                    case["same_dtype"] = logprobs.at(logits, case["reference"]["top_ids"])
            import transformers

            st.write_json(layout.ORACLE, {
                "implementation": f"transformers.{type(model).__name__} (native, eager)",
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "dtype": config["dtype"],
                "device": device,
                "reference": {"dtype": REFERENCE_DTYPE, "device": ref_device, "where": where, "top_k": top_k,
                              "path": "prompt + generated ids, one forward; position p predicts token p + 1"},
                "cases": cases,
            })
            st.metrics["tokens"] = sum(len(c["generated_ids"]) for c in cases)
            st.metrics["min_margin"] = min(m for c in cases for m in c["margins"] or [float("inf")])
    except checkpoints.CheckpointInvalid as e:
        sys.exit(f"[oracle] error: {e}")


if __name__ == "__main__":
    main()
