"""Unit tests for the evidence core (workflow/core/evidence.py): hashes, atomic writes, git state,
evidence ids, stage records and the manifest (docs/evidence.md)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from evident.workflow.core import evidence

# --- hashes --------------------------------------------------------------------------------


def test_token_sha256_is_little_endian_u32():
    # 1 -> 01 00 00 00, 258 = 0x102 -> 02 01 00 00, 70000 = 0x11170 -> 70 11 01 00
    raw = bytes([0x01, 0, 0, 0, 0x02, 0x01, 0, 0, 0x70, 0x11, 0x01, 0])
    assert evidence.token_sha256([1, 258, 70000]) == hashlib.sha256(raw).hexdigest()
    big_endian = b"".join(i.to_bytes(4, "big") for i in (1, 258, 70000))
    assert evidence.token_sha256([1, 258, 70000]) != hashlib.sha256(big_endian).hexdigest()


def test_token_sha256_empty_and_order_sensitive():
    assert evidence.token_sha256([]) == hashlib.sha256(b"").hexdigest()
    assert evidence.token_sha256([1, 2]) != evidence.token_sha256([2, 1])
    # A u32 cannot hold these; the hash must not silently wrap or truncate them.
    with pytest.raises(OverflowError):
        evidence.token_sha256([2**32])
    with pytest.raises(OverflowError):
        evidence.token_sha256([-1])


def test_text_sha256_is_utf8():
    text = "naïve café ✓"
    assert evidence.text_sha256(text) == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert evidence.text_sha256(text) != hashlib.sha256(text.encode("latin-1", "replace")).hexdigest()


def test_config_hash_canonical():
    a = {"campaign": "tiny", "dtype": "float32", "checkpoint": {"seed": 0, "init_std": 0.08}}
    b = {"checkpoint": {"init_std": 0.08, "seed": 0}, "dtype": "float32", "campaign": "tiny"}
    assert evidence.config_hash(a) == evidence.config_hash(b)  # key order does not matter
    expected = hashlib.sha256(json.dumps(a, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
    assert evidence.config_hash(a) == expected
    assert re.fullmatch(r"[0-9a-f]{64}", evidence.config_hash(a))
    c = {**a, "checkpoint": {"seed": 1, "init_std": 0.08}}  # a nested value change
    assert evidence.config_hash(c) != evidence.config_hash(a)


# --- atomic writes -------------------------------------------------------------------------


def test_write_bytes_creates_parents_and_leaves_no_temp(tmp_path):
    p = evidence.write_bytes(tmp_path / "a" / "b" / "x.bin", b"\x00\x01payload")
    assert p == tmp_path / "a" / "b" / "x.bin"
    assert p.read_bytes() == b"\x00\x01payload"
    assert os.listdir(p.parent) == ["x.bin"]
    evidence.write_bytes(p, b"second")
    assert p.read_bytes() == b"second"
    assert os.listdir(p.parent) == ["x.bin"]


def test_write_bytes_renames_from_same_directory(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((Path(src), Path(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    evidence.write_bytes(tmp_path / "out.json", b"{}")
    [(src, dst)] = seen
    assert dst == tmp_path / "out.json"
    assert src.parent == tmp_path  # same filesystem: the rename is atomic
    assert src != dst


def test_write_bytes_failed_replace_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    evidence.write_bytes(target, b"old contents")

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        evidence.write_bytes(target, b"new contents that never land")
    assert target.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["result.json"]  # no temp file left behind


def test_write_bytes_failed_write_keeps_old_file(tmp_path):
    target = tmp_path / "result.json"
    evidence.write_text(target, "old")
    with pytest.raises(TypeError):
        evidence.write_bytes(target, "not bytes")  # the write itself fails
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["result.json"]


def test_write_json_round_trip(tmp_path):
    obj = {"text": "naïve café ✓", "ids": [1, 2, 3], "nested": {"x": None}}
    p = evidence.write_json(tmp_path / "o.json", obj)
    assert evidence.read_json(p) == obj
    assert "naïve café ✓" in p.read_text(encoding="utf-8")  # not \u-escaped
    assert p.read_text().endswith("\n")


# --- file modes: evidence is world-readable --------------------------------------------------


@pytest.fixture
def umask():
    """`umask(mask)` sets the (process-wide) umask for the test; the old one is restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    try:
        yield os.umask
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("mask", [0o077, 0o027, 0o002, 0o000], ids=oct)
def test_write_helpers_files_0644_dirs_0755_whatever_the_umask(tmp_path, umask, mask):
    before = stat.S_IMODE(tmp_path.stat().st_mode)
    umask(mask)
    ev = tmp_path / "evidence" / "tiny" / "0123456-c89abcdef-r1"
    evidence.write_bytes(ev / "bench" / "plot.png", b"\x89PNG")
    evidence.write_text(ev / "config.yaml", "campaign: tiny\n")
    evidence.write_json(ev / "env.json", {"packages": {}})
    with evidence.Stage(ev, "oracle") as st:
        st.write_json("oracle/hf.json", {"cases": []})
    evidence.write_manifest(ev, {"campaign": "tiny"})
    modes = _modes(tmp_path)
    assert {rel for rel, m in modes.items() if (tmp_path / rel).is_file()} == {
        f"evidence/tiny/0123456-c89abcdef-r1/{f}"
        for f in ("bench/plot.png", "config.yaml", "env.json", "oracle/hf.json", "stages/oracle.json", "MANIFEST.json")}
    for rel, m in modes.items():
        assert m == (0o644 if (tmp_path / rel).is_file() else 0o755), (rel, oct(m))
    assert stat.S_IMODE(tmp_path.stat().st_mode) == before  # a directory that was there is not the helpers'


