"""The evidence archive (workflow/archive/archive.py) and the `evident` CLI (workflow/cli.py).

Fast tests use directories built by hand (tests/handbuilt.py); the slow ones use what the default campaign's
run wrote (the session's one local run, tests/cluster.py `default_local_run`, shared with test_pipeline.py and
test_cluster.py): its directory, the HTML archive that `rule all` builds, the MLflow store and `snakemake --report`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cluster
import handbuilt
import headless
import pytest

from evident.workflow import cli
from evident.workflow.archive import archive, diff
from evident.workflow.core import locks
from evident.workflow.core.evidence import FAILED, INTERRUPTED, Stage, write_json, write_manifest
from evident.workflow.core.layout import MANIFEST

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def evident(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> list[list[str]]:
    """Each line of the output split into words."""
    return [line.split() for line in out.splitlines()]


@pytest.fixture
def arch(tmp_path, monkeypatch):
    """An archive in a working directory, the way a user has it: ./evidence/<campaign>/<id>/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = Path("evidence")
    handbuilt.build(root, "tiny", "aaaaaaa-c11111111-r1", created="2026-01-01T00:00:00Z", plot=False)
    handbuilt.build(root, "tiny", "aaaaaaa-c22222222-r1", created="2026-01-02T00:00:00Z", plot=False,
                    verdict="near_tie_divergence")
    handbuilt.build(root, "gpu", "bbbbbbb-c33333333-r1", created="2026-01-03T00:00:00Z", plot=False)
    handbuilt.build(root, "tiny", "ccccccc-c44444444-r1", created="2026-01-04T00:00:00Z", plot=False, seal=False)
    return root


# --- resolving ids -------------------------------------------------------------------------

def test_resolve_abbreviated_ids(arch):
    assert archive.resolve("bbb", arch) == arch / "gpu/bbbbbbb-c33333333-r1"
    assert archive.resolve("aaaaaaa-c1", arch) == arch / "tiny/aaaaaaa-c11111111-r1"
    assert archive.resolve("tiny/aaaaaaa-c2", arch) == arch / "tiny/aaaaaaa-c22222222-r1"
    assert archive.resolve("evidence/tiny/aaaaaaa-c2", arch) == arch / "tiny/aaaaaaa-c22222222-r1"  # a path prefix
    assert archive.resolve("evidence/gpu/bbbbbbb-c33333333-r1", arch) == arch / "gpu/bbbbbbb-c33333333-r1"
    with pytest.raises(archive.NotFound) as e:
        archive.resolve("aaa", arch)
    assert str(e.value) == ("'aaa' matches 2 directories under evidence/; give more of one id (or CAMPAIGN/ID):\n"
                            "  tiny  aaaaaaa-c22222222-r1  2026-01-02 00:00:00Z\n"
                            "  tiny  aaaaaaa-c11111111-r1  2026-01-01 00:00:00Z")
    with pytest.raises(archive.NotFound) as e:
        archive.resolve("tiny/bbb", arch)
    assert str(e.value) == ("no evidence directory matches 'tiny/bbb' under evidence/tiny/; "
                            "`evident ls --campaign tiny` lists them")
    with pytest.raises(archive.NotFound, match="not sealed"):
        archive.resolve("ccc", arch, sealed=True)
    with pytest.raises(archive.NotFound, match="no evidence directory matches ''"):
        archive.resolve("", arch)


def test_an_exact_id_wins_over_longer_ids_it_prefixes(arch):
    handbuilt.build(arch, "tiny", "aaaaaaa-c11111111-r10", plot=False)
    assert archive.resolve("aaaaaaa-c11111111-r1", arch).name == "aaaaaaa-c11111111-r1"
    assert archive.resolve("aaaaaaa-c11111111-r10", arch).name == "aaaaaaa-c11111111-r10"


def test_bench_baseline_uses_the_archive_rules(arch):
    from evident.workflow.stages.bench_report import resolve_baseline

    current = arch / "tiny/aaaaaaa-c22222222-r1"
    assert resolve_baseline("aaa", current) == arch / "tiny/aaaaaaa-c11111111-r1"  # itself is excluded
    with pytest.raises(FileNotFoundError, match="bench.baseline: no evidence directory matches 'bbb'"):
        resolve_baseline("bbb", current)  # other campaigns are not searched
    assert resolve_baseline("c1111", current) == arch / "tiny/aaaaaaa-c11111111-r1"  # any part of an id
    # "-r1" is also in the unsealed ccccccc-...: a baseline must be sealed, so the one sealed match is taken
    assert resolve_baseline("-r1", current) == arch / "tiny/aaaaaaa-c11111111-r1"
    assert resolve_baseline("@latest", current) == arch / "tiny/aaaaaaa-c11111111-r1"  # this campaign, not itself
    with pytest.raises(FileNotFoundError, match="bench.baseline: 'tiny@latest~1': campaign tiny has 1 sealed "
                                                "directory other than this one under evidence/$"):
        resolve_baseline("tiny@latest~1", current)
    with pytest.raises(FileNotFoundError, match="bench.baseline: .*ccccccc-c44444444-r1 is not sealed"):
        resolve_baseline("c4444", current)



