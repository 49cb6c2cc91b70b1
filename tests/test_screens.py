"""Kernel A/B screens from the user's code (`screens:`, workflow/plan/screens.py, the contract in kernels/overlap.py): the
campaign check before any work, the contract checked on the factory's return, the same bitwise check and outputs as
the built-in screen, the gate failing on any screen's mismatch, the index and SUMMARY section, the evidence id
following the user's code; and, through Snakemake, a campaign whose own screen is broken failing after sealing."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinyev
import torch
import yaml
from campaigns import rejected
from test_overlap import C4, seal_and_gate
from test_overlap import write_config as overlap_config

from evident.kernels.overlap import Screen, ScreenError, checked
from evident.workflow import tracking
from evident.workflow.archive import archive, summary
from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.plan import screens
from evident.workflow.plan.campaign import evidence_config, validate_campaign
from evident.workflow.stages import overlap as ov

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
CUDA = torch.cuda.is_available()
GOOD = {"name": "doubling", "module": "tests.userscreens:doubling"}
BROKEN = {"name": "broken", "module": "tests.userscreens:perturbed"}


def write_config(ev: Path, own: list[dict], **overlap) -> dict:
    """The default campaign (no built-in shapes unless `overlap` states them) with these screens of its own, on
    `auto`: the CPU here, CUDA graphs and timing on a GPU machine."""
    return overlap_config(ev, "auto", own, **{"inputs": 3, "trials": 4, "warmup": 1, **overlap})


@pytest.fixture(autouse=True)
def at_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the campaign's working directory: `tests.userscreens` imports from here
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before - {"tests", "tests.userscreens"}:  # a user's module written by a test
        if name.split(".")[0] in ("mine", "needs", "fails", "pkg"):
            del sys.modules[name]


# --- the campaign check, before any work --------------------------------------------------------

def base(**over) -> dict:
    return {"campaign": "mini", "checkpoint": {"base": "tiny"}, "cases": [{"name": "hello", "prompt": "Hello"}], **over}


def test_the_check_imports_each_factory_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def screen(device):\n    return None\n\nNUMBER = 3\n"
                                      "def two(device, size):\n    return None\n")
    (tmp_path / "needs.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "fails.py").write_text("raise RuntimeError('bad import')\n")
    monkeypatch.chdir(tmp_path)
    cfg = base(screens=[{"name": "mine", "module": "mine:screen"}])
    validate_campaign(cfg, str(REPO / "config/schema.yaml"))  # imports and binds factory("cpu")
    assert str(tmp_path) not in sys.path  # put back after the import
    msg = rejected(base(screens=[
        {"name": "a", "module": "nope.deeper:screen"}, {"name": "b", "module": "mine:missing"},
        {"name": "c", "module": "mine:NUMBER"}, {"name": "d", "module": "mine:two"},
        {"name": "e", "module": "needs:f"}, {"name": "f", "module": "fails:f"}]))
    assert "at `screens.0.module`: no module `nope.deeper` in the campaign's working directory or on PYTHONPATH" in msg
    assert "at `screens.1.module`: module `mine` has no `missing`" in msg
    assert "at `screens.2.module`: `mine:NUMBER` is a int, not callable" in msg
    assert "at `screens.3.module`: `mine:two(device, size)` cannot be called as factory(device)" in msg
    assert "at `screens.4.module`: importing `needs` failed: No module named 'not_installed_anywhere'" in msg
    assert "at `screens.5.module`: importing `fails` raised RuntimeError: bad import" in msg
    assert "6 errors" in msg


def test_the_check_refuses_bad_names_and_keys():
    msg = rejected(base(screens=[GOOD, {**GOOD, "module": "tests.userscreens:plain"},
                                 {"name": "c4", "module": GOOD["module"]}]))
    assert "at `screens.1.name`: `doubling` names screens.0 too; names are unique" in msg
    assert "at `screens.2.name`: `c4` is the built-in screen's name; pick another" in msg
    assert "`screens.0.name`" not in msg
    msg = rejected(base(screens=[{"name": "Bad_Name", "module": "a.b"}]))
    assert "screens.0.name" in msg and "screens.0.module" in msg
    assert "at `screens.0`: 'options' was unexpected; the keys here: name, module" in rejected(
        base(screens=[{**GOOD, "options": 1}]))
    msg = rejected(base(stages=["parity"], screens=[GOOD]))
    assert "at `screens`: the screens run in the overlap stage, which `stages` leaves out" in msg


def test_the_evidence_id_follows_the_users_code(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/kernel.py").write_text("SCALE = 2\n")
    (tmp_path / "pkg/screen.py").write_text("def screen(device):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    cfg = base(screens=[{"name": "mine", "module": "pkg.screen:screen"}])
    validate_campaign(cfg, str(REPO / "config/schema.yaml"))
    first = evidence_config(cfg)["screens"][0]
    assert first["name"] == "mine" and len(first["source_sha256"]) == 64
    assert evidence_config(cfg) == evidence_config(copy.deepcopy(cfg))
    (tmp_path / "pkg/kernel.py").write_text("SCALE = 3\n")  # the kernel beside the factory, not its module
    assert evidence_config(cfg)["screens"][0]["source_sha256"] != first["source_sha256"]


# --- the contract, on the factory's return ---------------------------------------------------------

def test_the_return_is_checked_with_the_fix_named():
    import tests.userscreens as u

    assert checked(u.doubling("cpu"), "s").streams == 1
    plain = checked(u.plain("cpu"), "s")  # the tuple form
    assert isinstance(plain, Screen) and plain.streams == 0 and plain.names is None
    cases = [({"draw": None}, "the factory returned dict; return kernels.overlap.Screen"),
             ((1, 2), "the factory returned tuple of 2 items"),
             ((u.plain, 3, u.plain), "a must be callable"),
             (Screen(u.plain, u.plain, u.plain, streams=-1), "streams is -1"),
             (Screen(u.plain, u.plain, u.plain, names="ab"), "names is 'ab'"),
             (Screen(u.plain, u.plain, u.plain, variants={"C": "x"}), "variants is {'C': 'x'}")]
    for made, message in cases:
        with pytest.raises(ScreenError, match="^screen `x`: " + message.replace("(", r"\(").replace("[", r"\[")):
            checked(made, "screen `x`")


@pytest.mark.parametrize("factory, message", [
    ("wrong_return", "the factory returned dict"),
    ("different_outputs", r"A returns \[float32\[8, 32\], float32\[8\]\] but B returns \[float32\[8, 32\]\]"),
    ("raises", r"factory\('(cpu|cuda)'\) raised RuntimeError: no weights here"),
])
def test_a_broken_factory_fails_the_stage_before_any_screen_is_measured(tmp_path, factory, message):
    ev = tmp_path / "ev"
    write_config(ev, [GOOD, {"name": "bad", "module": f"tests.userscreens:{factory}"}], **C4)
    with pytest.raises(SystemExit, match=rf"\[overlap\] error: screen `bad` \(tests.userscreens:{factory}\): {message}"):
        ov.main(["--evidence", str(ev)])
    assert not (ev / "overlap").exists() and not (ev / "plots").exists()  # nothing measured, nothing half-written
    rec = read_json(ev / "stages/overlap.json")
    assert rec["status"] == "failed" and "screen `bad`" in rec["error"]


# --- the stage: every screen as the built-in ------------------------------------------------------

@pytest.fixture(scope="module")
def correct_run(tmp_path_factory):
    """Two screens of the campaign's own, correct, beside a built-in screen without shapes (skipped)."""
    ev = tmp_path_factory.mktemp("good") / "ev"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        write_config(ev, [GOOD, {"name": "plain", "module": "tests.userscreens:plain"}])
        ov.run(ev)
    finally:
        os.chdir(cwd)
    return ev


