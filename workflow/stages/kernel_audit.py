"""Stage `kernel_audit`: registers, spills and shared memory of the Triton kernels kernels/audit.py covers,
compiled at the campaign model's shapes (its K values and vocabulary), into kernels/audit.json, which names the
kernels covered and those not (`covers`, `not_covered`).

A spill fails the audit (verdict `spills`, and the gate fails the run once the directory is sealed).
Without CUDA nothing is compiled (the interpreter runs the kernels): the stage is recorded as skipped,
with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

from workflow import environment
from workflow.gates import BY_NAME
from workflow.evidence import Stage, read_config, stage_args

AUDIT_GATE = BY_NAME["audit"]
AUDIT = AUDIT_GATE.file


def model_shapes(ckpt_dir: Path) -> tuple[list[int], int]:
    """The K of every projection the engine's kernels see, and the vocabulary, from config.json."""
    c = json.loads((ckpt_dir / "config.json").read_text())
    heads = c["num_attention_heads"]
    ks = [c["hidden_size"], c["kv_lora_rank"], heads * c["v_head_dim"], c["moe_intermediate_size"],
          c["intermediate_size"]]
    if c.get("q_lora_rank"):
        ks.append(c["q_lora_rank"])
    if c.get("n_shared_experts"):
        ks.append(c["moe_intermediate_size"] * c["n_shared_experts"])
    return sorted(set(ks)), c["vocab_size"]


def main(argv: list[str] | None = None) -> None:
    args = stage_args(__doc__, checkpoint=True).parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    device = environment.resolve_device(config["device"])
    ks, vocab = model_shapes(args.checkpoint)
    with Stage(args.evidence, "kernel_audit", params={"device": device, "k": ks, "vocab": vocab}) as st:
        from kernels.audit import COVERED, NOT_COVERED, audit

        if device != "cuda":
            reason = "no CUDA device: the Triton interpreter compiles nothing, so there is no register report"
            st.skip(reason)
            st.write_json(AUDIT, {"verdict": "not_compiled", "reason": reason, "kernels": [], "covers": [],
                                  "would_cover": list(COVERED), "not_covered": NOT_COVERED})
            st.tags[AUDIT_GATE.tag] = "not_compiled"
            print(f"[kernel_audit] skipped: {reason}", flush=True)
            return
        import torch

        dtype = {"float16": torch.float16}.get(config["dtype"], torch.bfloat16)
        c = json.loads((args.checkpoint / "config.json").read_text())
        experts = (c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"]) \
            if c.get("n_routed_experts") else None
        rows = audit(ks, vocab, dtype=dtype, experts=experts)
        spilling = [r for r in rows if r["spills"]]
        verdict = "spills" if spilling else "ok"
        st.write_json(AUDIT, {"verdict": verdict, "kernels": rows, "covers": list(dict.fromkeys(r["kernel"] for r in rows)),
                              "not_covered": NOT_COVERED})
        st.tags[AUDIT_GATE.tag] = verdict
        st.metrics.update(kernels=len(rows), spills=sum(r["spills"] for r in rows),
                          max_registers=max(r["registers"] for r in rows))
        for r in rows:
            print(f"[kernel_audit] {r['kernel']} {r.get('K', r.get('V'))} {r['dtype']}: {r['registers']} registers, "
                  f"{r['spills']} spills, {r['shared_bytes']} B shared", flush=True)
        print(f"[kernel_audit] {verdict}" + (f": {len(spilling)} kernels spill" if spilling else ""), flush=True)


if __name__ == "__main__":
    main()