def test_any_part_of_an_id_addresses_it(arch, capsys):
    """Every id of one commit starts alike: the config hash (or any other unique part) is enough."""
    assert archive.resolve("c2222", arch) == arch / "tiny/aaaaaaa-c22222222-r1"
    assert archive.resolve("33333", arch) == arch / "gpu/bbbbbbb-c33333333-r1"  # across campaigns
    assert archive.resolve("tiny/c1", arch) == arch / "tiny/aaaaaaa-c11111111-r1"
    assert archive.resolve("evidence/tiny/c2", arch) == arch / "tiny/aaaaaaa-c22222222-r1"
    code, out, err = evident(capsys, "show", "c2222")
    assert code == 0 and err == "" and "tiny/aaaaaaa-c22222222-r1" in out
    assert ["parity", "near_tie_divergence", "pass"] in rows(out)
    code, out, _ = evident(capsys, "verify", "c1111", "3333")
    assert (code, out) == (0, "ok    tiny/aaaaaaa-c11111111-r1\nok    gpu/bbbbbbb-c33333333-r1\n")


def test_an_ambiguous_reference_lists_its_candidates(arch, capsys):
    code, out, err = evident(capsys, "show", "r1")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == "evident: 'r1' matches 4 directories under evidence/; give more of one id (or CAMPAIGN/ID):"
    assert lines[1].split()[:2] == ["tiny", "ccccccc-c44444444-r1"] and lines[1].endswith("  unsealed")  # newest
    assert lines[2:] == ["  gpu   bbbbbbb-c33333333-r1  2026-01-03 00:00:00Z",
                         "  tiny  aaaaaaa-c22222222-r1  2026-01-02 00:00:00Z",
                         "  tiny  aaaaaaa-c11111111-r1  2026-01-01 00:00:00Z"]
    # one exact id in two campaigns: ambiguous too, until the campaign is named
    handbuilt.build(arch, "gpu", "aaaaaaa-c11111111-r1", created="2026-01-05T00:00:00Z", plot=False)
    code, out, err = evident(capsys, "verify", "aaaaaaa-c11111111-r1")
    assert code == 2 and out == "" and "matches 2 directories" in err
    assert "  gpu   aaaaaaa-c11111111-r1  2026-01-05 00:00:00Z\n" in err
    assert evident(capsys, "verify", "gpu/aaaaaaa-c11111111-r1")[:2] == (0, "ok    gpu/aaaaaaa-c11111111-r1\n")
    # diff and sync resolve both/every id before doing anything
    code, out, err = evident(capsys, "diff", "c1111", "c2222")
    assert code == 2 and out == "" and "'c1111' matches 2 directories" in err
    code, out, err = evident(capsys, "sync", "aaa", "--tracking-uri", "sqlite:///mlflow.db")
    assert code == 2 and out == "" and "'aaa' matches 3 directories" in err
    assert not Path("mlflow.db").exists() and not Path(".evident/tracking").exists()


def test_an_unknown_reference_says_so_and_points_to_ls(arch, capsys):
    code, out, err = evident(capsys, "diff", "c1111", "nope")
    assert (code, out) == (2, "")
    assert err == "evident: no evidence directory matches 'nope' under evidence/; `evident ls` lists them\n"
    code, out, err = evident(capsys, "verify", "gpu/c1111")
    assert (code, out) == (2, "")
    assert err == ("evident: no evidence directory matches 'gpu/c1111' under evidence/gpu/; "
                   "`evident ls --campaign gpu` lists them\n")


def test_latest_is_the_newest_sealed_directory_by_creation_time(arch, capsys):
    # newest by its manifest's created_utc, not by its name; the unsealed ccccccc-... (newer still) never counts
    handbuilt.build(arch, "tiny", "0000000-c55555555-r1", created="2026-01-05T00:00:00Z", plot=False)
    tiny = arch / "tiny"
    assert archive.resolve("tiny@latest", arch) == tiny / "0000000-c55555555-r1"
    assert archive.resolve("tiny@latest~0", arch) == tiny / "0000000-c55555555-r1"
    assert archive.resolve("tiny@latest~1", arch) == tiny / "aaaaaaa-c22222222-r1"
    assert archive.resolve("tiny@latest~", arch) == tiny / "aaaaaaa-c22222222-r1"  # ~ alone: one before
    assert archive.resolve("tiny@latest~2", arch) == tiny / "aaaaaaa-c11111111-r1"
    assert archive.resolve("gpu@latest", arch) == arch / "gpu/bbbbbbb-c33333333-r1"
    assert archive.resolve("@latest", arch) == tiny / "0000000-c55555555-r1"  # over all campaigns
    assert archive.resolve("@latest~1", arch) == arch / "gpu/bbbbbbb-c33333333-r1"
    code, out, _ = evident(capsys, "diff", "tiny@latest~1", "tiny@latest")
    assert code == 0
    assert out.startswith("A (baseline): tiny/aaaaaaa-c22222222-r1\nB (current):  tiny/0000000-c55555555-r1\n")
    code, out, _ = evident(capsys, "verify", "@latest", "gpu@latest")
    assert (code, out) == (0, "ok    tiny/0000000-c55555555-r1\nok    gpu/bbbbbbb-c33333333-r1\n")

    for ref, message in (
            ("tiny@latest~3", "'tiny@latest~3': campaign tiny has 3 sealed directories under evidence/ "
                              "(tiny@latest~2 is the oldest)"),
            ("gpu@latest~1", "'gpu@latest~1': campaign gpu has 1 sealed directory under evidence/"),
            ("nope@latest", "'nope@latest': no campaign 'nope' under evidence/; `evident ls` lists them"),
            ("tiny@newest", "'tiny@newest': a reference with @ is CAMPAIGN@latest or CAMPAIGN@latest~N (the newest "
                            "sealed directory of CAMPAIGN, or the N-th before it)")):
        code, out, err = evident(capsys, "show", ref)
        assert (code, out, err) == (2, "", f"evident: {message}\n"), ref