def test_own_screens_get_the_built_ins_check_and_outputs(correct_run):
    ev = correct_run
    s = read_json(ev / "overlap/doubling/screen.json")
    assert s["name"] == "doubling" and s["factory"] == GOOD["module"] and s["skipped"] is None and s["streams"] == 1
    assert s["device"] == ("cuda" if CUDA else "cpu") and s["shapes"] is None
    assert s["variants"]["B"] == "x + x on a side stream beside the row sums" and "packing" in s["variants"]["consumer"]
    bw = s["bitwise"]
    assert bw["inputs"] == 3 and bw["all_outputs_equal"] == 3 and bw["per_output_equal"] == {"doubled": 3, "row_sum": 3}
    assert bw["outputs"] == [{"name": "doubled", "dtype": "float32", "shape": [8, 32]},
                             {"name": "row_sum", "dtype": "float32", "shape": [8]}]
    lines = (ev / "overlap/doubling/timings.csv").read_text().splitlines()
    if CUDA:
        assert bw["graph_equal_eager"] == 3 and s["timing"]["measured"] and len(lines) == 1 + 2 * 2 * 4
        assert s["verdict"] in ("b_faster", "no_claim", "b_slower")
    else:  # as the built-in: timing not measured, with the reason
        assert s["timing"] == {"measured": False, "reason": ov.EAGER, "envelopes": None}
        assert s["verdict"] == "not_measured" and lines == [ov.CSV_HEADER.strip()]
    assert (ev / "plots/overlap-doubling.png").read_bytes().startswith(PNG)
    plain = read_json(ev / "overlap/plain/screen.json")
    assert plain["bitwise"]["per_output_equal"] == {"output0": 3} and plain["streams"] == 0
    assert plain["variants"]["A"] == "variant A of tests.userscreens:plain"
    builtin = read_json(ev / "overlap/screen.json")  # the built-in, without shapes, as before
    assert builtin["name"] == "c4" and builtin["skipped"] == ov.SKIP_REASON


