"""`evident trend` (workflow/archive/trend.py) on directories built by hand: the CSV's rows and values, the regression
flag exactly where a cell got slower beyond the noise, gate verdicts per directory, the PNG, the filters, the
errors. The trends page of the HTML archive is checked in tests/test_pages.py."""

from __future__ import annotations

import io

import handbuilt as hb
import pandas as pd
import pytest

from evident.workflow.archive import diff, trend
from evident.workflow.bench import benchstats
from evident.workflow.core import terminal
from evident.workflow.core.evidence import Stage, write_manifest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NOISE = 0.01  # per-repeat medians tpot, 1.01 tpot, 1.02 tpot: spread 0.0198, within the noise rule's 0.05


def seal(ev, created):
    """Seal a directory built with seal=False (after adding a stage to it), as handbuilt.build seals."""
    eid = ev.name
    write_manifest(ev, {"evidence_id": eid, "campaign": ev.parent.name, "created_utc": created,
                        "git": {"commit": eid.split("-")[0] + "0" * 33, "dirty": None}, "config_sha256": "11" * 32,
                        "verdict": "all_token_text_exact", "tracking": {"status": "pending"}})


def versions_changed(c):
    c["versions"] = {**c["versions"], "torch": "2.14.0+cpu"}
    return c


def graph(c):
    c["kernels"] = "graph"
    return c


# (id, created, single-b1 TPOT, single-b8 cell, hf-b1 TPOT, parity verdict). The ids do not sort in created order:
# order is the manifest's created time. single-b1: +1% (within the noise), +18.8% (a regression), -16.7% (faster; cells without
# a machine probe need beyond benchstats.UNPROBED_EFFECT);
# hf-b1 is noisy (+33%, no claim); single-b8 changes versions at the third (+50%, not comparable) and becomes
# the graph path at the fourth (a new cell, single-graph-b8).
RUNS = [
    ("eeeeeee-c11111111-r1", "2026-01-01T00:00:00Z", 10.0, lambda: hb.cell("single", 8, 20.0, NOISE), 30.0,
     "all_token_text_exact"),
    ("bbbbbbb-c11111111-r1", "2026-01-02T00:00:00Z", 10.1, lambda: hb.cell("single", 8, 20.0, NOISE), 40.0,
     "all_token_text_exact"),
    ("ddddddd-c11111111-r1", "2026-01-03T00:00:00Z", 12.0,
     lambda: versions_changed(hb.cell("single", 8, 30.0, NOISE)), 40.0, "near_tie_divergence"),
    ("aaaaaaa-c11111111-r1", "2026-01-04T00:00:00Z", 10.0, lambda: graph(hb.cell("single", 8, 15.0, NOISE)), 40.0,
     "precision_regression"),
]
ORDER = [r[0] for r in RUNS]


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "evidence"
    for i, (eid, created, b1, b8, hf, verdict) in enumerate(RUNS):
        cells = [hb.cell("single", 1, b1, NOISE), b8(), hb.cell("hf", 1, hf, 0.1)]
        if i == 1:  # the second also ran the overlap screen
            ev = hb.build(root, "tiny", eid, created=created, verdict=verdict, cells=cells, plot=False, seal=False)
            with Stage(ev, "overlap") as st:
                st.write_json("overlap/screen.json", {"verdict": "bitwise_equal_no_claim"})
            seal(ev, created)
        else:
            hb.build(root, "tiny", eid, created=created, verdict=verdict, cells=cells, plot=False)
    # the newest is unsealed: it does not count
    hb.build(root, "tiny", "fffffff-c11111111-r1", created="2026-01-05T00:00:00Z", seal=False, plot=False,
             cells=[hb.cell("single", 1, 99.0, NOISE)])
    hb.build(root, "other", "9999999-c22222222-r1", created="2026-01-01T00:00:00Z", plot=False)
    return root


def run(capsys, root, *args):
    code = trend.main(["--root", str(root), "trend", *args])
    out, err = capsys.readouterr()
    return code, out, err