def test_write_bytes_replaces_a_private_file_with_a_readable_one(tmp_path, umask):
    umask(0o077)
    (tmp_path / "old").mkdir(mode=0o700)
    target = tmp_path / "old" / "result.json"
    target.write_text("old")
    target.chmod(0o600)
    evidence.write_text(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "old").stat().st_mode) == 0o700  # existing: left as it is
    assert os.listdir(tmp_path / "old") == ["result.json"]


def test_make_dirs(tmp_path, umask):
    umask(0o077)
    d = evidence.make_dirs(tmp_path / "a" / "b" / "c")
    assert d.is_dir() and evidence.make_dirs(d) == d  # existing: fine
    assert [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a", tmp_path / "a/b", d)] == [0o755] * 3
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        evidence.make_dirs(tmp_path / "file")
    with pytest.raises((FileExistsError, NotADirectoryError)):
        evidence.make_dirs(tmp_path / "file" / "sub")


def test_html_archive_is_world_readable(tmp_path, umask):
    from evident.workflow.archive import pages

    umask(0o077)
    root = tmp_path / "evidence"
    ev = root / "tiny" / "0123456-c89abcdef-r1"
    evidence.write_text(ev / "config.yaml", "campaign: tiny\n")
    with evidence.Stage(ev, "context"):
        pass
    evidence.write_manifest(ev, {"campaign": "tiny"})
    pages.write_archive(root, records=tmp_path / "records")
    modes = _modes(root)
    assert "index.html" in modes and "_pages/tiny/0123456-c89abcdef-r1.html" in modes
    for rel, m in modes.items():
        assert m == (0o644 if (root / rel).is_file() else 0o755), (rel, oct(m))


# --- git state -----------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
         "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", *args],
        check=True, capture_output=True, text=True,
    ).stdout.strip()