def test_the_index_record_and_gate_cover_every_screen(correct_run, tmp_path):
    ev = correct_run
    index = read_json(ev / layout.SCREENS)
    assert [(e["name"], e["factory"], e["skipped"]) for e in index["screens"]] == [
        ("c4", "evident.kernels.overlap:c4_screen", ov.SKIP_REASON), ("doubling", GOOD["module"], None),
        ("plain", "tests.userscreens:plain", None)]
    assert index["screens"][1]["files"] == {"screen": "overlap/doubling/screen.json",
                                            "timings": "overlap/doubling/timings.csv",
                                            "plot": "plots/overlap-doubling.png"}
    verdict = "not_measured" if not CUDA else index["verdict"]
    assert index["verdict"] == verdict != "bitwise_mismatch"
    rec = read_json(ev / "stages/overlap.json")
    assert rec["status"] == "ok" and rec["tags"] == {"overlap.verdict": index["verdict"]}  # screened: not skipped
    assert rec["params"]["screens"] == "doubling,plain"
    assert {"doubling.bitwise_equal": 3, "plain.bitwise_inputs": 3} .items() <= rec["metrics"].items()
    assert "bitwise_equal" not in rec["metrics"]  # the built-in did not run
    assert {"overlap/doubling/screen.json", "plots/overlap-plain.png", layout.SCREENS} <= set(rec["files"])
    assert seal_and_gate(ev, tmp_path / "gate.json") == index["verdict"]
    assert archive.load(ev).gates["overlap"] == index["verdict"]  # read from the index, not the built-in's file


def test_summary_lists_each_screen(correct_run):
    text = "\n".join(summary.overlap_section(correct_run))
    assert text.startswith("### Overlap A/B screens: **`")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`c4`", "`doubling`", "`plain`"]
    assert [r.split("|")[3].strip() for r in rows] == ["—", "3/3", "3/3"]
    assert "\n#### Overlap A/B screen (skipped)" in text
    assert ("\n#### Overlap A/B screen `doubling` (`tests.userscreens:doubling`; outputs doubled float32[8, 32], "
            "row_sum float32[8])") in text
    # a screen's plot only where it timed something (a CUDA device); a skipped screen's never
    timed = read_json(correct_run / screens.files("plain")["screen"])["timing"]["measured"]
    assert ("![overlap A/B timings](plots/overlap-plain.png)" in text) == timed
    assert f"]({screens.files(screens.BUILTIN)['plot']})" not in text


def test_a_perturbed_b_in_any_screen_fails_the_gate(tmp_path):
    """The built-in screen (C4 shapes, equal) beside a correct and a perturbed screen of the campaign's own: only the
    perturbed one mismatches, and that fails the stage's verdict and the gate."""
    ev = tmp_path / "ev"
    write_config(ev, [GOOD, BROKEN], inputs=2, **C4)
    builtin = ov.run(ev)
    assert builtin["verdict"] != "bitwise_mismatch" and builtin["bitwise"]["all_outputs_equal"] == 2
    s = read_json(ev / "overlap/broken/screen.json")
    assert s["verdict"] == "bitwise_mismatch" and s["bitwise"]["per_output_equal"] == {"doubled": 0, "row_sum": 2}
    assert s["bitwise"]["first_mismatch"]["outputs"]["doubled"]["elements_differ"] == 1
    index = read_json(ev / layout.SCREENS)
    assert [e["verdict"] == "bitwise_mismatch" for e in index["screens"]] == [False, False, True]
    assert index["verdict"] == "bitwise_mismatch"
    assert index["reason"] == "`broken` bitwise_mismatch: 2 of 2 input sets gave outputs of A and B that differ"
    assert read_json(ev / "stages/overlap.json")["tags"]["overlap.verdict"] == "bitwise_mismatch"
    with pytest.raises(SystemExit, match=r"overlap A/B screens .*says bitwise_mismatch \(`broken` .*\); see overlap/screens.json"):
        seal_and_gate(ev, tmp_path / "gate.json")
    gate_record = read_json(tmp_path / "gate.json")  # a failing run's record too, with why it failed
    assert gate_record["passed"] is False and gate_record["verdicts"]["overlap"] == "bitwise_mismatch"