# --- ls, show --------------------------------------------------------------------------------

def test_ls_lists_newest_first_with_each_verdict(arch, capsys):
    code, out, _ = evident(capsys, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["campaign", "id", "created", "(UTC)", "device", "gates", "mlflow", "status"]
    ids = [line.split()[1] for line in lines[2:]]
    assert ids == ["ccccccc-c44444444-r1", "bbbbbbb-c33333333-r1", "aaaaaaa-c22222222-r1", "aaaaaaa-c11111111-r1"]
    assert lines[4].split()[2:] == ["2026-01-02", "00:00", "cpu", "pass", "pending", "sealed"]
    assert lines[2].split()[-2:] == ["—", "interrupted"]  # its stage records give its date: it is the newest
    code, out, _ = evident(capsys, "ls", "--campaign", "gpu")
    assert code == 0 and "bbbbbbb" in out and "aaaaaaa" not in out
    assert out.splitlines()[0] == lines[0]  # the same columns, whatever is listed
    code, _, err = evident(capsys, "ls", "--campaign", "nope")
    assert code == 2 and "no campaign 'nope' under evidence/" in err


def test_show_prints_the_summary_and_errors_name_what_was_not_found(arch, capsys):
    code, out, _ = evident(capsys, "show", "aaaaaaa-c2")
    assert code == 0
    assert out.startswith("tiny/aaaaaaa-c22222222-r1: sealed\n")
    assert ["parity", "near_tie_divergence", "pass"] in rows(out) and ["audit", "—", "—"] in rows(out)
    assert ["parity.cells", "1"] in rows(out) and ["single-b1", "10", "100.0", "no"] in rows(out)
    assert ["bench_report", "ok"] in [r[:2] for r in rows(out)]
    assert ["report", "SUMMARY.md", "there,"] in [r[:3] for r in rows(out)] and "###" not in out
    code, out, _ = evident(capsys, "show", "aaaaaaa-c2", "--markdown")
    assert code == 0 and out.startswith("## Evidence: `tiny` / `aaaaaaa-c22222222-r1`") and "### Claim boundary" in out
    code, out, err = evident(capsys, "show", "nope")
    assert code == 2 and out == ""
    assert err.strip() == "evident: no evidence directory matches 'nope' under evidence/; `evident ls` lists them"
    code, _, err = evident(capsys, "show", "aaa")
    assert code == 2 and "matches 2 directories" in err
    code, out, _ = evident(capsys, "show", "ccc")
    assert code == 0 and out.startswith("tiny/ccccccc-c44444444-r1: interrupted\n")
    (arch / "tiny/ccccccc-c44444444-r1/SUMMARY.md").unlink()  # stopped before seal wrote it
    code, out, err = evident(capsys, "show", "ccc", "--markdown")
    assert (code, out) == (2, "") and "has no SUMMARY.md: it is interrupted, not sealed" in err


def test_ls_tells_a_running_run_from_a_stopped_one(arch, capsys):
    """Unsealed is running while a snakemake holds the directory's lock (workflow/core/locks.py; the kernel drops it with
    its process), else interrupted, or failed where a stage failed."""
    ev = arch / "tiny/ccccccc-c44444444-r1"
    lock = archive.lock_of(ev)
    assert lock == Path(".evident/locks/tiny/ccccccc-c44444444-r1.lock")

    def status() -> str:
        code, out, _ = evident(capsys, "ls", "--campaign", "tiny")
        return next(line.split()[-1] for line in out.splitlines() if ev.name in line)

    held = locks.take(lock)
    try:
        assert status() == archive.RUNNING
    finally:
        locks.let_go(held, lock)
    assert status() == INTERRUPTED
    lock.parent.mkdir(parents=True)
    lock.write_text("pid 1, since ...\n")  # a killed run's file, no longer held
    assert status() == INTERRUPTED
    with pytest.raises(KeyboardInterrupt), Stage(ev, "quality"):
        raise KeyboardInterrupt
    assert archive.load(ev).state == "interrupted; interrupted: quality"
    with pytest.raises(RuntimeError), Stage(ev, "profile"):
        raise RuntimeError("boom")
    assert status() == FAILED and archive.load(ev).state == "failed; failed: profile; interrupted: quality"


def test_ls_show_and_diff_fit_100_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    camp, eid = "a-campaign-with-a-rather-long-name", "aaaaaaa-dirty12345678-c11111111-r1"
    a = handbuilt.build(root, camp, eid, plot=False, cells=[handbuilt.cell(batch=b) for b in (1, 4, 8)])
    write_json(a / "env.json", {"device": "cuda", "gpus": ["NVIDIA H100 80GB HBM3"] * 8})
    b = handbuilt.build(root, camp, eid.replace("r1", "r2"), plot=False, verdict="engine_accuracy_gap", seal=False,
                        cells=[handbuilt.cell(batch=bs, tpot=8.0, spread=0.1) for bs in (1, 4, 8)])
    with pytest.raises(ValueError), Stage(b, "quality"):
        raise ValueError("a long error message " * 10)
    for args in (["ls"], ["show", "r1"], ["show", "r2"], ["diff", "r1", "r2"], ["diff", "r1", "r2", "--metrics"]):
        code, out, _ = evident(capsys, *args)
        assert code == 0 and max(map(len, out.splitlines())) <= 100, (args, out)
    code, out, _ = evident(capsys, "ls")
    words = rows(out)  # the long campaign gives way, never the id
    assert eid.replace("r1", "r2") in words[2] and words[2][-2:] == ["—", "failed"] and "FAIL" in words[2]
    assert next(w for w in words if eid in w)[-4:] == ["GPUs", "pass", "pending", "sealed"]
    code, out, _ = evident(capsys, "diff", "r1", "r2")
    assert ["single-b4", "10", "8.8", "0.880", "B"] in [r[:5] for r in rows(out)]  # B's cell is noisy


# --- verify ----------------------------------------------------------------------------------

def test_verify_reports_changed_missing_and_extra_files(arch, capsys):
    assert evident(capsys, "verify", "--all")[:2] == (0, "ok    gpu/bbbbbbb-c33333333-r1\nok    tiny/aaaaaaa-c11111111-r1\n"
                                                     "ok    tiny/aaaaaaa-c22222222-r1\nskip  tiny/ccccccc-c44444444-r1: not sealed\n")
    ev = arch / "tiny/aaaaaaa-c11111111-r1"
    data = bytearray((ev / "bench/summary.csv").read_bytes())
    data[5] ^= 1  # one flipped bit, same size
    (ev / "bench/summary.csv").write_bytes(bytes(data))
    code, out, _ = evident(capsys, "verify", "aaaaaaa-c1")
    assert code == 1 and out == "FAIL  tiny/aaaaaaa-c11111111-r1: changed bench/summary.csv\n"
    (ev / "parity/comparison.json").unlink()
    (ev / "notes.txt").write_text("added later\n")
    result = archive.verify(ev)
    assert result == {"missing": ["parity/comparison.json"], "extra": ["notes.txt"], "changed": ["bench/summary.csv"],
                      "problems": []}
    code, out, _ = evident(capsys, "verify", "--all")
    assert code == 1 and out.count("ok    ") == 2 and "missing parity/comparison.json" in out and "extra notes.txt" in out
    code, out, _ = evident(capsys, "verify", "ccc")
    assert code == 1 and "not sealed" in out
    code, _, err = evident(capsys, "verify")
    assert code == 2 and "--all" in err


def test_verify_reports_a_renamed_directory(arch):
    ev = arch / "gpu/bbbbbbb-c33333333-r1"
    moved = ev.rename(ev.with_name("bbbbbbb-c99999999-r1"))
    assert archive.verify(moved)["problems"] == ["directory renamed: the manifest names it bbbbbbb-c33333333-r1"]


# --- diff ------------------------------------------------------------------------------------

def test_diff_claims_only_where_the_bench_rule_allows(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    base = handbuilt.build(root, "tiny", "aaaaaaa-c1-r1", plot=False, cells=[
        handbuilt.cell(batch=1, tpot=10.0), handbuilt.cell(batch=4, tpot=10.0), handbuilt.cell(batch=8, tpot=10.0)])
    new = handbuilt.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, verdict="engine_accuracy_gap", cells=[
        handbuilt.cell(batch=1, tpot=8.0),                     # same contract, quiet: a claim
        handbuilt.cell(batch=4, tpot=8.0, new_tokens=6),       # another contract: no claim at all
        handbuilt.cell(batch=8, tpot=8.0, spread=0.1)])        # noisy: no claim
    d = diff.diff(archive.load(base), archive.load(new))
    bench = {c["batch"]: c for c in d["bench"]}
    assert bench[1]["claim"] == "faster" and bench[1]["tpot_p50_change_pct"] == pytest.approx(-20.0)
    assert bench[4]["claim"] == "no directional claim" and "contract differs (keys new_tokens)" in bench[4]["reason"]
    assert bench[4]["tpot_p50_change_pct"] is None  # no percentage between different experiments
    assert bench[8]["claim"] == "no directional claim" and "current cell noisy" in bench[8]["reason"]
    assert {"what": "gate parity", "a": "all_token_text_exact", "b": "engine_accuracy_gap"} in d["verdicts"]
    assert {"what": "parity single b1 greeting", "a": "all_token_text_exact", "b": "engine_accuracy_gap"} in d["verdicts"]
    assert {"metric": "bench-single.b1_tpot_p50_ms", "a": 10.0, "b": 8.0, "delta": -2.0,
            "delta_pct": pytest.approx(-20.0)} in d["metrics"]

    code, out, _ = evident(capsys, "diff", "aaa", "bbb")
    assert code == 0
    assert "nothing: same campaign, config, versions and checkpoint" in out
    row = next(line for line in out.splitlines() if line.startswith("single") and "faster" in line)
    assert row.split() == ["single-b1", "10", "8", "0.800", "faster"]  # cell, TPOT p50 A, B, B/A, claim
    code, out, _ = evident(capsys, "diff", "aaa", "bbb", "--json")
    assert code == 0 and json.loads(out)["bench"][0]["claim"] == "faster"


def test_diff_refuses_a_claim_across_versions_and_names_what_differs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    handbuilt.build(root, "tiny", "aaaaaaa-c1-r1", plot=False)
    newer = handbuilt.cell(tpot=5.0)
    newer["versions"]["torch"] = "2.14.0"
    handbuilt.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, cells=[newer], versions={"torch": "2.14.0"})
    code, out, _ = evident(capsys, "diff", "aaa", "bbb")
    assert code == 0
    assert "versions differ: torch 2.13.0+cpu vs 2.14.0" in out
    row = next(line for line in out.splitlines() if line.startswith("single"))
    assert row.split()[-4:] == ["no", "directional", "claim", "[1]"] and "faster" not in row
    assert "  [1] versions differ (torch)" in out.splitlines()  # the reason, as its footnote


