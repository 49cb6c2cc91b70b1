"""The evidence directory as code (workflow/core/layout.py): no production file spells an evidence path itself, and
docs/evidence.md's table is layout's own print."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from evident.workflow.core import layout

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "workflow").rglob("*.py"), *(ROOT / "workflow/rules").glob("*.smk"), ROOT / "Snakefile",
                  *(ROOT / "engine").rglob("*.py"), *(ROOT / "tools").glob("*.py")])
OWNER = ROOT / "workflow/core/layout.py"

# A path into the directory: one of its folders, or a file at its top, at the string's start or right after `/` or
# an f-string's field (`f"{E}/logs/x.log"`). A mention in prose ("has no SUMMARY.md") is not a path.
_FOLDERS = sorted({p.split("/")[0] for p, _, _ in layout.FILES if "/" in p})
_TOP = sorted(p for p, _, _ in layout.FILES if "/" not in p)
PATH = re.compile(r"(?:^|[/}])(?:(?:%s)/|(?:%s)$)" % ("|".join(map(re.escape, _FOLDERS)), "|".join(map(re.escape, _TOP))))
# what is not the evidence directory's though it reads alike: module paths and globs of them, the campaign and profile
# files, the run state in .evident/
NOT_EVIDENCE = re.compile(r"[\w./*-]*\.py\b|config/config\.yaml|profiles/\w+/config\.yaml|config/models/|\.evident/\S*")


def _docstrings(tree) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _strings(tree):
    """Every string constant of ``tree`` but docstrings, an f-string's parts joined with `{}` for its fields."""
    skip = _docstrings(tree)
    inside = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and id(node) not in inside):
            yield node.lineno, node.value


def literals(path: Path):
    """(line, string) of every string literal in a Python file, or in a Snakemake file's Python tokens."""
    text = path.read_text()
    if path.suffix == ".py":
        yield from sorted(_strings(ast.parse(text, str(path))))
        return
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            for _, s in _strings(ast.parse(tok.string.strip(), mode="eval")):
                yield tok.start[0], s


def evidence_paths(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {s!r}" for line, s in literals(path)
            if PATH.search(NOT_EVIDENCE.sub("", s))]


def test_no_evidence_path_is_spelled_outside_layout():
    found = [hit for p in SOURCES if p != OWNER for hit in evidence_paths(p)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_planted_path(tmp_path):
    planted = tmp_path / "stage.py"
    planted.write_text('"""Writes parity/comparison.json (a docstring: prose)."""\n'
                       'E = "x"\nA = f"{E}/logs/oracle.log"\nB = root / "env.json"\nC = "bench/summary.csv"\n'
                       'D = "see workflow/bench/floor.py and config/config.yaml"\nF = "no SUMMARY.md yet"\n')
    rules = tmp_path / "x.smk"
    rules.write_text('rule a:\n    output:\n        f"{E}/oracle/hf.json",\n    log:\n        "elsewhere.log"\n')
    assert [s for _, s in literals(planted) if PATH.search(NOT_EVIDENCE.sub("", s))] == [
        "{}/logs/oracle.log", "env.json", "bench/summary.csv"]
    assert [s for _, s in literals(rules) if PATH.search(NOT_EVIDENCE.sub("", s))] == ["{}/oracle/hf.json"]


def test_docs_evidence_table_is_layouts_print():
    doc = (ROOT / "docs/evidence.md").read_text()
    assert layout.markdown() in doc, "docs/evidence.md's path table is out of date: paste " \
                                     "`python -m evident.workflow.core.layout` over it"


@pytest.mark.parametrize("path", [p for p, _, _ in layout.FILES])
def test_every_contract_path_is_relative_and_posix(path):
    assert not path.startswith("/") and "\\" not in path and ".." not in path.split("/")
