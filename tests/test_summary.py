"""SUMMARY.md pastes into a pull request as it is (workflow/archive/summary.py): every gate's verdict first, a gate not run
never a pass, no relative link or image; DETAILS.md beside it holds the full tables and the plots, and a skipped
stage embeds no image in either. The same checks on the default campaign's files: tests/test_pipeline.py."""

from __future__ import annotations

import re

import handbuilt
import pytest
import tinyev

from evident.workflow.archive import summary
from evident.workflow.bench import benchstats
from evident.workflow.core import gates
from evident.workflow.core.evidence import write_json, write_text
from evident.workflow.stages import overlap as ov

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]*)[^)]*\)")  # a markdown link or image, its target
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)  # a reference-style link definition


def targets(text: str) -> list[str]:
    """Every link and image target of a markdown text."""
    return LINK.findall(text) + REFERENCE.findall(text)


def assert_pasteable(text: str) -> None:
    """A GitHub comment resolves no relative target: only absolute https ones, or none."""
    bad = [t for t in targets(text) if not t.startswith("https://")]
    assert not bad, bad


def gate_rows(text: str) -> dict[str, list[str]]:
    """The gates table, which opens the file after its title: {gate: [verdict, outcome, headline]}."""
    lines = text.splitlines()
    assert lines[0].startswith("## Evidence: ") and lines[2] == "| gate | verdict | outcome | headline |", lines[:3]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[4:4 + len(gates.GATES)]]
    return {r[0]: r[1:] for r in rows}


def test_the_link_check_sees_relative_targets():
    assert targets("![p](plots/bench.png) [d](DETAILS.md) [u](https://x.org/a) x\n[r]: ../a") == [
        "plots/bench.png", "DETAILS.md", "https://x.org/a", "../a"]
    with pytest.raises(AssertionError):
        assert_pasteable("see ![bench](plots/bench.png)")
    assert_pasteable("`plots/bench.png` and [MLflow](https://mlflow.example.org/#/experiments/1)")


@pytest.mark.parametrize(("gate", "verdict", "config", "advisory", "outcome"), [
    ("audit", "ok", {"stages": ["parity"]}, False, "not run (not in the campaign's `stages:`)"),
    ("audit", None, {"stages": ["kernel_audit"]}, False, "not run (no verdict written)"),
    ("audit", "not_compiled", {"stages": ["kernel_audit"]}, False, "measured nothing: not a pass"),
    ("overlap", "not_measured", {"stages": ["overlap"]}, False, "measured nothing: not a pass"),
    ("overlap", "bitwise_mismatch", {"stages": ["overlap"]}, False, "**fails the run**"),
    ("quality", "no_claim", {"stages": ["quality"]}, True, "**fails** (advisory: the run does not fail on it)"),
    ("quality", "pass", {"stages": ["quality"]}, False, "passes"),
    ("parity", "near_tie_divergence", {"stages": ["parity"], "parity": {"require_exact": False}}, False, "passes"),
    ("parity", "near_tie_divergence", {"stages": ["parity"], "parity": {"require_exact": True}}, False,
     "**fails the run**"),
    ("parity", "engine_accuracy_gap", {"stages": ["parity"], "parity": {"require_exact": False}}, False,
     "**fails the run**"),
])
def test_a_gate_outcome_is_the_gate_stages_and_one_not_run_never_passes(gate, verdict, config, advisory, outcome):
    doc = None if verdict is None else {"verdict": verdict, "advisory": advisory}
    assert summary.gate_outcome(gates.BY_NAME[gate], doc, config) == outcome


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """A directory where parity and overlap ran, overlap skipped its screen, bench
    wrote two cells and the audit and quality did not run: SUMMARY.md and DETAILS.md rendered from it."""
    root = tmp_path_factory.mktemp("summary")
    _, ev = tinyev.make(root, tinyev.config(stages=["parity", "bench", "overlap", "kernel_audit"]))
    write_json(ev / "env.json", {"device": "cpu", "packages": {"torch": "2", "transformers": "5"}})
    write_json(ev / "oracle/hf.json", {
        "implementation": "transformers.DeepseekV2ForCausalLM (native, eager)", "reference": {"top_k": 8},
        "cases": [{"name": "greeting", "prompt_ids": [2, 3], "generated_ids": [5], "token_sha256": "a" * 64,
                   "text_sha256": "b" * 64, "margins": [1e-5]}]})
    write_json(ev / "parity/comparison.json", {
        "verdict": "near_tie_divergence", "cells": [
            {"backend": "single", "kernels": "torch", "batch": 1, "case": "greeting", "verdict": "near_tie_divergence",
             "free_running": "near_tie_divergence", "first_divergence": {"step": 3, "oracle_token": 5,
                                                                        "engine_token": 6, "oracle_margin": 1e-5}}],
        "forced": [{"backend": "single", "kernels": "torch", "batch": 1, "logic": {"max": 1e-5, "top1_agreement": 1.0},
                    "precision": {"applies": False}}],
        "logic_tolerance": 5e-3, "precision_bound": 1.15, "near_tie_margin": 1e-4, "near_tie_noise": None})
    cells = [handbuilt.cell(batch=1), handbuilt.cell(batch=4, tpot=12.0, spread=0.1)]
    write_text(ev / "bench/summary.csv", benchstats.summary_frame(cells).to_csv(index=False))
    write_json(ev / "bench/baseline.json", {"baseline": None, "cells": []})
    skipped = {"skipped": ov.SKIP_REASON, "shapes": None, "bitwise": None, "verdict": "not_measured",
               "verdict_reason": ov.SKIP_REASON, "timing": {"measured": False, "reason": ov.SKIP_REASON}}
    write_json(ev / "overlap/screen.json", skipped)
    return ev, summary.render(ev, {"commit": "a" * 40}), summary.render_details(ev)


def test_summary_opens_with_every_gate_and_holds_no_link(partial):
    ev, text, _ = partial
    rows = gate_rows(text)
    assert list(rows) == [g.name for g in gates.GATES]
    assert rows["parity"] == ["`near_tie_divergence`", "passes", "0/1 cells exact"]
    assert rows["overlap"] == ["`not_measured`", "measured nothing: not a pass", ov.SKIP_REASON]
    assert rows["audit"] == ["—", "not run (no verdict written)", "—"]
    assert rows["quality"] == ["—", "not run (not in the campaign's `stages:`)", "—"]
    assert_pasteable(text)
    assert "![" not in text and "### Claim boundary" in text and f"`{summary.DETAILS}` beside this file" in text
    assert "| single | same | 10.00 / 100 | 13.20 / 303 (noisy) |" in text  # the bench cells, one row a contract


def test_details_holds_the_full_tables_and_a_skipped_stage_no_image(partial):
    _, text, details = partial
    assert "First divergences: 1 distinct" in text and "oracle 5 vs engine 6" not in text
    assert "- greeting: step 3: oracle 5 vs engine 6 (margin 1e-05) (single torch b1)" in details
    assert "steady TPOT p50 (ms)" in details and "steady TPOT p50 (ms)" not in text  # the full bench table
    assert "![decode tok/s and TPOT against batch](plots/bench.png)" in details
    assert "### Overlap A/B screen (skipped)" in details
    assert "overlap.png" not in details and "overlap.png" not in text  # the skipped screen's placeholder is not shown