def _long_cell(backend: str, batch: int, tpot: float, kernels: str = "graph", **kw) -> dict:
    c = handbuilt.cell(backend=backend, batch=batch, tpot=tpot, **kw)
    c["kernels"] = kernels
    return c


def _first_column(lines: list[str]) -> set[str]:
    """Each table row's first cell, its wrapped continuation lines (nothing in the other columns) joined again."""
    out: list[str] = []
    for line in lines:
        if line[:1] in ("", " ", "-") or not line.split():
            continue
        if len(line.split()) == 1 and out:
            out[-1] += line.strip()
        else:
            out.append(line.split()[0] if "  " not in line else line.split("  ")[0])
    return set(out)


def test_diff_fits_a_terminal_and_json_keeps_every_field(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    wide = "host-staged-over-a-transport-with-a-rather-long-name"  # longer than any real backend
    long_key = {f"contract_key_with_a_long_name_{i}": i for i in range(6)}  # a reason of ~280 characters
    torch = "2.14.0+cu130-with-a-long-local-version"
    other = _long_cell(wide, 1, 9.0, **long_key)
    other["versions"]["torch"] = torch
    base = handbuilt.build(root, "tiny", "aaaaaaa-c1-r1", plot=False, cells=[
        _long_cell("host-staged", 8, 10.0), _long_cell("host-staged", 64, 10.0), _long_cell(wide, 1, 10.0)])
    new = handbuilt.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, verdict="near_tie_divergence", cells=[
        _long_cell("host-staged", 8, 5.0),                               # quiet, same contract: faster
        _long_cell("host-staged", 64, 8.0, spread=0.1),                  # noisy
        other], versions={"torch": torch})
    stage = "a-stage-whose-name-goes-on-and-on-the-way-some-generated-stage-names-do"
    for ev, value in ((base, 1.0), (new, 2.0)):
        with Stage(ev, stage) as st:
            st.metrics[f"metric_{'with_a_very_long_name_' * 4}{value:g}"] = value  # one each: A only, B only
            st.metrics["shared_metric_" + "x" * 90] = value
            if ev == new:
                st.skip("skipped because " + "of a long reason " * 10)

    code, out, _ = evident(capsys, "diff", "aaa", "bbb")
    assert code == 0 and max(map(len, out.splitlines())) <= 100
    assert "Stage metrics: 7 of 8 differ" in out and "shared_metric_" not in out  # their table: --metrics
    code, out, _ = evident(capsys, "diff", "aaa", "bbb", "--metrics")
    assert code == 0
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, [line for line in lines if len(line) > 100]
    header = next(i for i, line in enumerate(lines) if line.startswith("cell ") and lines[i + 1].startswith("---"))
    assert lines[header].split() == ["cell", "A", "TPOT", "p50", "(ms)", "B", "B/A", "noisy", "claim"]
    assert lines[header + 2].split() == ["host-staged-graph-b8", "10", "5", "0.500", "faster"]
    assert lines[header + 3].split() == ["host-staged-graph-b64", "10", "8.8", "0.880", "B", "no", "directional",
                                         "claim", "[1]"]  # B's cell is the noisy one
    # the wide cell name wraps within its column; its row has no ratio (different contracts) and a footnote
    assert lines[header + 4].split()[1:] == ["10", "9", "—", "no", "directional", "claim", "[2]"]
    assert f"{wide}-graph-b1" in _first_column(lines)
    # the footnotes: every reason, whole (their wrapped lines joined again)
    d = diff.diff(archive.load(base), archive.load(new))
    reasons = {c["cell"]: c["reason"] for c in d["bench"]}
    notes = " ".join(line.strip() for line in lines[header + 6:lines.index("", header)])
    assert notes == f"[1] {reasons['host-staged-graph-b64']} [2] {reasons[wide + '-graph-b1']}"
    assert "current cell noisy" in notes and "contract_key_with_a_long_name_5" in notes
    # long metric and stage names wrap within their column, none is dropped
    names = _first_column(lines)
    for name in (f"{stage}.shared_metric_" + "x" * 90, f"{stage}.metric_{'with_a_very_long_name_' * 4}1",
                 f"{stage}.metric_{'with_a_very_long_name_' * 4}2", "bench-single.b8_tpot_p50_ms"):
        assert name in names
    assert f"stage {stage}" in names  # the verdict row of the stage skipped in B

    code, out, _ = evident(capsys, "diff", "aaa", "bbb", "--json")
    bench = {c["cell"]: c for c in json.loads(out)["bench"]}
    fast = bench["host-staged-graph-b8"]
    assert set(fast) == {"cell", "backend", "kernels", "prompts", "batch", "target", "concurrency", "rate", "a_tpot_p50_ms",
                         "b_tpot_p50_ms", "tpot_p50_ratio", "a_tok_s", "b_tok_s", "tok_s_ratio", "claim",
                         "tpot_p50_change_pct", "tok_s_change_pct", "reason", "probe_ratio"}
    assert (fast["backend"], fast["kernels"], fast["batch"], fast["target"]) == ("host-staged", "graph", 8, None)
    assert fast["tpot_p50_ratio"] == pytest.approx(0.5) and fast["tok_s_ratio"] == pytest.approx(2.0)
    assert fast["a_tok_s"] and fast["b_tok_s"] == pytest.approx(2 * fast["a_tok_s"]) and fast["reason"] is None
    assert bench[wide + "-graph-b1"]["reason"] == reasons[wide + "-graph-b1"] and "versions differ (torch)" in notes
    assert bench[wide + "-graph-b1"]["tpot_p50_ratio"] is None  # no ratio between different experiments