# --- the stage's verdict over its screens (pure) --------------------------------------------------

def entry(name: str, verdict: str) -> dict:
    return {"name": name, "verdict": verdict, "verdict_reason": f"{name} says so"}


def test_stage_verdict():
    assert ov.stage_verdict([entry("c4", "b_faster")]) == ("b_faster", "c4 says so")  # alone: its own, as before
    assert ov.stage_verdict([entry("c4", "b_faster"), entry("a", "bitwise_mismatch"), entry("b", "bitwise_mismatch")]) == (
        "bitwise_mismatch", "`a` bitwise_mismatch: a says so; `b` bitwise_mismatch: b says so")
    assert ov.stage_verdict([entry("c4", "not_measured"), entry("a", "b_faster")]) == (
        "b_faster", "`a` b_faster: a says so")  # a skipped built-in claims nothing
    assert ov.stage_verdict([entry("c4", "b_faster"), entry("a", "b_slower")])[0] == "no_claim"
    assert ov.stage_verdict([entry("c4", "not_measured"), entry("a", "not_measured")])[0] == "not_measured"


def test_headline_names_each_screens_ratios():
    metrics, _ = tracking.headline(Path("."), [{"name": "overlap", "status": "ok", "metrics": {
        "warm_b_over_a": 0.9, "doubling.warm_b_over_a": 1.2, "doubling.bitwise_equal": 3}}], {})
    assert metrics == {"overlap.warm.b_over_a": 0.9, "overlap.doubling.warm.b_over_a": 1.2}


# --- end to end ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_campaigns_broken_screen_fails_the_run_after_sealing(tmp_path):
    """Through Snakemake: the overlap stage only, the user's module in the campaign's working directory; the
    broken screen's evidence is sealed and listed, and the gate fails the run."""
    (tmp_path / "myscreens.py").write_text((REPO / "tests/userscreens.py").read_text())
    cfg = {"campaign": "screens", "device": "cpu", "checkpoint": tinyev.synthetic(), "stages": ["overlap"],
           "cases": [{"name": "greeting", "prompt": "Hello, evident!", "max_new_tokens": 4}],
           "overlap": {"inputs": 2}, "tracking": {"enabled": False},
           "screens": [{"name": "doubling", "module": "myscreens:doubling"},
                       {"name": "broken", "module": "myscreens:perturbed"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # as a module: a GPU machine's packages may be installed with no console script (tools/device_tests.sh)
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"),
                        "-d", str(tmp_path), "-c2", "--configfile", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode != 0 and "says bitwise_mismatch (`broken`" in r.stdout + r.stderr, \
        r.stdout[-3000:] + r.stderr[-3000:]
    (ev,) = (tmp_path / "evidence/screens").iterdir()
    manifest = read_json(ev / "MANIFEST.json")
    assert manifest["gates"]["overlap"] == "bitwise_mismatch" and manifest["stages"]["overlap"] == "ok"
    # the gate's record outlives the failed job (its output is a marker a pass alone writes)
    record = read_json(tmp_path / f".evident/gates/screens/{ev.name}.json")
    assert record["passed"] is False and "says bitwise_mismatch (`broken`" in record["failed"][0]
    assert not (tmp_path / f".evident/logs/screens/{ev.name}/gate.passed").exists()
    for rel in ("overlap/screens.json", "overlap/screen.json", "overlap/doubling/screen.json",
                "overlap/broken/timings.csv", "plots/overlap-broken.png"):
        assert rel in manifest["files"], rel
    recorded = yaml.safe_load((ev / "config.yaml").read_text())["screens"]
    assert [len(e["source_sha256"]) for e in recorded] == [64, 64]
    assert read_json(ev / "overlap/broken/screen.json")["source_sha256"] == recorded[1]["source_sha256"]
    text = (ev / summary.SUMMARY).read_text()
    assert "| overlap | `bitwise_mismatch` | **fails the run** |" in text and "`broken` `bitwise_mismatch`" in text
    text = (ev / summary.DETAILS).read_text()
    assert "### Overlap A/B screens: **`bitwise_mismatch`**" in text and "### Overlap A/B screen `broken`" in text
    assert "overlap-broken.png" in (tmp_path / f"evidence/_pages/screens/{ev.name}.html").read_text()
