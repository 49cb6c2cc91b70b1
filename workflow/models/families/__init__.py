"""Model families: what the workflow asks of a model, answered once per family.

A family module (deepseek.py: DeepSeek-V2/V3, the MLA models; deepseek_v4.py: DeepSeek-V4) fills a `Family`
(family.py); the workflow picks it from a config's model_type (`of`, `of_checkpoint`, `load`) and asks it, never
naming one. Adding a family (its engine beside) is one module filling every field of `Family`, its entry in
FAMILIES, its tiny model (config/models/, `Family.tiny`), its model_type and fields in config/schema.yaml, and its
tests (tests/test_families.py). A config is read only through the engine's readers (engine.config: read_config and
the family's own from_hf).
"""

from __future__ import annotations

import os
from typing import Any

from evident.engine.config import read_config
from evident.workflow.models.families import deepseek, deepseek_v4
from evident.workflow.models.families.family import DEFAULT_MODEL_TYPE, Family, UnknownFamily

__all__ = ["FAMILIES", "Family", "UnknownFamily", "load", "model_type", "of", "of_checkpoint"]

# model_type -> its family, written once
FAMILIES: dict[str, Family] = {t: f for f in (deepseek.FAMILY, deepseek_v4.FAMILY) for t in f.architectures}


def model_type(hf_config: dict) -> str:
    """A config's model_type; DeepSeek-V2's where it names none (engine.config.ModelArgs)."""
    return hf_config.get("model_type") or DEFAULT_MODEL_TYPE


def of(hf_config: dict) -> Family:
    """The family of a config.json dict (or a campaign's checkpoint.config), by its model_type."""
    kind = model_type(hf_config)
    if kind not in FAMILIES:
        raise UnknownFamily(f"model_type {kind!r} is no model family the workflow knows (known: "
                            f"{', '.join(sorted(FAMILIES))}; a family is a module of workflow/models/families/)")
    return FAMILIES[kind]


def of_checkpoint(ckpt_dir: str | os.PathLike) -> Family:
    """The family of a checkpoint directory (its config.json, read by engine.config.read_config)."""
    return of(read_config(ckpt_dir))


def load(ckpt_dir: str | os.PathLike) -> tuple[Family, Any]:
    """(family, the engine's reading) of a checkpoint directory's config.json."""
    config = read_config(ckpt_dir)
    family = of(config)
    return family, family.args(config)