def test_diff_keeps_decode_paths_apart(tmp_path, capsys, monkeypatch):
    """single-b1 and single-graph-b1 are different cells: before, both keyed (single, 1), one replaced the other
    in a directory and a torch cell of A was compared with a graph cell of B."""
    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    base = handbuilt.build(root, "tiny", "aaaaaaa-c1-r1", plot=False, cells=[_long_cell("single", 1, 10.0, "torch")])
    write_json(base / "bench/single-graph-b1.json", _long_cell("single", 1, 4.0))
    new = handbuilt.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, cells=[_long_cell("single", 1, 8.0, "torch")])
    write_json(new / "bench/single-graph-b1.json", _long_cell("single", 1, 2.0))
    d = diff.diff(archive.load(base), archive.load(new))
    rows = {c["cell"]: c for c in d["bench"]}
    assert list(rows) == ["single-b1", "single-graph-b1"]
    assert rows["single-b1"]["tpot_p50_ratio"] == pytest.approx(0.8) and rows["single-b1"]["kernels"] == "torch"
    assert rows["single-graph-b1"]["tpot_p50_ratio"] == pytest.approx(0.5)
    assert rows["single-graph-b1"]["kernels"] == "graph" and rows["single-graph-b1"]["claim"] == "faster"
    code, out, _ = evident(capsys, "diff", "aaa", "bbb")
    assert [line.split()[:4] for line in out.splitlines() if line.startswith("single")] == [
        ["single-b1", "10", "8", "0.800"], ["single-graph-b1", "4", "2", "0.500"]]

    # a torch cell in A and a graph cell in B at the same backend and batch: two rows, no comparison
    (new / "bench/single-b1.json").unlink()
    (base / "bench/single-graph-b1.json").unlink()
    rows = {c["cell"]: c for c in diff.bench_diff(archive.load(base), archive.load(new))}
    assert {k: (v["claim"], v["reason"], v["tpot_p50_ratio"]) for k, v in rows.items()} == {
        "single-b1": ("no directional claim", "only in A", None),
        "single-graph-b1": ("no directional claim", "only in B", None)}

    # two files of one cell (a stray copy): reported, not one silently chosen
    write_json(new / "bench/copy-of-single-graph-b1.json", _long_cell("single", 1, 3.0))
    row = next(c for c in diff.bench_diff(archive.load(base), archive.load(new)) if c["cell"] == "single-graph-b1")
    assert row["claim"] == "no directional claim" and row["reason"] == (
        "B has 2 files for this cell (copy-of-single-graph-b1.json, single-graph-b1.json)")


