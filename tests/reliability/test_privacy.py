"""Secrets and private names: the scan `seal` runs before sealing (workflow/core/privacy.py), each leak planted."""

from __future__ import annotations

import json

import handbuilt
import pytest

from evident.workflow.core import privacy
from evident.workflow.core.layout import MANIFEST
from evident.workflow.stages import seal

TOKEN = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dF"
PLANTS = {
    "a Hugging Face token": f"HF_TOKEN={TOKEN}",
    "a credential assignment": "api_key: sk-live-4f9a8b7c6d5e",
    "a home directory path": "loaded /home/alice/models/x.safetensors",
    "a macOS home directory path": "cache at /Users/bob/Library/Caches",
    "the root home directory path": "reading /root/.cache/huggingface/hub",
    "the host name": "ran on gpu-node-17.cluster.example",
    "the user name": "started by alice42 at noon",
}
MACHINE = dict(host="gpu-node-17.cluster.example", user="alice42")


@pytest.fixture
def unsealed(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy.socket, "gethostname", lambda: MACHINE["host"])
    monkeypatch.setattr(privacy.getpass, "getuser", lambda: MACHINE["user"])
    monkeypatch.setattr(seal, "render", lambda root, git: "## Evidence\n")  # the summary needs a real oracle file
    monkeypatch.setattr(seal, "render_details", lambda root: "## Details\n")  # and so do its details
    return handbuilt.build(tmp_path / "evidence", "tiny", "aaaaaaa-c11111111-r1", seal=False, plot=False)


def test_a_clean_directory_has_no_finding(unsealed):
    assert privacy.scan_dir(unsealed) == []


@pytest.mark.parametrize("what", sorted(PLANTS))
def test_each_planted_leak_is_found_naming_file_and_line(unsealed, what):
    log = unsealed / "logs" / "oracle.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("line one\nline two\n" + PLANTS[what] + "\n")
    found = privacy.scan_dir(unsealed)
    assert [(f.file, f.line) for f in found if f.what == what] == [("logs/oracle.log", 3)], found
    assert all(TOKEN not in str(f) and "alice42" not in str(f) for f in found)  # the report masks the value


@pytest.mark.parametrize("what", sorted(PLANTS))
def test_seal_refuses_and_writes_no_manifest(unsealed, what, capsys):
    """Planted in an evidence file (not a log: seal scrubs the expected paths and names out of logs)."""
    rec = json.loads((unsealed / "stages/compare.json").read_text())
    rec["params"]["note"] = PLANTS[what]
    (unsealed / "stages/compare.json").write_text(json.dumps(rec, indent=2))
    with pytest.raises(SystemExit) as e:
        seal.main(["--evidence", str(unsealed), "--no-tracking"])
    assert "refusing to seal" in str(e.value) and "stages/compare.json:" in str(e.value) and what in str(e.value)
    assert not (unsealed / MANIFEST).exists()


def test_seal_scrubs_expected_paths_in_logs_then_seals(unsealed, monkeypatch):
    monkeypatch.setattr(seal.Path, "home", classmethod(lambda cls: seal.Path("/home/alice42")))
    log = unsealed / "logs" / "parity-single.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("loading /home/alice42/ckpt on gpu-node-17.cluster.example as alice42\n")
    seal.main(["--evidence", str(unsealed), "--no-tracking"])
    assert (unsealed / MANIFEST).is_file()
    assert log.read_text() == "loading ~/ckpt on <host> as <user>\n"


def test_scrub_replaces_home_and_names_as_words(monkeypatch):
    monkeypatch.setattr(privacy.Path, "home", classmethod(lambda cls: privacy.Path("/home/alice42")))
    monkeypatch.setattr(privacy.getpass, "getuser", lambda: "alice42")
    monkeypatch.setattr(privacy.socket, "gethostname", lambda: "gpu-node-17.cluster.example")
    text = "/home/alice42/ckpt /tmp/alice42/x by alice42, not alice421 or malice42; on gpu-node-17.cluster.example"
    assert privacy.scrub(text) == "~/ckpt /tmp/<user>/x by <user>, not alice421 or malice42; on <host>"
    assert privacy.scrub_json({"path": "/home/alice42/é", "user": ["alice42"]}) == {"path": "~/é", "user": ["<user>"]}


def test_scrub_leaves_names_too_short_to_mean_anything(monkeypatch):
    monkeypatch.setattr(privacy.Path, "home", classmethod(lambda cls: privacy.Path("/")))
    monkeypatch.setattr(privacy.getpass, "getuser", lambda: "a")
    monkeypatch.setattr(privacy.socket, "gethostname", lambda: "")
    assert privacy.scrub("a path /a/b: a word") == "a path /a/b: a word"


def test_generic_words_and_hashes_are_not_findings():
    clean = "\n".join([
        '"token_sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",',
        '"oracle_token": 1234567890, "prompt_tokens": 12345678',
        "the root of the tree; root cause; root mean square",
        "max_new_tokens: 32", "hf_hub_download(repo_id=...)", "/srv/rootfs/x ~/root",
    ])
    assert privacy.scan_text(clean, patterns=privacy.machine_patterns(host="vm", user="root")) == []
    # short or generic machine names are not scanned for as words; distinctive ones are
    assert privacy.machine_patterns(host="vm", user="root") == []
    assert len(privacy.machine_patterns(host="gpu-node-17.cluster.example", user="alice42")) == 3


def test_seal_removes_temp_files_left_by_a_killed_atomic_write(unsealed):
    tmp = unsealed / "parity" / ".comparison.json.k1ll3d.tmp"
    tmp.write_text('{"verdict": "all_tok')  # what a write killed before its rename leaves
    seal.main(["--evidence", str(unsealed), "--no-tracking"])
    assert not tmp.exists() and "parity/.comparison.json.k1ll3d.tmp" not in json.loads((unsealed / MANIFEST).read_text())["files"]