def read_csv(path):
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def test_csv_rows_in_created_order_with_values_and_bands(root, capsys):
    code, out, err = run(capsys, root, "--campaign", "tiny")
    assert code == 0, err
    frame = read_csv(root / "_trends/tiny.csv")
    assert list(frame.columns) == trend.COLUMNS
    assert list(frame.drop_duplicates("order")["evidence"]) == ORDER  # by created time, not by id; unsealed out
    assert list(frame.drop_duplicates("order")["commit"]) == [e[:7] for e in ORDER]
    b1 = frame[frame["cell"] == "single-b1"]
    assert list(b1["order"]) == [1, 2, 3, 4]
    for (_, r), (_, _, tpot, *_rest) in zip(b1.iterrows(), RUNS):
        stats = hb.cell("single", 1, tpot, NOISE)["stats"]
        assert r["value"] == pytest.approx(stats["tpot"]["p50"])
        assert (r["band_lo"], r["band_hi"]) == pytest.approx((min(stats["repeat_tpot_p50"]),
                                                              max(stats["repeat_tpot_p50"])))
        assert r["band_lo"] < r["value"] < r["band_hi"]
        assert r["spread"] == pytest.approx(stats["spread"]) and r["metric"] == "tpot_p50_ms"
    assert list(b1["baseline"].fillna("")) == ["", *ORDER[:3]]
    # a cell is named as evidence names runs: the graph path at batch 8 is its own cell, first seen at #4
    assert sorted(frame["cell"].unique()) == ["hf-b1", "single-b1", "single-b8", "single-graph-b8"]
    assert list(frame[frame["cell"] == "single-b8"]["order"]) == [1, 2, 3]
    graph_row = frame[frame["cell"] == "single-graph-b8"].iloc[0]
    assert (graph_row["order"], graph_row["kernels"], graph_row["batch"]) == (4, "graph", 8)
    assert graph_row["reason"] == "the first directory with this cell"
    assert "4 sealed directories" in out and "fffffff" not in out and (root / "_trends/tiny.png").is_file()


def test_regression_flagged_exactly_where_slower_beyond_the_noise(root, capsys):
    code, out, _ = run(capsys, root, "--campaign", "tiny")
    assert code == 0
    frame = read_csv(root / "_trends/tiny.csv")
    flagged = frame[frame["regression"]]
    assert [(r.cell, r.evidence) for r in flagged.itertuples()] == [("single-b1", ORDER[2])]
    assert flagged.iloc[0]["claim"] == "slower" and flagged.iloc[0]["tpot_p50_change_pct"] == pytest.approx(100 * 1.9 / 10.1)

    def row(cell, i):
        return frame[(frame["cell"] == cell) & (frame["order"] == i)].iloc[0]

    within = row("single-b1", 2)  # +1%: inside the 1.98% spread
    assert within["claim"] == "no directional claim" and "within noise" in within["reason"]
    assert within["tpot_p50_change_pct"] == pytest.approx(1.0)
    assert row("single-b1", 4)["claim"] == "faster"
    noisy = row("hf-b1", 2)  # +33%, but a noisy cell makes no claim
    assert noisy["claim"] == "no directional claim" and "noisy" in noisy["reason"] and not noisy["regression"]
    other = row("single-b8", 3)  # +50%, but measured on other versions: not comparable
    assert "versions differ" in other["reason"] and not other["regression"]
    assert pd.isna(other["tpot_p50_change_pct"])
    # the terminal: one regression, in the table and in the list under it
    assert out.count("▲") == 2 and "12.120 ▲" in out and "10.302 ▲" not in out
    assert "30.300 ≠" in out and "44.000 ~" in out and "10.100 ▼" in out
    assert "(TPOT p50 slower beyond the noise, against the previous directory with the cell): 1" in out
    line = next(x for x in out.splitlines() if x.startswith("single-b1") and "#3 ddddddd" in x)
    assert "#2" in line and "+18.8%" in line
    assert max(len(x) for x in out.splitlines() if not x.startswith("wrote ")) <= terminal.WIDTH  # bar the paths