# A small project tree: one file (at least) per SOURCE_GLOBS pattern, nested where the pattern allows, and the
# files the evidence id must not follow (campaigns, docs, tests, notes, report captions).
SOURCE = {
    "Snakefile": "include: 'workflow/rules/common.smk'\n",
    "pyproject.toml": "[project]\nname = 'p'\n",
    "requirements.lock": "torch==2.13.0\n",
    "Makefile": "run:\n\ttrue\n",
    "config/config.yaml": "# the default campaign\ncampaign: tiny\n",
    "config/schema.yaml": "type: object\n",
    "engine/model.py": "x = 1\n",
    "engine/sub/deep.py": "y = 1\n",
    "kernels/gemv.py": "z = 1\n",
    "workflow/core/evidence.py": "w = 1\n",
    "workflow/stages/html.py": "h = 1\n",
    "workflow/rules/common.smk": "rule all:\n",
    "workflow/profiles/local/config.yaml": "cores: 2\n",
    "tools/device_profile.py": "t = 1\n",
    "tools/device_campaign.sh": "#!/bin/sh\n",
}
NOT_SOURCE = {
    "config/campaigns/mine.yaml": "campaign: mine\ndtype: float32\n",
    "README.md": "# project\n",
    "engine/DECODE.md": "notes beside the code\n",
    "kernels/KERNELS.md": "audit figures\n",
    "tests/test_model.py": "def test(): pass\n",
    "tests/reliability/test_x.py": "def test(): pass\n",
    "tools/NOTES.txt": "what I tried\n",
    "workflow/report/summary.rst": "caption\n",
    "evidence/README.md": "evidence lands here\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def no_git_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "EVIDENT_GIT_COMMIT", "EVIDENT_GIT_DIRTY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def repo(tmp_path, no_git_env):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    _write_tree(r, {**SOURCE, **NOT_SOURCE, ".gitignore": "ignored.log\nengine/scratch.py\n"})
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "init")
    return r


def test_git_state_clean(repo):
    st = evidence.git_state(repo)
    assert st["commit"] == _git(repo, "rev-parse", "HEAD")
    assert re.fullmatch(r"[0-9a-f]{40}", st["commit"])
    assert st["dirty"] is None


def test_git_state_dirty_tracked_then_untracked(repo):
    (repo / "engine/model.py").write_text("x = 2\n")  # one character
    tracked = evidence.git_state(repo)
    assert tracked["commit"] == _git(repo, "rev-parse", "HEAD")
    assert tracked["dirty"] is not None and re.fullmatch(r"[0-9a-f]{64}", tracked["dirty"])
    assert evidence.git_state(repo)["dirty"] == tracked["dirty"]  # deterministic
    _git(repo, "add", "engine/model.py")
    assert evidence.git_state(repo)["dirty"] == tracked["dirty"]  # staged or not: a diff against HEAD

    (repo / "engine/new.py").write_text("x = 1\n")
    with_untracked = evidence.git_state(repo)
    assert with_untracked["dirty"] not in (None, tracked["dirty"])

    (repo / "engine/new.py").write_text("x = 2\n")  # the untracked file's content counts, not just its name
    assert evidence.git_state(repo)["dirty"] not in (None, with_untracked["dirty"])


def test_git_state_untracked_only_and_ignored(repo):
    (repo / "ignored.log").write_text("noise\n")
    (repo / "engine/scratch.py").write_text("ignored, though its name is a source file's\n")
    assert evidence.git_state(repo)["dirty"] is None  # ignored files are not code
    (repo / "engine/new.py").write_text("x = 1\n")
    assert evidence.git_state(repo)["dirty"] is not None
    (repo / "engine/new.py").unlink()
    assert evidence.git_state(repo)["dirty"] is None


def test_git_state_deleted_source_file_is_dirty(repo):
    (repo / "kernels/gemv.py").unlink()
    assert evidence.git_state(repo)["dirty"] is not None


def test_git_state_reverted_change_is_clean(repo):
    (repo / "engine/model.py").write_text("x = 2\n")
    assert evidence.git_state(repo)["dirty"] is not None
    (repo / "engine/model.py").write_text("x = 1\n")
    assert evidence.git_state(repo)["dirty"] is None


