"""A tiny evidence directory for stage tests: the default campaign's config (schema defaults filled in for the
sections named) on the random-weight synthetic checkpoint of its model (training it is for the tests that need
trained weights: tests/test_training.py, the default run), config.yaml and checkpoint.json, as the rules leave
them."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from evident.workflow.core.evidence import write_text
from evident.workflow.models import checkpoints

REPO = Path(__file__).resolve().parents[1]


def defaults(schema: dict) -> dict:
    """Schema defaults of an object section, nested objects included."""
    out = {}
    for k, v in schema.get("properties", {}).items():
        if v.get("type") == "object" and "properties" in v:
            out[k] = {**defaults(v), **(v.get("default") or {})}
        elif "default" in v:
            out[k] = copy.deepcopy(v["default"])
    return out


def synthetic() -> dict:
    """The default campaign's model as a random-weight synthetic checkpoint spec (init_std 0.08: decisive traces)."""
    from evident.workflow.plan.campaign import model_config

    return {"source": "synthetic", "seed": 0, "init_std": 0.08, "config": model_config("tiny")}


def config(**sections) -> dict:
    """The default campaign on the synthetic checkpoint, with every quality/profile key at its schema default,
    overridden by `sections` (dicts are merged one level deep, gsm8k two)."""
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["checkpoint"] = synthetic()
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())["properties"]
    for name in ("quality", "profile"):
        base = defaults(schema[name])
        mine = cfg.get(name, {})
        merged = {**base, **mine}
        if name == "quality":
            merged["gsm8k"] = {**base["gsm8k"], **mine.get("gsm8k", {})}
        cfg[name] = merged
    for name, over in sections.items():
        if isinstance(over, dict) and isinstance(cfg.get(name), dict):
            sub = {**cfg[name], **over}
            if name == "quality" and "gsm8k" in over:
                sub["gsm8k"] = {**cfg[name]["gsm8k"], **over["gsm8k"]}
            cfg[name] = sub
        else:
            cfg[name] = over
    return cfg


def make(root: Path, cfg: dict) -> tuple[Path, Path]:
    """(checkpoint dir, evidence dir) under root."""
    ckpt, ev = root / "ckpt", root / "ev"
    spec = cfg["checkpoint"]
    checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], cfg["dtype"])
    ev.mkdir(parents=True, exist_ok=True)
    write_text(ev / "config.yaml", yaml.safe_dump(cfg, sort_keys=True))
    from evident.workflow.stages import checkpoint as stage

    stage.record(ckpt, ev)
    return ckpt, ev
