"""Stage `kernel_audit`: registers, spills and shared memory of the Triton kernels kernels/audit.py covers,
compiled at the campaign model's shapes (its K values and vocabulary), into kernels/audit.json, which names the
kernels covered and those not (`covers`, `not_covered`).

A spill fails the audit (verdict `spills`, and the gate fails the run once the directory is sealed).
Without CUDA nothing is compiled (the interpreter runs the kernels): the stage is recorded as skipped,
with the reason.

DeepSeek-V4 (`v4_shapes`): the same kernels at V4's shapes, the Ks of its projections (hidden_size: q_a, kv, the
compressors' and indexer's projections, weights_proj, the router, the shared expert's gate/up; q_lora_rank: q_b and
the indexer's q_b; num_attention_heads * head_dim / o_groups: a group of the grouped o_a; o_groups * o_lora_rank:
o_b; moe_intermediate_size: the experts' down; hc_mult * hidden_size: the hyper-connections' mixes), its routed
experts with the swiglu clamp, its hyper-connection weights kernel (hc_mult, hc_sinkhorn_iters; where kernels.audit
has them: `v4_options`) and its vocabulary. Its attention (sliding window with sinks, the compressors, the lightning
indexer's scores and top-k), the hyper-connections' collapse and merge and the hyper head, and the routers have no
kernel in kernels/ (the engine runs them as torch ops): `V4_NOT_COVERED`, added to the record's `not_covered`.
"""

from __future__ import annotations

import json
from pathlib import Path

from evident.engine.config import V4, load_args
from evident.workflow import environment
from evident.workflow.gates import BY_NAME, NOT_COMPILED
from evident.workflow.evidence import Stage, read_config, stage_args

AUDIT_GATE = BY_NAME["audit"]
AUDIT = AUDIT_GATE.file


V4_NOT_COVERED = {
    "DeepSeek-V4 attention (sliding window with sinks, compressors, lightning indexer scores and top-k)":
        "no kernel in kernels/: the engine runs it as torch ops",
    "DeepSeek-V4 hyper-connections' collapse and merge, and the hyper head": "no kernel in kernels/: torch ops",
    "DeepSeek-V4 hash router (tid2eid) and sqrtsoftplus top-k router": "no kernel in kernels/: torch ops",
}
HC_WEIGHTS = "DeepSeek-V4 hyper-connection weights (Sinkhorn)"  # not covered where kernels.audit has no hc_weights


def model_shapes(ckpt_dir: Path) -> tuple[list[int], int]:
    """The K of every projection the engine's kernels see, and the vocabulary, from config.json."""
    c = json.loads((ckpt_dir / "config.json").read_text())
    if c.get("model_type") == V4:
        return v4_shapes(ckpt_dir)[:2]
    heads = c["num_attention_heads"]
    ks = [c["hidden_size"], c["kv_lora_rank"], heads * c["v_head_dim"], c["moe_intermediate_size"],
          c["intermediate_size"]]
    if c.get("q_lora_rank"):
        ks.append(c["q_lora_rank"])
    if c.get("n_shared_experts"):
        ks.append(c["moe_intermediate_size"] * c["n_shared_experts"])
    return sorted(set(ks)), c["vocab_size"]


def v4_shapes(ckpt_dir: Path) -> tuple[list[int], int, tuple[int, int, int, int]]:
    """DeepSeek-V4's Ks (module docstring), vocabulary and routed experts (hidden, moe_intermediate,
    n_routed_experts, experts per token), from the engine's reading of config.json (transformers' defaults for
    absent fields)."""
    a = load_args(ckpt_dir)
    h = a.hidden_size
    ks = [h, a.q_lora_rank, a.num_attention_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank,
          a.moe_intermediate_size, a.hc_mult * h]
    return sorted(set(ks)), a.vocab_size, (h, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok)


def not_covered(ckpt_dir: Path) -> dict:
    """kernels.audit's NOT_COVERED, and V4_NOT_COVERED for a DeepSeek-V4 model (with the hyper-connection weights
    where the audit does not compile their kernel)."""
    from evident.kernels.audit import COVERED, NOT_COVERED

    if json.loads((ckpt_dir / "config.json").read_text()).get("model_type") != V4:
        return dict(NOT_COVERED)
    hc = {} if "hc_weights" in COVERED else {HC_WEIGHTS: "not compiled by kernels/audit.py"}
    return {**NOT_COVERED, **V4_NOT_COVERED, **hc}


def v4_options(ckpt_dir: Path) -> dict:
    """kernels.audit.audit's DeepSeek-V4 arguments it takes: the experts' swiglu clamp (`limit`) and the
    hyper-connection weights kernel's shape (`hc`: hc_mult, hc_sinkhorn_iters)."""
    import inspect

    from evident.kernels.audit import audit

    a, takes = load_args(ckpt_dir), inspect.signature(audit).parameters
    options = {"limit": float(a.swiglu_limit), "hc": (a.hc_mult, a.hc_sinkhorn_iters)}
    return {k: v for k, v in options.items() if k in takes}


def main(argv: list[str] | None = None) -> None:
    args = stage_args(__doc__, checkpoint=True).parse_args(argv)
    config = read_config(args.evidence / "config.yaml")
    device = environment.resolve_device(config["device"])
    ks, vocab = model_shapes(args.checkpoint)
    hidden = load_args(args.checkpoint).hidden_size  # the engine's reading: transformers' default where absent
    with Stage(args.evidence, "kernel_audit", params={"device": device, "k": ks, "vocab": vocab, "hidden": hidden}) \
            as st:
        from evident.kernels.audit import COVERED, audit

        missing = not_covered(args.checkpoint)

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
        c = json.loads((args.checkpoint / "config.json").read_text())
        options = {}
        if c.get("model_type") == V4:
            experts, options = v4_shapes(args.checkpoint)[2], v4_options(args.checkpoint)
        else:
            experts = (hidden, c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"]) \
                if c.get("n_routed_experts") else None
        rows = audit(ks, vocab, hidden, dtype=dtype, experts=experts, **options)
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
