"""Secrets and private names in evidence: the scan that runs before a directory is sealed.

Evidence is pasted into pull requests and replayed into a shared MLflow store, so it must carry no
credential (a Hugging Face token, a `password=...`), no home directory (`/home/<user>`, `/root`,
`/Users/<user>`) and neither this machine's host name nor the user name. Stage logs are raw tool
output: `seal` scrubs the expected paths and names out of them first (`scrub`), then scans every
file with `scan_dir`; any hit fails the seal, naming `file:line: what`, and no manifest is written.
The profile stage scrubs its capture and trace the same way.

Pure functions over text; nothing here imports MLflow or the engine.
"""

from __future__ import annotations

import getpass
import gzip
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from evident.workflow.core.evidence import sha256_bytes

# Generic words that are no evidence of anything when they occur as a word ("root" is a user name
# too, but also a tree's root): a user or host name is only scanned for when it is distinctive.
GENERIC_NAMES = {"root", "user", "admin", "ubuntu", "debian", "runner", "guest", "test", "nobody", "app",
                 "jenkins", "localhost", "host", "node", "worker", "main", "build", "docker", "default"}
MIN_NAME_CHARS = 4
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".safetensors", ".bin", ".pt", ".npz", ".zip"}

PATTERNS: list[tuple[str, re.Pattern]] = [
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("a credential assignment", re.compile(
        r"(?i)\b(?:token|secret|password|passwd|api[_-]?key|access[_-]?key)['\"]?\s*[=:]\s*['\"]?([^\s'\"]{8,})")),
    ("a home directory path", re.compile(r"/home/[A-Za-z0-9._-]+")),
    ("a macOS home directory path", re.compile(r"/Users/[A-Za-z0-9._-]+")),
    ("the root home directory path", re.compile(r"(?<![\w.~-])/root(?![\w.-])")),
]


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    what: str
    excerpt: str  # the hit masked: a report must not repeat the secret it found

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what} ({self.excerpt})"


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's uid) and no LOGNAME/USER
        return None


def scrub(text: str) -> str:
    """This machine's home directory -> `~`, then its user and host names, as words, -> `<user>`, `<host>`.
    Names of fewer than two characters are left: they would replace letters."""
    home = str(Path.home())
    if len(home) > 1:
        text = text.replace(home, "~")
    for name, repl in ((_user(), "<user>"), (socket.gethostname(), "<host>")):
        if name and len(name) > 1:
            text = re.sub(rf"(?<!\w){re.escape(name)}(?!\w)", repl, text)
    return text


def redact_path(value: str) -> str:
    """A path becomes its last part plus a hash of the whole: distinct, yet no home or user name."""
    return f"<path>/{os.path.basename(os.path.normpath(value))}#{sha256_bytes(value.encode())[:8]}"


def redact_words(words: list[str]) -> list[str]:
    """A command's words with each absolute path redacted (redact_path)."""
    return [redact_path(w) if w.startswith("/") else w for w in words]


SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL", re.IGNORECASE)


def redact_env(env: dict) -> dict:
    """Environment variables as evidence records them: a secret's name keeps a hash of its value only; a path is
    redacted."""
    return {k: f"<secret>#{sha256_bytes(v.encode())[:8]}" if SECRET_NAME.search(k) else
            redact_path(v) if v.startswith("/") else v for k, v in env.items()}


def scrub_json(value):
    """`scrub` over a JSON value's text (names not \\u-escaped, so that they match), parsed back."""
    return json.loads(scrub(json.dumps(value, ensure_ascii=False)))


def _distinctive(name: str | None) -> bool:
    return bool(name) and len(name) >= MIN_NAME_CHARS and name.lower() not in GENERIC_NAMES


def machine_patterns(host: str | None = None, user: str | None = None) -> list[tuple[str, re.Pattern]]:
    """This machine's host and user names, as words, when they are distinctive enough to mean something."""
    if host is None:
        host = socket.gethostname()
    if user is None:
        user = _user()
    out = []
    for what, name in (("the host name", host), ("the user name", user)):
        if _distinctive(name):
            out.append((what, re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", re.IGNORECASE)))
        short = (name or "").split(".")[0]
        if what == "the host name" and short != name and _distinctive(short):
            out.append((what, re.compile(rf"(?<![\w.-]){re.escape(short)}(?![\w-])", re.IGNORECASE)))
    return out


def _mask(text: str) -> str:
    return text[:4] + "…" if len(text) > 4 else "…"


def scan_text(text: str, file: str = "<text>", patterns: list[tuple[str, re.Pattern]] | None = None) -> list[Finding]:
    pats = PATTERNS + (machine_patterns() if patterns is None else patterns)
    found = []
    for no, line in enumerate(text.splitlines(), 1):
        seen = set()
        for what, pat in pats:
            m = pat.search(line)
            if m and what not in seen:  # one finding per kind and line (a host's full and short name overlap)
                seen.add(what)
                found.append(Finding(file, no, what, _mask(m.group(0))))
    return found


def is_binary(path: Path, head: bytes) -> bool:
    return path.suffix.lower() in BINARY_SUFFIXES or b"\0" in head


def scan_dir(root: str | Path, patterns: list[tuple[str, re.Pattern]] | None = None) -> list[Finding]:
    """Every text file under root (hidden temp files of atomic writes too), in path order.

    Binary files (plots, weights) are skipped: compressed bytes match short words by chance and
    carry no text a person wrote.
    """
    root = Path(root)
    pats = machine_patterns() if patterns is None else patterns
    found = []
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        data = p.read_bytes()
        if p.suffix == ".gz":  # a compressed text file (a profiler trace): its text is scanned
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError):
                pass
        if is_binary(p, data[:8192]):
            continue
        found += scan_text(data.decode("utf-8", errors="replace"), p.relative_to(root).as_posix(), pats)
    return found
