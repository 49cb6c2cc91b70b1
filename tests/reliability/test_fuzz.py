"""Fuzzing (hypothesis): the campaign config loader and the evidence reader raise only their intended errors."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import handbuilt
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snakemake.exceptions import WorkflowError

from evident.workflow import cli
from evident.workflow.archive import archive, diff
from evident.workflow.plan.campaign import evidence_config, validate_campaign

REPO = Path(__file__).resolve().parents[2]
SCHEMA = str(REPO / "config/schema.yaml")
TINY = yaml.safe_load((REPO / "config/config.yaml").read_text())
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["cpu", "cuda", "auto", "single", "..", "a/b", "float32"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


@st.composite
def mutated_configs(draw):
    cfg = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(list(paths(cfg))[1:]))
        *parent_path, last = where
        parent = cfg
        for p in parent_path:
            parent = parent[p]
        action = draw(st.sampled_from(["set", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            parent.pop(last, None)
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(values)
        else:
            parent[last] = draw(values)
    return cfg


@FUZZ
@given(mutated_configs())
def test_config_loader_raises_only_its_error(cfg):
    try:
        validate_campaign(cfg, SCHEMA)
    except WorkflowError as e:
        assert "invalid campaign config at `" in str(e), str(e)
        return
    evidence_config(cfg)  # a config that passes is recorded without error


@FUZZ
@given(st.text(max_size=300))
def test_yaml_text_loader(text):
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if not isinstance(cfg, dict):
        return  # Snakemake refuses a config file that is not a mapping before the Snakefile runs
    with pytest.raises(WorkflowError, match="invalid campaign config at"):
        validate_campaign(cfg, SCHEMA)  # no campaign key and no cases: never valid


# --- the evidence reader: damaged files of every kind --------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "evidence"
    handbuilt.build(root, "tiny", "aaaaaaa-c11111111-r1", plot=False)
    handbuilt.build(root, "tiny", "bbbbbbb-c22222222-r1", plot=False)
    return root


TARGETS = ["MANIFEST.json", "config.yaml", "env.json", "checkpoint.json", "stages/compare.json",
           "parity/comparison.json", "bench/single-b1.json", "SUMMARY.md"]
json_docs = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.sampled_from(
                                                              ["files", "verdict", "tracking", "status", "stats",
                                                               "backend", "batch", "sha256", "size", "cells",
                                                               "manifest_sha256", "name", "started_utc", "git",
                                                               "packages", "gpus", "device", "tags", "metrics"]),
                                                              inner, max_size=5)), max_leaves=15)
contents = st.one_of(st.binary(max_size=200), json_docs.map(lambda d: json.dumps(d).encode()))


@settings(FUZZ, max_examples=40)
@given(target=st.sampled_from(TARGETS), data=contents)
def test_evidence_reader_survives_damage(pristine, target, data, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "evidence"
        shutil.copytree(pristine, root)
        ev = root / "tiny/aaaaaaa-c11111111-r1"
        (ev / target).write_bytes(data)
        e = archive.load(ev)
        _ = (e.state, e.gates, e.tracking, e.created, e.commit, e.device, e.campaign)
        result = archive.verify(ev)
        assert set(result) == {"missing", "extra", "changed", "problems"}
        diff.diff(e, archive.load(root / "tiny/bbbbbbb-c22222222-r1"))
        assert cli.main(["--root", str(root), "ls"]) == 0
        assert cli.main(["--root", str(root), "verify", "--all"]) in (0, 1)
        assert cli.main(["--root", str(root), "show", "aaaaaaa"]) == 0
        assert cli.main(["--root", str(root), "diff", "aaaaaaa", "bbbbbbb"]) == 0
        capsys.readouterr()