def test_gate_verdicts_per_directory(root, capsys):
    assert run(capsys, root, "--campaign", "tiny")[0] == 0
    dirs = read_csv(root / "_trends/tiny.csv").drop_duplicates("order")
    assert list(dirs["gate_parity"]) == [r[5] for r in RUNS]
    assert list(dirs["gate_overlap"].fillna("")) == ["", "bitwise_equal_no_claim", "", ""]
    assert dirs["gate_quality"].isna().all() and dirs["gate_audit"].isna().all()
    out = run(capsys, root, "--campaign", "tiny")[1]
    gates = out[out.index("Gate verdicts"):out.index("Regressions")]
    assert "overlap" in gates and "quality" not in gates
    assert [x.split()[-1] for x in gates.splitlines()[3:7]] == ["—", "bitwise_equal_no_claim", "—", "—"]


def test_png_is_a_valid_png(root, capsys):
    assert run(capsys, root, "--campaign", "tiny")[0] == 0
    data = (root / "_trends/tiny.png").read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert img.shape[0] > 300 and img.shape[1] > 600


def test_cell_and_metric_filters(root, capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, root, "--campaign", "tiny", "--cell", "single-graph-b8", "--cell", "single-b1",
                         "--metric", "tok_s", "--out", str(out_dir))
    assert code == 0, err
    name = "tiny-tok_s-single-graph-b8+single-b1"  # a filtered view never replaces the archive's tiny.png
    assert sorted(p.name for p in out_dir.iterdir()) == [f"{name}.csv", f"{name}.png"]
    assert not (root / "_trends").exists()
    frame = read_csv(out_dir / f"{name}.csv")
    assert set(frame["metric"]) == {"tok_s"}
    assert set(frame["cell"]) == {"single-b1", "single-graph-b8"}
    b1 = frame[frame["cell"] == "single-b1"].iloc[0]
    cell = hb.cell("single", 1, 10.0, NOISE)
    per_repeat = [1 * len(r["steady_ms"]) / (sum(r["steady_ms"]) / 1000) for r in cell["repeats"]]
    assert b1["value"] == pytest.approx(cell["stats"]["decode_tok_s"])
    assert (b1["band_lo"], b1["band_hi"]) == pytest.approx((min(per_repeat), max(per_repeat)))
    assert list(frame["regression"]) == [False, False, True, False, False]  # the flag is still on TPOT p50
    assert "decode throughput (tokens/s) per cell" in out and "hf-b1" not in out and "99.0" in out and "82.5 ▲" in out

    # directories without the asked-for cell keep one row, for their gates
    assert run(capsys, root, "--campaign", "tiny", "--cell", "single-graph-b8", "--out", str(out_dir))[0] == 0
    frame = read_csv(out_dir / "tiny-single-graph-b8.csv")
    assert list(frame["cell"].fillna("")) == ["", "", "", "single-graph-b8"]
    assert list(frame["gate_parity"]) == [r[5] for r in RUNS]

    code, _, err = run(capsys, root, "--campaign", "tiny", "--cell", "single-b9")
    assert code == trend.ERROR
    assert "no cell 'single-b9'" in err and "hf-b1, single-b1, single-b8, single-graph-b8" in err
    with pytest.raises(SystemExit):
        run(capsys, root, "--metric", "ttft")


