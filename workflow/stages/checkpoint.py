"""Stage `checkpoint`: materialise the campaign's checkpoint directory and record its hashes.

`fetch` fills the checkpoint cache (synthetic: the size estimate first, then a seeded write that reports its
progress; trained: the estimate, then training with a line of step and loss, workflow/models/training.py; hub: pinned
snapshot, then its estimate); `record` verifies the directory (missing or corrupt files,
expected sha256) and writes checkpoint.json (with `skipped` when the files hold multi-token-prediction tensors, and
why: the family's `mtp_skip`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from evident.engine.checkpoint import CheckpointError, mtp_tensors
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json
from evident.workflow.models import checkpoints, families, training
from evident.workflow.plan import environment, estimate


def say(line: str) -> None:
    print(f"[checkpoint] {line}", flush=True)


def fetch(ckpt_dir: Path, spec: dict, dtype: str, device: str) -> None:
    t0 = time.perf_counter()
    device = environment.resolve_device(device)
    if spec["source"] == "synthetic":
        say(f"estimate: {estimate.need(estimate.parameters(spec['config']), dtype).line()}")
        say(f"writing synthetic checkpoint (seed {spec['seed']}, {dtype}) to {ckpt_dir}")
        checkpoints.write_synthetic(ckpt_dir, spec["config"], spec["seed"], spec["init_std"], dtype,
                                    init_device=device, progress=say)
    elif spec["source"] == "trained":
        t = spec["train"]
        say(f"estimate: {estimate.need(estimate.parameters(spec['config']), dtype, trained=True).line()}")
        say(f"training (seed {spec['seed']}, {t['steps']} steps of {t['batch_size']} x {t['seq_len']} tokens, "
            f"lr {t['lr']:g}) on {device}; writing {dtype} to {ckpt_dir}")
        training.train(ckpt_dir, spec["config"], spec["seed"], spec["init_std"], dtype, t, device=device, progress=say)
    elif spec["source"] == "hub":
        say(f"fetching {spec['repo_id']}@{spec['revision']}")
        checkpoints.fetch_hub(ckpt_dir, spec["repo_id"], spec["revision"])
        if params := estimate.local_parameters(ckpt_dir):
            say(f"estimate: {estimate.need(params, dtype).line()}")
    else:
        raise ValueError(f"checkpoint.source {spec['source']!r} has nothing to fetch")
    say(f"ready in {time.perf_counter() - t0:.1f}s")


def record(ckpt_dir: Path, evidence: Path) -> None:
    config = read_config(evidence / layout.CONFIG)
    spec = config["checkpoint"]
    with Stage(evidence, "checkpoint", params={"source": spec["source"]}) as st:
        files = checkpoints.describe(ckpt_dir, spec.get("sha256"))
        checkpoints.check_prompts(ckpt_dir, config)  # before any engine or oracle work
        rec = {
            "source": spec["source"],
            "revision": spec.get("revision"),
            "repo_id": spec.get("repo_id"),
            "seed": spec.get("seed") if spec["source"] in checkpoints.WRITTEN else None,
            "files": files,
        }
        if spec["source"] == "trained":  # what it was trained on and the loss it reached, beside the hashes
            rec["trained"] = read_json(ckpt_dir / "evident_trained.json")
        try:
            skipped = mtp_tensors(ckpt_dir)
        except (CheckpointError, NotImplementedError, ValueError) as e:  # a config the engine cannot read
            raise checkpoints.CheckpointInvalid(f"{ckpt_dir}: {e}") from e
        if skipped:  # in the files, never run: the evidence says so
            why = families.of_checkpoint(ckpt_dir).mtp_skip
            rec["skipped"] = {"tensors": len(skipped), "first": skipped[0], "why": why}
        st.write_json(layout.CHECKPOINT, rec)
        st.metrics["bytes"] = sum(f["size"] for f in files.values())
        print(f"[checkpoint] {len(files)} files, {st.metrics['bytes'] / 1e6:.1f} MB verified", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    # The spec comes as a parameter, not a file: the cache is shared by every evidence directory.
    f.add_argument("--spec-json", required=True, help="the campaign's checkpoint section as JSON")
    f.add_argument("--dtype", required=True, choices=sorted(checkpoints.DTYPES))
    f.add_argument("--device", default="cpu",
                   help="the campaign's device: synthetic weights are drawn there, trained ones trained")
    f.add_argument("--out", required=True, type=Path, help="checkpoint cache directory")
    r = sub.add_parser("record")
    r.add_argument("--checkpoint", required=True, type=Path)
    r.add_argument("--evidence", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            fetch(args.out, json.loads(args.spec_json), args.dtype, args.device)
        else:
            record(args.checkpoint, args.evidence)
    except checkpoints.CheckpointInvalid as e:
        sys.exit(f"[checkpoint] error: {e}")


if __name__ == "__main__":
    main()
