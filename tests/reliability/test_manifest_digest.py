"""Integrity: `evident verify --all` passes on a fresh archive and catches every hand-made damage, the
manifest's own edits included (its `manifest_sha256`)."""

from __future__ import annotations

import json
import shutil

import handbuilt
import pytest

from evident.workflow import cli
from evident.workflow.archive import archive
from evident.workflow.core.evidence import DIGEST, manifest_digest, sha256_file
from evident.workflow.core.layout import MANIFEST


@pytest.fixture
def arch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "evidence"
    handbuilt.build(root, "tiny", "aaaaaaa-c11111111-r1", plot=False)
    handbuilt.build(root, "tiny", "bbbbbbb-c22222222-r1", plot=False)
    return root


def verify_all(root, capsys) -> tuple[int, str]:
    code = cli.main(["--root", str(root), "verify", "--all"])
    return code, capsys.readouterr().out


def edit_manifest(ev, fn):
    m = json.loads((ev / MANIFEST).read_text())
    fn(m)
    (ev / MANIFEST).write_text(json.dumps(m, indent=2))


DAMAGES = {
    "a byte of a file": lambda ev: (ev / "parity/comparison.json").write_bytes(
        (ev / "parity/comparison.json").read_bytes().replace(b"exact", b"exacT")),
    "a file deleted": lambda ev: (ev / "env.json").unlink(),
    "a file added": lambda ev: (ev / "parity/extra.json").write_text("{}"),
    "a file truncated": lambda ev: (ev / "SUMMARY.md").write_text(""),
    "the verdict edited in the manifest": lambda ev: edit_manifest(ev, lambda m: m.update(verdict="all_token_text_exact!")),
    "a file and its manifest hash edited together": lambda ev: (
        (ev / "config.yaml").write_text("campaign: tiny\n"),
        edit_manifest(ev, lambda m: m["files"]["config.yaml"].update(
            sha256=sha256_file(ev / "config.yaml"), size=(ev / "config.yaml").stat().st_size))),
    "a file dropped from the manifest with the file": lambda ev: (
        (ev / "env.json").unlink(), edit_manifest(ev, lambda m: m["files"].pop("env.json"))),
    "the manifest truncated": lambda ev: (ev / MANIFEST).write_text((ev / MANIFEST).read_text()[:100]),
    "the manifest deleted": lambda ev: (ev / MANIFEST).unlink(),
    "the directory renamed": lambda ev: ev.rename(ev.with_name("aaaaaaa-c99999999-r1")),
}


def test_a_fresh_archive_verifies(arch, capsys):
    code, out = verify_all(arch, capsys)
    assert code == 0 and out.count("ok    ") == 2, out
    m = json.loads((arch / "tiny/aaaaaaa-c11111111-r1" / MANIFEST).read_text())
    assert m[DIGEST] == manifest_digest(m)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_every_hand_made_damage_is_caught(arch, capsys, damage):
    ev = arch / "tiny/aaaaaaa-c11111111-r1"
    DAMAGES[damage](ev)
    code, out = verify_all(arch, capsys)
    bad = [line for line in out.splitlines() if not line.startswith(("ok ", "skip "))]
    if damage == "the manifest deleted":  # an unsealed directory: --all lists it as not sealed ...
        assert "skip  tiny/aaaaaaa-c11111111-r1: not sealed" in out
        code = cli.main(["--root", str(arch), "verify", "aaaaaaa"])  # ... and naming it fails
        assert code == 1 and "not sealed" in capsys.readouterr().out
        return
    assert code == 1 and len(bad) == 1 and bad[0].startswith("FAIL  tiny/aaaaaaa-c"), out
    assert "ok    tiny/bbbbbbb-c22222222-r1" in out  # the intact neighbour still passes


def test_a_manifest_from_before_the_digest_still_verifies(arch, capsys):
    ev = arch / "tiny/aaaaaaa-c11111111-r1"
    edit_manifest(ev, lambda m: m.pop(DIGEST))
    assert archive.intact(archive.verify(ev))
    (ev / "env.json").write_text("{}")  # its files are still checked
    assert archive.verify(ev)["changed"] == ["env.json"]


def test_verify_names_what_is_wrong(arch):
    ev = arch / "tiny/aaaaaaa-c11111111-r1"
    edit_manifest(ev, lambda m: m.update(verdict="x"))
    assert archive.verify(ev)["problems"] == [f"{MANIFEST} edited after sealing: its {DIGEST} does not match its content"]
    shutil.rmtree(ev / "parity")
    assert archive.verify(ev)["missing"] == ["parity/comparison.json"]
