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


# --- issue 66: the rate rung, the soak, the prefill floor ---------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """bench (b1 with a prefill floor, b4 sealed before it had one), serve_bench's rate rung (r2 every request good,
    r4 two reset and too slow for the SLO, with its plot) and a failing soak (the engine passes, a url target's
    memory is unknown, a server dies): (directory, SUMMARY.md, DETAILS.md)."""
    import rated

    root = tmp_path_factory.mktemp("served")
    _, ev = tinyev.make(root, tinyev.config(stages=["bench", "serve_bench", "soak"]))
    write_json(ev / "env.json", {"device": "cpu", "packages": {"torch": "2", "transformers": "5"}})
    cells = [handbuilt.cell(batch=1), handbuilt.cell(batch=4, tpot=12.0)]
    cells[0]["prefill_floor"] = rated.prefill_floor(20.0, 0.5)
    for c in cells:
        write_json(ev / f"bench/single-b{c['batch']}.json", c)
    write_text(ev / "bench/summary.csv", benchstats.summary_frame(cells).to_csv(index=False))
    write_json(ev / "bench/baseline.json", {"baseline": None, "cells": []})
    write_text(ev / "plots/rates-engine.png", "a plot")
    died = {"known": True, "samples": [[0.0, 400.0], [1.0, 401.0]], "rule": "r", "growth_mb": None, "growth": None,
            "flagged": False, "why": "no sample in the middle or the last third (the server died first)"}
    rated.write(ev, rates=[rated.rate_cell(rate=2), rated.rate_cell(rate=4, tpot=20.0, failed=2)],
                soaks=[rated.soak_record("engine"), rated.soak_record("remote", kind="openai", memory=rated.URL_MEMORY),
                       rated.soak_record("dying", kind="openai", sent=10, errors=1, died_at=1.4, memory=died)])
    return ev, summary.render(ev, {"commit": "a" * 40}), summary.render_details(ev)


def test_summary_shows_the_rate_rung_and_a_failing_soak_with_its_reasons(served):
    _, text, _ = served
    rows = gate_rows(text)
    assert rows["soak"][:2] == ["`fail`", "**fails the run**"]
    assert rows["soak"][2] == ("dying: 1 of 10 requests failed (first: URLError: connection refused); "
                               "dying: the server died 1.4 s into the soak, exit code -9")
    # 4 tokens a request over 3 s; goodput: requests within TTFT <= 100 ms and TPOT <= 10 ms, a second
    assert "goodput under TTFT ≤ 100 ms and TPOT ≤ 10 ms; one run a rate: no noise estimate, no claim" in text
    assert "| `engine` | 2 | 6/6 | 20.00 / 20.00 | 5.00 / 5.00 | 8.0 | 2.00/s (6/6) |" in text
    assert "| `engine` | 4 | 4/6 | 20.00 / 20.00 | 20.00 / 20.00 | 5.3 | 0.00/s (0/6) |" in text
    assert "| `engine` | 30/30 | 0 | ran throughout | +0.0 MB (+0.0%) | 1.10x |" in text
    assert "| `remote` | 30/30 | 0 | ran throughout | unknown | 1.10x |" in text
    assert "| `dying` | 10/30 | 1 | died at 1.4 s (exit -9) | unknown | — |" in text
    assert "- dying: the server died 1.4 s into the soak, exit code -9" in text
    assert "| single | same | 10.00 / 100; TTFT 40.0x floor | 12.00 / 333 |" in text  # b4 has no floor: none shown
    assert_pasteable(text)
    assert "![" not in text


def test_details_show_every_rate_figure_the_plot_the_soak_and_the_prefill_floor(served):
    _, _, details = served
    assert "![engine: output tok/s and goodput against TPOT p50, a point a rate](plots/rates-engine.png)" in details
    assert "- `engine`: 6 requests a rate at poisson arrivals (seed 0)" in details
    r4 = next(line for line in details.splitlines() if line.startswith("| `engine` | 4 "))
    assert [c.strip() for c in r4.strip("|").split("|")][:8] == ["`engine`", "4", "4/6", "2", "3.00", "1.33", "5.3",
                                                                 "0.00/s (0/6)"]
    assert "- `http-engine-r4`: 2 failed; first: request 4, ConnectionResetError: reset by peer" in details
    assert "**Verdict: `fail`** — dying: 1 of 10 requests failed" in details
    assert "- `remote`: unknown, not 0: a url target: its server runs elsewhere." in details
    assert "- `dying`: growth unknown, no sample in the middle or the last third (the server died first)" in details
    assert "- `dying` request 9: URLError: connection refused" in details
    assert "- `killed | by the test`" in details  # the dead server's last log lines
    prefill = {line.split("|")[3].strip(): line for line in details.splitlines() if line.startswith("| single ")
               and line.count("|") == 12}
    assert "40.0x" in prefill["1"] and "0.500" in prefill["1"] and "flops" in prefill["1"]
    assert [c.strip() for c in prefill["4"].split("|")[4:12]] == ["—"] * 8  # sealed before it had one


def test_an_older_directory_renders_without_rates_soak_or_prefill_floor(partial):
    _, text, details = partial
    assert gate_rows(text)["soak"] == ["—", "not run (not in the campaign's `stages:`)", "—"]
    for doc in (text, details):
        assert "request rates" not in doc and "### Soak" not in doc and "prefill floor" not in doc.lower()
    assert "x floor" not in text and "| single | same | 10.00 / 100 |" in text


@pytest.mark.parametrize(("doc", "headline"), [
    ({"verdict": "pass", "verdict_reason": "`engine` 102 requests, 0 errors, RSS +0.0 MB (+0.0%)", "reason": None},
     "`engine` 102 requests, 0 errors, RSS +0.0 MB (+0.0%)"),
    ({"verdict": "fail", "verdict_reason": "`leaky` 25 requests, 0 errors", "reason": "leaky: memory grew +238.1 MB"},
     "leaky: memory grew +238.1 MB"),
])
def test_the_soak_gates_headline_is_its_figures_or_why_it_fails(doc, headline, tmp_path):
    assert summary.gate_figure(gates.BY_NAME["soak"], doc, tmp_path) == headline