def test_diff_shows_rate_cells_figure_by_figure_and_never_claims(tmp_path, capsys, monkeypatch):
    """The rate rung runs each rate once: no noise estimate, so B twice as fast is still no claim, but both figures
    and B/A are there; a changed seed and SLO name themselves and give no ratio; a cell in one side only says so."""
    import rated

    monkeypatch.chdir(tmp_path)
    root = Path("evidence")
    base = handbuilt.build(root, "tiny", "aaaaaaa-c1-r1", plot=False, seal=False)
    rated.write(base, rates=[rated.rate_cell(rate=2, tpot=5.0), rated.rate_cell(rate=4, tpot=5.0),
                             rated.rate_cell(rate=8)])
    new = handbuilt.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, seal=False)
    rated.write(new, rates=[rated.rate_cell(rate=2, tpot=2.5, ttft=10.0, failed=1),
                            rated.rate_cell(rate=4, tpot=2.5, seed=1, slo={"ttft_ms": 50, "tpot_ms": 5})])
    rated.seal(base), rated.seal(new)
    rows = {c["cell"]: c for c in diff.bench_diff(archive.load(base), archive.load(new))}
    same, other = rows["http-engine-r2"], rows["http-engine-r4"]
    assert (same["target"], same["rate"], same["concurrency"], same["batch"]) == ("engine", 2.0, None, None)
    assert same["claim"] == "no directional claim" and same["reason"].startswith(diff.ONE_RUN + ". A → B (B/A): ")
    assert same["tpot_p50_ratio"] == pytest.approx(0.5) and same["tpot_p50_change_pct"] == pytest.approx(-50.0)
    f = same["figures"]
    assert (f["ttft_p50_ms"]["a"], f["ttft_p50_ms"]["b"], f["ttft_p50_ms"]["ratio"]) == (20.0, 10.0, 0.5)
    assert (f["completed"]["a"], f["completed"]["b"], f["completed"]["b_requests"]) == (6, 5, 6)
    assert f["goodput"]["ratio"] == pytest.approx(5 / 6)  # one request of B was reset: it is not good
    assert "completed 6/6 → 5/6" in same["reason"] and "TTFT p50 20 → 10 ms (0.500)" in same["reason"]
    assert other["claim"] == "no directional claim" and other["reason"].startswith("contract differs (keys seed, slo). A → B: ")
    assert other["tpot_p50_ratio"] is None and other["tpot_p50_change_pct"] is None
    assert other["figures"]["tpot_p50_ms"] == {"a": 5.0, "b": 2.5, "ratio": None}  # both figures, no ratio
    assert rows["http-engine-r8"]["reason"] == "only in A" and rows["http-engine-r8"]["figures"]["goodput"]["b"] is None

    code, out, _ = evident(capsys, "diff", "aaa", "bbb")
    assert code == 0 and max(map(len, out.splitlines())) <= 100 and " faster" not in out.split("--json.")[1]
    row = next(line for line in out.splitlines() if line.startswith("http-engine-r2"))
    assert row.split()[:4] == ["http-engine-r2", "5", "2.5", "0.500"] and "no directional claim" in row
    assert next(line for line in out.splitlines() if line.startswith("http-engine-r4")).split()[3] == "—"
    assert "one run a rate, no noise estimate" in out and "contract differs (keys seed, slo)" in out


