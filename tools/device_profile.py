"""Profile capture on a lent GPU machine without Snakemake: context, checkpoint and profile stages in order.

    python3 tools/device_profile.py [--campaign config/campaigns/X.yaml] [--layers N] [--tool auto] --root DIR

The campaign's keys get the schema's defaults (as snakemake.utils.validate fills them), `device: cuda`;
`--layers` cuts the model to its first N layers (a quick capture of a large shape). The evidence lands in
DIR/evidence/<campaign>/<id>/ (unsealed: no MLflow there); the checkpoint in DIR/ckpt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))



def fill(schema: dict, value):
    """Schema defaults, recursively, for object sections (what validate(set_default=True) does)."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for k, sub in schema.get("properties", {}).items():
            if k not in value and "default" in sub:
                value[k] = json.loads(json.dumps(sub["default"]))
            if k in value:
                value[k] = fill(sub, value[k])
    elif schema.get("type") == "array" and isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [fill(schema["items"], v) for v in value]
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--campaign", default=str(REPO / "config/config.yaml"))
    ap.add_argument("--name", default=None, help="campaign name (default: <campaign>-profile)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tool", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--root", required=True, type=Path)
    a = ap.parse_args()
    from evident.workflow.core.evidence import evidence_id, git_state
    from evident.workflow.stages import checkpoint, context, profile

    cfg = yaml.safe_load(Path(a.campaign).read_text())
    cfg["campaign"] = a.name or f"{cfg['campaign']}-profile"
    cfg["device"] = a.device
    if a.dtype:
        cfg["dtype"] = a.dtype
    if a.layers:
        cfg["checkpoint"]["config"]["num_hidden_layers"] = a.layers
    cfg.setdefault("profile", {}).update(tool=a.tool, steps=a.steps)
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())
    cfg = fill(schema, cfg)
    # what workflow.campaign.evidence_config records (that module imports snakemake, not on the GPU machine):
    # no tracking or resources; a synthetic checkpoint has no paths to redact
    recorded = {k: v for k, v in cfg.items() if k not in ("tracking", "resources")}
    ev = a.root / "evidence" / cfg["campaign"] / evidence_id(git_state(REPO), recorded, cfg["repeat"])
    ckpt = a.root / "ckpt"
    spec = cfg["checkpoint"]
    checkpoint.fetch(ckpt, spec, cfg["dtype"], a.device)
    context.main(["--evidence", str(ev), "--config-json", json.dumps(recorded, sort_keys=True)])
    checkpoint.record(ckpt, ev)
    cap = profile.run(ckpt, ev)
    print(json.dumps({"evidence": str(ev), "tool": cap["tool"], "not_run": cap["not_run"],
                      "top": cap["top"][:5]}, indent=1))


if __name__ == "__main__":
    main()