def test_all_campaigns_by_default_and_narrow_tables(root, capsys):
    code, out, _ = run(capsys, root)
    assert code == 0
    assert sorted(p.name for p in (root / "_trends").iterdir()) == ["other.csv", "other.png", "tiny.csv", "tiny.png"]
    assert out.index("other: 1 sealed directory") < out.index("tiny: 4 sealed directories")
    # many cells: the table continues below instead of running past 100 columns
    cells = [hb.cell(b, n, 10.0 + n, NOISE) for b in ("single", "host-staged", "collective") for n in (1, 4, 8)]
    for c in cells:
        graph(c)
    hb.build(root, "wide", "1234567-c33333333-r1", cells=cells, plot=False)
    code, out, _ = run(capsys, root, "--campaign", "wide")
    assert code == 0 and "host-staged-graph-b8" in out
    assert max(len(x) for x in out.splitlines() if not x.startswith("wrote ")) <= terminal.WIDTH  # bar the paths
    assert sum(x.startswith("#") for x in out.splitlines()) >= 3  # the cells in two tables or more, and the gates


def test_errors(root, capsys, tmp_path):
    code, _, err = run(capsys, root, "--campaign", "nope")
    assert code == trend.ERROR and "no campaign 'nope'" in err and "known: other, tiny" in err
    hb.build(root, "unsealed", "7777777-c44444444-r1", seal=False, plot=False)
    code, _, err = run(capsys, root, "--campaign", "unsealed")
    assert code == trend.ERROR and "no sealed directory" in err and "1 unsealed" in err
    assert not (root / "_trends/unsealed.png").exists()
    code, _, err = run(capsys, tmp_path / "empty")
    assert code == trend.ERROR and "no campaigns under" in err


def test_one_sealed_directory_is_drawn_as_it_is(root, capsys):
    code, out, _ = run(capsys, root, "--campaign", "other")
    assert code == 0 and "only one sealed directory: nothing to compare yet" in out
    frame = read_csv(root / "_trends/other.csv")
    assert len(frame) == 1 and frame.iloc[0]["cell"] == "single-b1" and not frame.iloc[0]["regression"]
    assert (root / "_trends/other.png").read_bytes()[:8] == PNG_MAGIC