# --- sync ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its schema migrated once; tests copy it (saves seconds each)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def runs_of(uri: str, campaign: str) -> list:
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(campaign)
    return [] if exp is None else c.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=1000)


@pytest.mark.timeout(120)
def test_sync_fills_pending_tracking_once(arch, capsys, empty_store):
    shutil.copyfile(empty_store, "mlflow.db")
    uri = "sqlite:///mlflow.db"
    code, out, _ = evident(capsys, "sync", "bbb", "--tracking-uri", uri)
    assert code == 0 and out.startswith("ok    gpu/bbbbbbb-c33333333-r1: experiment")
    first = {r.info.run_id: r.info.status for r in runs_of(uri, "gpu")}
    assert len(first) == 1 + 3 and set(first.values()) == {"FINISHED"}  # parent + one run per stage
    record = json.loads(Path(".evident/tracking/bbbbbbb-c33333333-r1.json").read_text())
    assert record["parent_run_id"] in first
    code, out, _ = evident(capsys, "ls", "--campaign", "gpu")
    assert "synced" in out  # the sealed manifest still says pending; the sync record says it was filled

    code, out, _ = evident(capsys, "sync", "bbb", "--tracking-uri", uri)  # twice: nothing new
    assert code == 0
    assert {r.info.run_id: r.info.status for r in runs_of(uri, "gpu")} == first
    code, out, _ = evident(capsys, "sync", "--all", "--tracking-uri", uri)
    assert code == 0 and "skip  tiny/ccccccc-c44444444-r1: not sealed" in out
    assert len(runs_of(uri, "tiny")) == 2 * 4 and len(runs_of(uri, "gpu")) == 4
    code, out, _ = evident(capsys, "sync", "ccc", "--tracking-uri", uri)
    assert code == 1 and "not sealed" in out


@pytest.mark.timeout(60)
def test_sync_to_an_unreachable_store_fails_and_keeps_evidence(arch, capsys, monkeypatch):
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = archive.verify(arch / "gpu/bbbbbbb-c33333333-r1")
    code, out, _ = evident(capsys, "sync", "bbb", "--tracking-uri", f"http://127.0.0.1:{port}")
    assert code == 1 and "FAIL  gpu/bbbbbbb-c33333333-r1: tracking unreachable" in out
    assert archive.verify(arch / "gpu/bbbbbbb-c33333333-r1") == before
    assert not Path(".evident/tracking/bbbbbbb-c33333333-r1.json").exists()


# --- on evidence the pipeline built (slow) -------------------------------------------------

