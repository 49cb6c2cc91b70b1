"""The docs hold: README.md is a short front door, docs/campaigns.md's key table is config/schema.yaml's keys
exactly, every relative link resolves, and ARCHITECTURE.md's tables keep a line a cell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ARCHITECTURE = REPO / "ARCHITECTURE.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
CAMPAIGNS = REPO / "docs" / "campaigns.md"
SCHEMA = REPO / "config" / "schema.yaml"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[\])?(\.[A-Za-z_][A-Za-z0-9_]*(\[\])?)*$")


def schema_keys(node: dict, prefix: str = "") -> dict[str, bool]:
    """Every key path of a JSON schema, `a.b.c`, with `[]` after an array whose items are objects
    (`engines[].serve.command`), mapped to whether it is a leaf (has no keys under it). Follows `properties`,
    `items` and the alternatives of `oneOf`/`anyOf`; `if`/`then` only restate keys, and `$ref` is not used."""
    keys: dict[str, bool] = {}
    for alt in [node, *node.get("oneOf", []), *node.get("anyOf", [])]:
        for name, sub in (alt.get("properties") or {}).items():
            path = f"{prefix}{name}"
            below = schema_keys(sub, path + ".")
            keys[path] = keys.get(path, True) and not below
            keys.update(below)
    items = node.get("items")
    if isinstance(items, dict) and prefix:
        keys.update(schema_keys(items, prefix[:-1] + "[]."))
    return keys


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of level 2 or 1."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert m, f"no section '## {heading}'"
    return m.group(1)


def table_keys(text: str) -> list[str]:
    """The backticked keys in the first cell of every table row of `text` (header and rule rows left out)."""
    keys = []
    for line in text.splitlines():
        if not line.startswith("|") or re.match(r"^\|\s*(key|-+)\s*\|", line):
            continue
        first = line[1:].split(" | ", 1)[0]
        keys += [k for k in re.findall(r"`([^`]+)`", first) if KEY.match(k)]
    return keys


def test_the_schema_walk_sees_nested_keys_and_array_items():
    schema = yaml.safe_load(SCHEMA.read_text())
    keys = schema_keys(schema)
    assert keys["bench.http.concurrency"] is True
    assert keys["bench.http"] is False
    assert keys["engines[].serve.command"] is True
    assert keys["quality.targets[].url"] is True
    assert "checkpoint.config.compress_rates.heavily_compressed_attention" in keys


def test_the_campaigns_key_table_is_the_schemas_keys():
    schema = schema_keys(yaml.safe_load(SCHEMA.read_text()))
    documented = table_keys(section(CAMPAIGNS.read_text(), "Keys"))
    unknown = sorted(set(documented) - set(schema))
    assert not unknown, f"docs/campaigns.md's key table names keys config/schema.yaml does not have: {unknown}"
    missing = sorted(k for k, leaf in schema.items() if leaf and k not in documented)
    assert not missing, f"config/schema.yaml keys missing from docs/campaigns.md's key table: {missing}"


def test_the_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines: move the detail into docs/"
    wide = [f"{i}: {len(line)}" for i, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"README.md lines over 100 columns: {wide}"


def test_the_readme_links_architecture_and_every_docs_page():
    targets = {t.split("#")[0] for t in LINK.findall(FENCE.sub("", README.read_text()))}
    wanted = {"ARCHITECTURE.md", *(f"docs/{p.name}" for p in DOCS)}
    assert not wanted - targets, f"README.md does not link {sorted(wanted - targets)}"


@pytest.mark.parametrize("page", [README, ARCHITECTURE, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor within the page
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_docs_page_starts_by_saying_what_it_is(page):
    text = page.read_text()
    first = text.split("\n\n", 2)[1] if text.startswith("# ") else ""
    assert first.startswith("What this page is"), f"docs/{page.name}: its first paragraph should say what it is"


def test_architecture_tables_keep_a_line_a_cell():
    long = [f"{i}: {len(line)}" for i, line in enumerate(ARCHITECTURE.read_text().splitlines(), 1)
            if line.startswith("|") and len(line) > 200]
    assert not long, f"ARCHITECTURE.md table rows over 200 characters (move the detail to docs/): {long}"