def test_directories_in_commit_order_where_the_history_has_every_commit(tmp_path):
    """Three commits of a git history, their directories created newest commit first: commit order wins. A
    directory whose commit this history lacks (another clone's) puts every one back in created order."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    commits = []
    for i in range(3):
        (tmp_path / "f").write_text(str(i))
        git("add", "f")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", str(i))
        commits.append(git("rev-parse", "HEAD")[:7])
    root = tmp_path / "evidence"
    for i, c in enumerate(commits):  # the newest commit was run first
        hb.build(root, "tiny", f"{c}-c11111111-r1", created=f"2026-01-0{3 - i}T00:00:00Z")
    entries, ordered_by = trend.directories(root, "tiny")
    assert ordered_by == "commit" and [e.commit for e in entries] == commits
    frame = trend.history(entries, ordered_by=ordered_by)
    assert trend.report(frame).splitlines()[0].startswith(f"tiny: 3 sealed directories, {trend.ORDERS['commit']}")
    hb.build(root, "tiny", "fffffff-c11111111-r1", created="2026-01-04T00:00:00Z")
    entries, ordered_by = trend.directories(root, "tiny")
    assert ordered_by == "created" and [e.commit for e in entries] == [*commits[::-1], "fffffff"]


def probed(c, probe_ms):
    """A handbuilt cell whose every repeat ran after a machine probe of `probe_ms` (stages/bench.py)."""
    c["repeats"] = [{**r, "probe_ms": probe_ms} for r in c["repeats"]]
    c["stats"] = benchstats.summarize_cell(c["repeats"], c["batch"], c["contract"]["new_tokens"])
    return c


def test_a_loaded_machine_is_noise_and_a_slow_down_a_regression(tmp_path, capsys):
    """The same code run three times: the second on a loaded machine (every step and the probe 1.3x slower) is no
    regression, marked as noise (~); the third on the quiet machine again, with a real 20% slow-down of single-b1,
    is one, against the first (the latest on a like machine), not the loaded second. A noisy cell is marked ~ from
    its first directory on."""
    root = tmp_path / "evidence"
    for i, (created, b1, b4, machine) in enumerate([("2026-01-01T00:00:00Z", 10.0, 20.0, 3.0),
                                                    ("2026-01-02T00:00:00Z", 13.0, 26.0, 3.9),
                                                    ("2026-01-03T00:00:00Z", 12.0, 20.0, 3.0)]):
        hb.build(root, "tiny", f"{'abc'[i] * 7}-c11111111-r1", created=created, plot=False,
                 cells=[probed(hb.cell("single", 1, b1, NOISE), machine),
                        probed(hb.cell("single", 4, b4, NOISE), machine), probed(hb.cell("hf", 1, 30.0, 0.1), machine)])
    code, out, err = run(capsys, root, "--campaign", "tiny")
    assert code == 0, err
    frame = read_csv(root / "_trends/tiny.csv")
    rows = {(r["cell"], r["order"]): r for r in frame.to_dict("records")}
    loaded = rows[("single-b1", 2)]
    assert loaded["claim"] == "no directional claim" and "machine differed by: (probe 1.30x slower" in loaded["reason"]
    assert loaded["probe_ratio"] == pytest.approx(1.3) and loaded["probe_ms"] == pytest.approx(3.9)
    assert [(r["cell"], r["order"]) for r in frame.to_dict("records") if r["regression"]] == [("single-b1", 3)]
    assert rows[("single-b1", 3)]["baseline"] == "aaaaaaa-c11111111-r1" and rows[("single-b1", 3)]["claim"] == "slower"
    assert rows[("single-b4", 3)]["reason"].startswith("difference within noise (|+0.00%|")  # against #1 too
    assert "13.130 ~" in out and "26.260 ~" in out and "12.120 ▲" in out
    assert out.count("~") - trend.LEGEND.count("~") >= 5  # hf-b1 noisy in all three, single-b1 and -b4 at #2


def test_rate_cells_are_series_with_no_band_and_never_a_claim(tmp_path, capsys):
    """http-engine-r2 over three directories: twice as slow at the second is no regression (one run a rate: no
    noise estimate), a changed SLO at the third is not comparable (≠); `--metric goodput` shows the rate cells only."""
    import rated

    root = tmp_path / "evidence"
    for i, cell in enumerate([rated.rate_cell(tpot=5.0), rated.rate_cell(tpot=10.0, failed=3),
                              rated.rate_cell(tpot=10.0, slo={"ttft_ms": 1000, "tpot_ms": 50})]):
        ev = hb.build(root, "tiny", f"{'abc'[i] * 7}-c11111111-r1", plot=False, seal=False)
        rated.write(ev, rates=[cell])
        rated.seal(ev, f"2026-01-0{i + 1}T00:00:00Z")
    code, out, err = run(capsys, root, "--campaign", "tiny")
    assert code == 0, err
    frame = read_csv(root / "_trends/tiny.csv")
    rows = {r["order"]: r for r in frame.to_dict("records") if r["cell"] == "http-engine-r2"}
    assert [rows[i]["value"] for i in (1, 2, 3)] == [5.0, 10.0, 10.0]
    assert (rows[2]["target"], rows[2]["rate"], rows[2]["claim"]) == ("engine", 2.0, "no directional claim")
    assert rows[2]["reason"] == diff.ONE_RUN and rows[2]["tpot_p50_change_pct"] == pytest.approx(100.0)
    assert "contract differs (keys slo)" in rows[3]["reason"] and not frame["regression"].any()
    assert all(pd.isna(r["band_lo"]) for r in rows.values())
    assert "5.000" in out and "10.000 ▲" not in out and "10.000 ~" not in out and "10.000 ≠" in out
    code, out, err = run(capsys, root, "--campaign", "tiny", "--metric", "goodput")
    assert code == 0, err
    frame = read_csv(root / "_trends/tiny-goodput.csv")
    assert set(frame["cell"]) == {"http-engine-r2"}  # single-b1 has no goodput: not a row
    assert list(frame["value"]) == pytest.approx([2.0, 1.0, 2.0])  # 6, 3 then 6 good requests over 3 s