def snakemake(workdir: Path, *args: str, command: tuple[str, ...] = (str(SNAKEMAKE),)) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([*command, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "-c2", *args],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The default campaign's working directory and sealed evidence directory: the session's one local run of it
    (`snakemake -c2` in a working directory of its own, as a user runs it), shared with test_pipeline.py and
    test_cluster.py rather than run again here (a run is minutes on two cores). These tests leave it as they found it
    but for what a user's commands add beside the evidence (report.html, the sync record under .evident/tracking)."""
    wd, r, _ = cluster.default_local_run(tmp_path_factory)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (ev,) = [d for d in (wd / "evidence/tiny").iterdir() if d.is_dir()]
    return wd, ev


def run_evident(wd: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed console script, from the working directory, as a user runs it."""
    exe = Path(sys.executable).with_name("evident")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "evident.workflow.cli"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([*cmd, *args], cwd=wd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
@cluster.shares_default_run
def test_cli_on_pipeline_evidence(pipeline, tmp_path):
    wd, ev = pipeline
    r = run_evident(wd, "ls")
    words = r.stdout.split()
    assert r.returncode == 0 and ev.name in words and "pass" in words and "logged" in words and "sealed" in words
    r = run_evident(wd, "show", ev.name[:12])
    assert r.returncode == 0 and ["parity", "all_token_text_exact", "pass"] in rows(r.stdout)
    assert max(map(len, r.stdout.splitlines())) <= 100
    r = run_evident(wd, "show", "--markdown", ev.name[:12])
    assert r.returncode == 0 and "### Decode benchmark" in r.stdout
    r = run_evident(wd, "verify", ev.name[:12])
    assert r.returncode == 0 and r.stdout == f"ok    tiny/{ev.name}\n"

    # a second directory of the same campaign: the same files, one bench contract changed, resealed (removed
    # again whatever happens: the working directory is the session's shared default run)
    other = ev.with_name(ev.name.replace("-r1", "-r2"))
    shutil.copytree(ev, other)
    try:
        cell_file = other / "bench/single-b1.json"
        cell = json.loads(cell_file.read_text())
        cell["contract"]["new_tokens"] += 1
        write_json(cell_file, cell)
        manifest = json.loads((other / MANIFEST).read_text())
        write_manifest(other, {k: v for k, v in manifest.items() if k not in ("schema_version", "sealed_utc", "files")}
                       | {"evidence_id": other.name})
        r = run_evident(wd, "diff", ev.name, other.name, "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        claims = {c["cell"]: c for c in d["bench"]}  # by label: single-b1 and single-distinct-b1 are two cells
        assert claims["single-b1"]["claim"] == "no directional claim"
        assert "contract differs (keys new_tokens)" in claims["single-b1"]["reason"]
        assert all(c["claim"] in ("faster", "slower", "no directional claim") for c in d["bench"])
        assert d["verdicts"] == [] and d["limits"] == []
        r = run_evident(wd, "diff", ev.name, other.name)
        assert r.returncode == 0 and "contract differs" in r.stdout
    finally:
        shutil.rmtree(other)

    # hand-damaged copies (each in an archive of its own: a renamed copy would be reported as renamed)
    for how, rel in (("changed", "oracle/hf.json"), ("missing", "plots/bench.png"), ("extra", "parity/extra.json")):
        d = shutil.copytree(ev, tmp_path / how / "evidence/tiny" / ev.name)
        if how == "changed":
            data = bytearray((d / rel).read_bytes())
            data[len(data) // 2] ^= 0x20  # one bit of one byte
            (d / rel).write_bytes(bytes(data))
        elif how == "missing":
            (d / rel).unlink()
        else:
            (d / rel).write_text("{}\n")
        r = run_evident(tmp_path / how, "verify", ev.name[:10])
        assert (r.returncode, r.stdout) == (1, f"FAIL  tiny/{ev.name}: {how} {rel}\n")
        assert run_evident(tmp_path / how, "verify", "--all").returncode == 1


@pytest.mark.slow
@cluster.shares_default_run
def test_sync_on_pipeline_evidence_creates_no_duplicate(pipeline):
    wd, ev = pipeline
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    manifest = json.loads((ev / MANIFEST).read_text())
    before = {r.info.run_id for r in runs_of(uri, "tiny")}
    for _ in range(2):
        r = run_evident(wd, "sync", "--all")
        assert r.returncode == 0, r.stdout + r.stderr
        assert manifest["tracking"]["parent_run_id"] in r.stdout
    assert {r.info.run_id for r in runs_of(uri, "tiny")} == before
    assert len(before) == 1 + len(manifest["stages"])


@pytest.mark.slow
@cluster.shares_default_run
def test_pipeline_archive_index_loads_in_chromium(pipeline, tmp_path):
    wd, ev = pipeline
    index, page = wd / "evidence/index.html", wd / "evidence/_pages/tiny" / f"{ev.name}.html"
    assert index.is_file() and page.is_file()  # built by `rule all`, outside the sealed directory
    assert run_evident(wd, "verify", ev.name).returncode == 0  # nothing was written inside it
    assert headless.assert_archive_resolves(wd / "evidence") > 30
    text = page.read_text()
    assert str(wd) not in text and str(Path.home()) not in text
    assert "plots/bench.png" in text and "all_token_text_exact" in text
    if not headless.binary():
        pytest.skip("chromium is not installed (apt-get install chromium): the browser check needs it")
    for name, target, width in (("index", index, 1400), ("page", page, 1280)):
        shot = tmp_path / f"evident-{name}.png"
        seen = headless.load(target, shot, width)
        print(f"screenshot of {target.name}: {shot}")
        shutil.copyfile(shot, f"/tmp/evident-{name}.png")
        assert seen["errors"] == [], seen["errors"]
        assert all(img["ok"] for img in seen["images"]), seen["images"]
        assert all(link.startswith("file://") for link in seen["links"])
        assert shot.stat().st_size > 10_000
    assert any(img["src"].endswith("plots/bench.png") for img in seen["images"])


@pytest.mark.slow
@cluster.shares_default_run
def test_rerun_through_the_venv_at_another_path_has_nothing_to_do(pipeline, tmp_path):
    """The same tree run through its venv reached at another path (moved, or through a link) reruns nothing: the
    stages' commands name their interpreter as $EVIDENT_PY, so their params, a rerun trigger, hold no path."""
    wd, _ = pipeline
    venv = tmp_path / "venv"
    venv.symlink_to(sys.prefix, target_is_directory=True)
    python = venv / Path(sys.executable).relative_to(sys.prefix)
    r = snakemake(wd, "-n", command=(str(python), "-m", "snakemake"))
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
@cluster.shares_default_run
def test_rerun_has_nothing_to_do_and_snakemake_report(pipeline):
    wd, ev = pipeline
    index = wd / "evidence/index.html"
    before = index.stat().st_mtime_ns
    t0 = time.perf_counter()
    r = snakemake(wd)
    print(f"no-op rerun: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr
    assert index.stat().st_mtime_ns == before
    r = snakemake(wd, "--report", "report.html")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (wd / "report.html").read_text()
    assert len(report) > 100_000  # self-contained: the files are embedded
    for caption in ("pull-request evidence section", "seals the evidence directory", "decode throughput",
                    "steady TPOT"):
        assert caption in report, caption
    for name in ("SUMMARY.md", "MANIFEST.json", "comparison.json", "summary.csv", "bench.png"):
        assert name in report, name
