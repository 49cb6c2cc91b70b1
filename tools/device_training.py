"""How deterministic training is on this device: a campaign's trained checkpoint spec trained twice for a few steps
(workflow/models/training.py), the two written checkpoints compared file by file and tensor by tensor, with the seconds a
step took.

    python3 tools/device_training.py config/campaigns/dsv2-lite-trained.yaml [--steps 20]

Prints: seconds a step, whether the files are byte-identical, how many tensors differ, the largest |Δ| of a weight
(in the checkpoint's dtype, and relative to that tensor's largest value), and both runs' last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("EVIDENT_SKIP_DEVICE_CHECK", "1")

from evident.workflow.core.evidence import sha256_file  # noqa: E402
from evident.workflow.models import training  # noqa: E402
from evident.workflow.plan import environment
from evident.workflow.plan.campaign import validate_campaign  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("campaign", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = yaml.safe_load(args.campaign.read_text())
    validate_campaign(cfg, str(Path(__file__).resolve().parents[1] / "config/schema.yaml"))
    spec = cfg["checkpoint"]
    train = {**spec["train"], "steps": args.steps}
    device = environment.resolve_device(cfg["device"])
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        dirs, seconds = [], []
        for run in ("a", "b"):
            t0 = time.perf_counter()
            dirs.append(training.train(Path(tmp) / run, spec["config"], spec["seed"], spec["init_std"], cfg["dtype"],
                                       train, device=device, progress=lambda line: print(f"[{run}] {line}", flush=True)))
            seconds.append(time.perf_counter() - t0)
        files = sorted(p.name for p in dirs[0].iterdir())
        same = {f: sha256_file(dirs[0] / f) == sha256_file(dirs[1] / f) for f in files}
        a, b = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()} for d in dirs)
        differ, worst, rel = 0, 0.0, 0.0
        for k in a:
            d = (a[k].float() - b[k].float()).abs().max().item()
            if d:
                differ += 1
                worst = max(worst, d)
                rel = max(rel, d / max(a[k].float().abs().max().item(), 1e-30))
        loss = [json.loads((d / "evident_trained.json").read_text())["loss"]["last"] for d in dirs]
    print(f"\ndevice {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), {cfg['dtype']}, "
          f"{args.steps} steps of {train['batch_size']} x {train['seq_len']} tokens")
    print(f"seconds a run (init, steps, write): {seconds[0]:.1f} / {seconds[1]:.1f}")
    print(f"byte-identical files: {', '.join(f'{f} {same[f]}' for f in files)}")
    print(f"tensors that differ: {differ} of {len(a)}; largest |Δ| {worst:.3g} (relative {rel:.3g}); last loss {loss[0]} / {loss[1]}")


if __name__ == "__main__":
    main()