def _notes_and_campaigns(repo: Path) -> None:
    """Everything a person edits beside the code: none of it can change a result."""
    camp = repo / "config/campaigns/mine.yaml"
    camp.write_text("# tried on the H200, see notes.md\n" + camp.read_text().replace("float32", "float32  # as ever"))
    (repo / "config/campaigns/yours.yaml").write_text("campaign: yours\n")  # a new, untracked campaign
    (repo / "notes.md").write_text("# what I saw\n")
    (repo / "README.md").write_text("# project, edited\n")
    (repo / "engine/DECODE.md").write_text("more notes\n")
    (repo / "tests/test_model.py").write_text("def test(): assert True\n")
    (repo / "tests/test_new.py").write_text("def test(): pass\n")
    (repo / "tools/NOTES.txt").write_text("what I tried next\n")
    (repo / "workflow/report/summary.rst").write_text("a better caption\n")
    for rel in ("evidence/tiny/0123456-c89abcdef-r1/MANIFEST.json", ".evident/logs/seal.log"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)  # not ignored here: the rule excludes them
        (repo / rel).write_text("{}\n")


def test_git_state_ignores_campaign_comments_notes_docs_tests_and_evidence(repo):
    clean = evidence.git_state(repo)
    _notes_and_campaigns(repo)
    assert "config/campaigns/yours.yaml" in _git(repo, "ls-files", "--others", "--exclude-standard")
    assert evidence.git_state(repo) == clean  # still clean: the same id, nothing recomputed


def test_git_state_dirty_hash_follows_the_code_only(repo):
    (repo / "engine/model.py").write_text("x = 2\n")
    dirty = evidence.git_state(repo)
    assert dirty["dirty"] is not None
    _notes_and_campaigns(repo)
    assert evidence.git_state(repo) == dirty  # the notes do not move the hash either


def test_source_globs_match_the_git_pathspecs(repo):
    # the same files, named by pathlib's glob (no git) and by git's pathspecs (tracked files)
    assert evidence.SOURCE_PATHSPECS == tuple(f":(glob){g}" for g in evidence.SOURCE_GLOBS)
    expected = sorted(SOURCE)
    assert evidence.source_files(repo) == expected
    assert sorted(_git(repo, "ls-files", "--", *evidence.SOURCE_PATHSPECS).splitlines()) == expected
    for g in evidence.SOURCE_GLOBS:  # every pattern is exercised by the tree above
        assert list(repo.glob(g)), g


@pytest.mark.parametrize("rel", [*SOURCE, *NOT_SOURCE])
def test_source_rule_is_the_same_with_and_without_git(repo, tmp_path, rel):
    counts = rel in SOURCE
    # tracked, edited
    (repo / rel).write_text((repo / rel).read_text() + "#\n")
    assert (evidence.git_state(repo)["dirty"] is not None) is counts
    _git(repo, "checkout", "--", rel)
    assert evidence.git_state(repo)["dirty"] is None
    # untracked (new)
    _git(repo, "rm", "-q", "--cached", rel)
    _git(repo, "commit", "-q", "-m", f"untrack {rel}")
    assert (evidence.git_state(repo)["dirty"] is not None) is counts
    # no git at all: the source hash, over the same files
    plain = tmp_path / "plain"
    _write_tree(plain, {**SOURCE, **NOT_SOURCE})
    before = evidence.git_state(plain)
    assert before["commit"] is None and before["dirty"] == evidence.source_hash(plain)
    (plain / rel).write_text((plain / rel).read_text() + "#\n")
    assert (evidence.git_state(plain)["dirty"] != before["dirty"]) is counts


def test_git_state_not_a_repo(tmp_path, no_git_env):
    d = tmp_path / "plain"
    _write_tree(d, {**SOURCE, **NOT_SOURCE})
    first = evidence.git_state(d)
    assert first["commit"] is None and len(first["dirty"]) == 64  # the code itself names the id
    (d / "engine" / "model.py").write_text("x = 2\n")
    assert evidence.git_state(d)["dirty"] != first["dirty"]
    before = evidence.git_state(d)["dirty"]
    (d / "notes.txt").write_text("not code")
    _notes_and_campaigns(d)
    assert evidence.git_state(d)["dirty"] == before
    (d / "engine" / "new.py").write_text("x = 1\n")  # a new source file counts
    assert evidence.git_state(d)["dirty"] != before


