"""Campaign configs for the tests of the campaign check: a base with dotted keys overridden, and the check's error."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from snakemake.exceptions import WorkflowError

from evident.workflow.plan.campaign import validate_campaign

SCHEMA = str(Path(__file__).resolve().parents[1] / "config/schema.yaml")


def overridden(base: dict, **over) -> dict:
    """A copy of base with each dotted key (`bench.batch_sizes`, `cases.0.prompt`) set; missing sections made."""
    cfg = copy.deepcopy(base)
    for key, value in over.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return cfg


def rejected(cfg: dict, overrides: dict | None = None) -> str:
    """The campaign check's error for cfg, with --config `overrides` if any (it must refuse it)."""
    with pytest.raises(WorkflowError) as e:
        validate_campaign(cfg, SCHEMA, overrides)
    return str(e.value)
