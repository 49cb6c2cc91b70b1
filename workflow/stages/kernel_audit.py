"""Stage `kernel_audit`: registers, spills and shared memory of the Triton kernels kernels/audit.py covers,
compiled at the campaign model's shapes (its K values and vocabulary), into kernels/audit.json, which names the
kernels covered and those not (`covers`, `not_covered`).

A spill fails the audit (verdict `spills`, and the gate fails the run once the directory is sealed).
Without CUDA nothing is compiled (the interpreter runs the kernels): the stage is recorded as skipped,
with the reason.

The shapes are the model family's (families.Family.audit, workflow/models/families/), from the engine's reading of
config.json: the K of every projection the engine's kernels see, the vocabulary, the routed experts and any options
kernels.audit.audit takes for the family, and the parts of the model no kernel in kernels/ covers, added to the
record's `not_covered`.
"""

from __future__ import annotations

from pathlib import Path

from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, stage_args
from evident.workflow.core.gates import BY_NAME, NOT_COMPILED
from evident.workflow.models import families
from evident.workflow.plan import environment

AUDIT_GATE = BY_NAME["audit"]
AUDIT = AUDIT_GATE.file


def shapes(ckpt_dir: Path) -> dict:
    """The family's audit of the checkpoint's model (families.Family.audit), with `hidden` (the engine's reading:
    transformers' default where absent)."""
    family, args = families.load(ckpt_dir)
    return {**family.audit(args), "hidden": args.hidden_size}


def model_shapes(ckpt_dir: Path) -> tuple[list[int], int]:
    """The K of every projection the engine's kernels see, and the vocabulary."""
    s = shapes(ckpt_dir)
    return s["k"], s["vocab"]


def not_covered(ckpt_dir: Path) -> dict:
    """kernels.audit's NOT_COVERED, and the parts of the family's model no kernel covers."""
    from evident.kernels.audit import NOT_COVERED

    return {**NOT_COVERED, **shapes(ckpt_dir)["not_covered"]}


def main(argv: list[str] | None = None) -> None:
    args = stage_args(__doc__, checkpoint=True).parse_args(argv)
    config = read_config(args.evidence / layout.CONFIG)
    device = environment.resolve_device(config["device"])
    model = shapes(args.checkpoint)
    ks, vocab, hidden = model["k"], model["vocab"], model["hidden"]
    with Stage(args.evidence, "kernel_audit", params={"device": device, "k": ks, "vocab": vocab, "hidden": hidden}) \
            as st:
        from evident.kernels.audit import COVERED, NOT_COVERED, audit

        missing = {**NOT_COVERED, **model["not_covered"]}

        if device != "cuda":
            reason = "no CUDA device: the Triton interpreter compiles nothing, so there is no register report"
            st.skip(reason)
            st.write_json(AUDIT, {"verdict": NOT_COMPILED, "reason": reason, "kernels": [], "covers": [],
                                  "would_cover": list(COVERED), "not_covered": missing})
            st.tags[AUDIT_GATE.tag] = NOT_COMPILED
            print(f"[kernel_audit] skipped: {reason}", flush=True)
            return
        import torch

        dtype = {"float16": torch.float16}.get(config["dtype"], torch.bfloat16)
        rows = audit(ks, vocab, hidden, dtype=dtype, experts=model["experts"], **model["options"])
        spilling = [r for r in rows if r["spills"]]
        verdict = "spills" if spilling else "ok"
        st.write_json(AUDIT, {"verdict": verdict, "kernels": rows, "covers": list(dict.fromkeys(r["kernel"] for r in rows)),
                              "not_covered": missing})
        st.tags[AUDIT_GATE.tag] = verdict
        st.metrics.update(kernels=len(rows), spills=sum(r["spills"] for r in rows),
                          max_registers=max(r["registers"] for r in rows))
        for r in rows:
            size = r.get("K", r.get("V", r.get("n")))  # a projection's K, the vocabulary, hc_mult
            print(f"[kernel_audit] {r['kernel']} {size} {r['dtype']}: {r['registers']} registers, "
                  f"{r['spills']} spills, {r['shared_bytes']} B shared", flush=True)
        print(f"[kernel_audit] {verdict}" + (f": {len(spilling)} kernels spill" if spilling else ""), flush=True)


if __name__ == "__main__":
    main()