def test_git_state_exported_tree_names_its_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setenv("EVIDENT_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("EVIDENT_GIT_DIRTY", "b" * 64)
    assert evidence.git_state(tmp_path) == {"commit": "a" * 40, "dirty": "b" * 64}


# --- evidence ids --------------------------------------------------------------------------

ID_RE = re.compile(r"^(?P<commit>[0-9a-f]{7})(-dirty(?P<dirty>[0-9a-f]{8}))?-c(?P<config>[0-9a-f]{8})-r(?P<repeat>\d+)$")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = {"campaign": "tiny", "dtype": "float32", "repeat": 1}


def test_evidence_id_clean_format():
    eid = evidence.evidence_id({"commit": COMMIT, "dirty": None}, CONFIG, 1)
    m = ID_RE.match(eid)
    assert m, eid
    assert m["commit"] == COMMIT[:7]
    assert m["dirty"] is None and "dirty" not in eid
    assert m["config"] == evidence.config_hash(CONFIG)[:8]
    assert m["repeat"] == "1"
    assert eid == f"0123456-c{evidence.config_hash(CONFIG)[:8]}-r1"


def test_evidence_id_dirty_format():
    dirty = "fedcba9876543210" * 4
    eid = evidence.evidence_id({"commit": COMMIT, "dirty": dirty}, CONFIG, 3)
    m = ID_RE.match(eid)
    assert m, eid
    assert m["dirty"] == dirty[:8]
    assert eid == f"0123456-dirtyfedcba98-c{evidence.config_hash(CONFIG)[:8]}-r3"


def test_evidence_id_changes_with_config_repeat_and_code():
    git = {"commit": COMMIT, "dirty": None}
    base = evidence.evidence_id(git, CONFIG, 1)
    assert evidence.evidence_id(git, dict(CONFIG), 1) == base  # same code + config -> same dir
    assert evidence.evidence_id(git, {**CONFIG, "dtype": "bfloat16"}, 1) != base
    assert evidence.evidence_id(git, CONFIG, 2) != base
    assert evidence.evidence_id({"commit": "f" * 40, "dirty": None}, CONFIG, 1) != base
    assert evidence.evidence_id({"commit": COMMIT, "dirty": "a" * 64}, CONFIG, 1) != base


def test_evidence_id_from_real_repo(repo):
    clean = evidence.evidence_id(evidence.git_state(repo), CONFIG, 1)
    assert ID_RE.match(clean) and "-dirty" not in clean
    (repo / "engine/model.py").write_text("x = 2\n")
    dirty = evidence.evidence_id(evidence.git_state(repo), CONFIG, 1)
    assert ID_RE.match(dirty) and "-dirty" in dirty
    assert dirty.split("-")[0] == clean.split("-")[0]


def test_evidence_id_without_git():
    eid = evidence.evidence_id({"commit": None, "dirty": None}, CONFIG, 1)
    assert ID_RE.match(eid)


# --- stage records -------------------------------------------------------------------------


def test_stage_ok_record(tmp_path):
    with evidence.Stage(tmp_path, "oracle", params={"dtype": "float32"}) as st:
        st.write_json("oracle/hf.json", {"cases": []})
        (tmp_path / "extra.txt").write_text("x")
        st.add_file(tmp_path / "extra.txt")
        st.metrics["tokens"] = 64.0
        st.tags["parity.verdict"] = "all_token_text_exact"
    rec = evidence.read_json(tmp_path / "stages" / "oracle.json")
    assert rec["name"] == "oracle"
    assert rec["status"] == "ok"
    assert "error" not in rec
    assert rec["params"] == {"dtype": "float32"}
    assert rec["metrics"] == {"tokens": 64.0}
    assert rec["tags"] == {"parity.verdict": "all_token_text_exact"}
    assert rec["files"] == ["extra.txt", "oracle/hf.json"]  # relative, posix, sorted
    assert evidence.read_json(tmp_path / "oracle" / "hf.json") == {"cases": []}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["started_utc"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["finished_utc"])
    assert rec["seconds"] >= 0
    assert [r["name"] for r in evidence.stage_records(tmp_path)] == ["oracle"]


def test_stage_failure_recorded_and_reraised(tmp_path):
    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom, match="kernel exploded"):
        with evidence.Stage(tmp_path, "bench", params={"batch": 8}) as st:
            st.metrics["partial"] = 1.0
            raise Boom("kernel exploded")
    rec = evidence.read_json(tmp_path / "stages" / "bench.json")
    assert rec["status"] == "failed"
    assert "Boom" in rec["error"] and "kernel exploded" in rec["error"]
    assert rec["params"] == {"batch": 8}
    assert os.listdir(tmp_path / "stages") == ["bench.json"]  # no temp file


