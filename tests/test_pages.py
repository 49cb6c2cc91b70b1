"""The static HTML archive (workflow/archive/pages.py) on directories built by hand.

The same checks on what the pipeline builds, and the screenshot the lead looks at, are in
tests/test_archive.py (slow).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import handbuilt
import headless
import pytest

from evident.workflow.archive import archive, pages, summary
from evident.workflow.core.evidence import Stage, write_manifest, write_text

HOSTILE = "\n### Notes\n\n- case `<script>alert(1)</script>` & \"quotes\" <b>bold?</b>\n"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "evidence"
    handbuilt.build(root, "tiny", "aaaaaaa-c11111111-r1", created="2026-01-01T00:00:00Z",
                    tracking={"status": "logged", "experiment_id": "3", "parent_run_id": "p" * 32,
                              "child_run_ids": {"compare": "c" * 32}})
    handbuilt.build(root, "tiny", "bbbbbbb-c22222222-r1", created="2026-01-02T00:00:00Z", plot=False,
                    verdict="near_tie_divergence", summary_extra=HOSTILE)
    handbuilt.build(root, "gpu-ep2", "ccccccc-c33333333-r1", created="2026-01-03T00:00:00Z", plot=False, seal=False)
    return root


def test_pages_outside_evidence_directories_relative_and_escaped(root, tmp_path):
    written = pages.write_archive(root)
    assert sorted(p.relative_to(root).as_posix() for p in written) == [
        "_pages/gpu-ep2/ccccccc-c33333333-r1.html", "_pages/tiny/aaaaaaa-c11111111-r1.html",
        "_pages/tiny/bbbbbbb-c22222222-r1.html", "index.html"]
    assert [d.name for d in archive.evidence_dirs(root)] == ["ccccccc-c33333333-r1", "aaaaaaa-c11111111-r1",
                                                             "bbbbbbb-c22222222-r1"]  # pages are not evidence
    for ev in archive.evidence_dirs(root):  # nothing was written inside a sealed directory
        assert archive.intact(archive.verify(ev)) or not (ev / "MANIFEST.json").exists()
    assert headless.assert_archive_resolves(root) > 20
    for page in written:
        text = page.read_text()
        assert str(tmp_path) not in text and str(Path.home()) not in text
        assert "<script" not in text and "http" not in text  # no script, no external asset
    hostile = (root / "_pages/tiny/bbbbbbb-c22222222-r1.html").read_text()
    assert "<code>&lt;script&gt;alert(1)&lt;/script&gt;</code> &amp; &quot;quotes&quot; &lt;b&gt;bold?&lt;/b&gt;" in hostile
    index = (root / "index.html").read_text()
    # campaigns in name order, each newest first
    assert (index.index('href="_pages/gpu-ep2/ccccccc') < index.index('href="_pages/tiny/bbbbbbb')
            < index.index('href="_pages/tiny/aaaaaaa'))
    assert 'class="badge warn">parity: near_tie_divergence' in index
    assert 'class="badge good">parity: all_token_text_exact' in index
    page = (root / "_pages/tiny/aaaaaaa-c11111111-r1.html").read_text()
    assert '<img src="../../tiny/aaaaaaa-c11111111-r1/plots/bench.png"' in page
    assert page.count("<img") == 1  # the summary shows the plot; it is not repeated under Plots


def test_mlflow_links_only_to_an_http_server_and_never_its_credentials(root):
    pages.write_archive(root, tracking_uri="sqlite:////somewhere/private/mlflow.db")
    page = (root / "_pages/tiny/aaaaaaa-c11111111-r1.html").read_text()
    assert "private" not in page and "<code>" + "p" * 32 + "</code>" in page and "evident ui" in page
    pages.write_archive(root, tracking_uri="https://user:secret@mlflow.example.org/prefix/")
    page = (root / "_pages/tiny/aaaaaaa-c11111111-r1.html").read_text()
    assert "secret" not in page and "user:" not in page
    for rid in ("p" * 32, "c" * 32):  # on the runs view ("Machine learning"), not MLflow 3's GenAI overview
        assert f'href="https://mlflow.example.org/prefix/#/experiments/3/runs/{rid}{pages.VIEW}"' in page
    pending = (root / "_pages/tiny/bbbbbbb-c22222222-r1.html").read_text()
    assert "evident sync" in pending and "experiments/" not in pending


def test_damage_is_flagged_and_stale_pages_removed(root):
    ev = root / "tiny/aaaaaaa-c11111111-r1"
    (ev / "parity/comparison.json").unlink()
    (ev / "scratch.txt").write_text("x")
    pages.write_archive(root)
    page = (root / "_pages/tiny/aaaaaaa-c11111111-r1.html").read_text()
    assert '<td>parity/comparison.json</td><td class=num>' in page and 'class="badge bad">missing' in page
    assert 'href="../../tiny/aaaaaaa-c11111111-r1/scratch.txt"' in page and "not in manifest" in page
    headless.assert_archive_resolves(root)  # a missing file is named, never linked

    (root / "_pages/tiny/mine.html").write_text("<p>a page of my own</p>")
    shutil.rmtree(root / "tiny/bbbbbbb-c22222222-r1")
    pages.write_archive(root)
    assert not (root / "_pages/tiny/bbbbbbb-c22222222-r1.html").exists()
    assert (root / "_pages/tiny/mine.html").exists()
    assert "bbbbbbb" not in (root / "index.html").read_text()


def test_empty_archive(tmp_path):
    pages.write_archive(tmp_path / "evidence")
    assert "No evidence directories yet" in (tmp_path / "evidence/index.html").read_text()


def test_archive_loads_in_headless_chromium(root, tmp_path):
    if not headless.binary():
        pytest.skip("chromium is not installed (apt-get install chromium): the browser check needs it")
    pages.write_archive(root)
    for target in (root / "index.html", root / "_pages/tiny/aaaaaaa-c11111111-r1.html",
                   root / "_pages/tiny/bbbbbbb-c22222222-r1.html"):
        shot = tmp_path / f"{target.stem}.png"
        seen = headless.load(target, shot)
        print(f"screenshot of {target.relative_to(root)}: {shot}")
        assert seen["errors"] == [], seen["errors"]
        assert all(img["ok"] for img in seen["images"]), seen["images"]
        assert len(seen["links"]) + len(seen["images"]) == len(headless.links_and_images(target))
        assert shot.stat().st_size > 5_000
    shutil.copyfile(tmp_path / "index.png", "/tmp/evident-index-handbuilt.png")


def test_trends_page_per_campaign_with_a_sealed_directory(root, tmp_path):
    pages.write_archive(root)
    trends = root / "_pages/_trends/tiny.html"
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("_trends/*")) == ["_trends/tiny.csv",
                                                                                      "_trends/tiny.png"]
    assert not (root / "_pages/_trends/gpu-ep2.html").exists()  # unsealed only: no trend
    index = (root / "index.html").read_text()
    assert 'href="_pages/_trends/tiny.html"' in index and 'href="_trends/tiny.png"' in index
    assert 'href="_pages/_trends/gpu-ep2.html"' not in index
    text = trends.read_text()
    assert '<img src="../../_trends/tiny.png"' in text and 'href="../../_trends/tiny.csv"' in text
    assert 'href="../tiny/aaaaaaa-c11111111-r1.html"' in text and 'href="../tiny/bbbbbbb-c11111111-r1.html"' not in text
    assert 'href="../tiny/bbbbbbb-c22222222-r1.html"' in text and "None: no cell got slower" in text
    assert 'class="badge warn">near_tie_divergence' in text  # the gate verdicts, per directory
    assert str(tmp_path) not in text and "<script" not in text and "http" not in text
    assert headless.assert_archive_resolves(root) > 30
    for ev in archive.evidence_dirs(root):
        assert archive.intact(archive.verify(ev)) or not (ev / "MANIFEST.json").exists()

    # a campaign with no sealed directory left loses its trends; a filtered `evident trend` view is not ours
    (root / "_trends/tiny-single-b1.csv").write_text("mine")
    for eid in ("aaaaaaa-c11111111-r1", "bbbbbbb-c22222222-r1"):
        shutil.rmtree(root / "tiny" / eid)
    pages.write_archive(root)
    assert not trends.exists() and sorted(p.name for p in (root / "_trends").iterdir()) == ["tiny-single-b1.csv"]
    assert "_trends/tiny" not in (root / "index.html").read_text()


def test_trends_page_loads_in_headless_chromium(root, tmp_path):
    if not headless.binary():
        pytest.skip("chromium is not installed (apt-get install chromium): the browser check needs it")
    pages.write_archive(root)
    target = root / "_pages/_trends/tiny.html"
    seen = headless.load(target, tmp_path / "trends.png")
    assert seen["errors"] == [], seen["errors"]
    assert [img["src"].rpartition("/")[2] for img in seen["images"]] == ["tiny.png"]
    assert all(img["ok"] for img in seen["images"]), seen["images"]  # the PNG decodes
    assert len(seen["links"]) + len(seen["images"]) == len(headless.links_and_images(target))
    for href in seen["links"]:  # every link, as the browser resolved it, names a file that exists
        parts = urlsplit(href)
        assert parts.scheme == "file" and Path(unquote(parts.path)).is_file(), href
    assert any(h.endswith("/_trends/tiny.csv") for h in seen["links"])
    assert (tmp_path / "trends.png").stat().st_size > 5_000


def test_the_page_shows_details_md_with_its_plots(tmp_path):
    """SUMMARY.md has no image (it pastes into a pull request); the page shows DETAILS.md after it, with the plots
    its images name, each once, and no skipped stage's placeholder plot."""
    root = tmp_path / "evidence"
    ev = handbuilt.build(root, "tiny", "ddddddd-c44444444-r1", seal=False)
    write_text(ev / summary.SUMMARY, "## Evidence\n\n| gate | verdict |\n|---|---|\n| parity | `all_token_text_exact` |\n")
    write_text(ev / summary.DETAILS, "## Details\n\n### Decode benchmark\n\n![decode tok/s](plots/bench.png)\n")
    with Stage(ev, "overlap") as st:  # a skipped stage's plot: a placeholder panel, never shown
        st.skip("nothing to screen")
        st.add_file(shutil.copy(ev / "plots/bench.png", ev / "plots/overlap.png"))
    write_manifest(ev, {"evidence_id": ev.name, "campaign": "tiny", "created_utc": "2026-01-04T00:00:00Z",
                        "git": {"commit": "d" * 40, "dirty": None}, "config_sha256": "44" * 32, "stages": {},
                        "verdict": "all_token_text_exact", "tracking": {"status": "disabled"}})
    pages.write_archive(root)
    page = (root / "_pages/tiny/ddddddd-c44444444-r1.html").read_text()
    img = '<img src="../../tiny/ddddddd-c44444444-r1/plots/bench.png"'
    assert page.index("<h2>Summary</h2>") < page.index("<h2>Details</h2>") < page.index(img)
    assert page.count("<img") == 1 and "<h2>Plots</h2>" not in page  # not repeated under Plots
    assert 'href="../../tiny/ddddddd-c44444444-r1/plots/overlap.png"' in page  # listed among the files