def test_stage_failure_overwrites_previous_ok(tmp_path):
    with evidence.Stage(tmp_path, "parity-single-b1"):
        pass
    assert evidence.read_json(tmp_path / "stages" / "parity-single-b1.json")["status"] == "ok"
    with pytest.raises(ValueError):
        with evidence.Stage(tmp_path, "parity-single-b1"):
            raise ValueError("second run failed")
    rec = evidence.read_json(tmp_path / "stages" / "parity-single-b1.json")
    assert rec["status"] == "failed" and "second run failed" in rec["error"]


def test_stage_interrupt_is_recorded_as_interrupted_not_failed(tmp_path):
    """A Ctrl-C (KeyboardInterrupt) or a SIGTERM inside a stage: `interrupted`, with the signal, and re-raised."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with evidence.Stage(tmp_path, "quality"):
            raise KeyboardInterrupt
    rec = evidence.read_json(tmp_path / "stages" / "quality.json")
    assert (rec["status"], rec["reason"]) == (evidence.INTERRUPTED, "KeyboardInterrupt") and "error" not in rec
    with pytest.raises(evidence.Interrupted):
        with evidence.Stage(tmp_path, "bench-single"):
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, as the stage runs
            signal.pause()  # not reached
    rec = evidence.read_json(tmp_path / "stages" / "bench-single.json")
    assert (rec["status"], rec["reason"]) == (evidence.INTERRUPTED, "SIGTERM")
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the stage's only while it runs


def test_stage_add_file_outside_dir_rejected(tmp_path):
    (tmp_path / "ev").mkdir()
    (tmp_path / "outside.txt").write_text("x")
    with pytest.raises(ValueError):
        with evidence.Stage(tmp_path / "ev", "s") as st:
            st.add_file(tmp_path / "outside.txt")
    assert evidence.read_json(tmp_path / "ev" / "stages" / "s.json")["status"] == "failed"


# --- manifest ------------------------------------------------------------------------------


def test_write_manifest(tmp_path):
    files = {
        "config.yaml": b"campaign: tiny\n",
        "oracle/hf.json": b'{"cases": []}\n',
        "parity/single-b1.json": b"{}\n",
        "stages/oracle.json": b'{"status": "ok"}\n',
        "bench/deep/x.bin": bytes(range(256)) * 3,
    }
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    (tmp_path / ".hidden").write_text("not evidence")
    (tmp_path / "oracle" / ".hf.json.abc.tmp").write_text("half-written temp")
    (tmp_path / "MANIFEST.json").write_text('{"stale": true}')  # a previous seal is not listed

    p = evidence.write_manifest(tmp_path, {"evidence_id": "0123456-c89abcdef-r1", "campaign": "tiny"})
    assert p == tmp_path / "MANIFEST.json"
    m = evidence.read_json(p)
    assert m["schema_version"] == evidence.SCHEMA_VERSION == 1
    assert m["evidence_id"] == "0123456-c89abcdef-r1" and m["campaign"] == "tiny"
    assert "stale" not in m
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["sealed_utc"])
    assert set(m["files"]) == set(files)
    for rel, data in files.items():
        assert m["files"][rel] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert sorted(os.listdir(tmp_path)) == sorted([".hidden", "MANIFEST.json", "bench", "config.yaml", "oracle", "parity", "stages"])


def test_manifest_detects_changed_file(tmp_path):
    (tmp_path / "a.json").write_text("1")
    first = evidence.read_json(evidence.write_manifest(tmp_path, {}))["files"]["a.json"]["sha256"]
    (tmp_path / "a.json").write_text("2")
    second = evidence.read_json(evidence.write_manifest(tmp_path, {}))["files"]["a.json"]["sha256"]
    assert first != second
