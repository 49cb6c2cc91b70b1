"""The HTML the archive is written in (workflow/archive/pages.py, workflow/archive/trend_page.py): one page shell with inline CSS,
every text escaped, relative links, badges toned by what a value says, plain tables; and the mark that tells the
pages written here from any other file, so that only ours are ever removed.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

PAGES = "_pages"
"""Every page, under the archive root: `_pages/<campaign>/<id>.html`, `_pages/_trends/<campaign>.html`."""
GENERATOR = "evident archive"
"""Marks the pages written here, so that a page whose directory is gone can be removed safely."""

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 0; background: #f6f8fa; }
main { max-width: 1320px; margin: 0 auto; padding: 20px 28px 48px; background: #fff; min-height: 100vh; }
h1 { font-size: 24px; margin: 4px 0 10px; word-break: break-all; } h2 { font-size: 19px; margin-top: 30px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
h3, h4 { font-size: 16px; margin-top: 22px; } nav { font-size: 13px; color: #57606a; } nav a { color: #0969da; }
a { color: #0969da; text-decoration: none; } a:hover { text-decoration: underline; }
table { border-collapse: collapse; margin: 8px 0 14px; font-size: 13px; } th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } tr:nth-child(even) td { background: #fbfcfd; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, monospace; background: #eff1f3; padding: 1px 4px; border-radius: 4px; }
.badge { display: inline-block; font-size: 12px; padding: 1px 8px; border-radius: 10px; margin: 1px 4px 1px 0; border: 1px solid; white-space: nowrap; }
.good { background: #dafbe1; color: #116329; border-color: #4ac26b; } .warn { background: #fff8c5; color: #7d4e00; border-color: #d4a72c; }
.bad { background: #ffebe9; color: #a40e26; border-color: #ff8182; } .neutral { background: #eff1f3; color: #57606a; border-color: #d0d7de; }
.index { overflow-x: auto; } .index td:nth-child(-n+4) { white-space: nowrap; } figure { margin: 10px 0; } img { max-width: 100%; border: 1px solid #d0d7de; } .muted { color: #57606a; font-size: 13px; }
"""

BAD = ("fail", "regression", "gap", "mismatch", "slower", "spill", "missing", "changed")
WARN = ("near_tie", "pending", "unsealed", "running", "interrupted", "skipped", "noisy", "no directional", "unknown", "not in manifest")
GOOD = ("exact", "ok", "pass", "logged", "synced", "sealed", "faster")


class Raw(str):
    """Markup that is already escaped."""


def esc(value) -> str:
    return value if isinstance(value, Raw) else html.escape("" if value is None else str(value))


def url(rel: str) -> str:
    return quote(rel, safe="/#:?=&")


def link(rel: str, text) -> Raw:
    return Raw(f'<a href="{esc(url(rel))}">{esc(text)}</a>')


def tone(value) -> str:
    v = str(value).lower()
    for name, words in (("bad", BAD), ("warn", WARN), ("good", GOOD)):
        if any(w in v for w in words):
            return name
    return "neutral"


def badge(value, text=None) -> Raw:
    return Raw(f'<span class="badge {tone(value)}">{esc(value if text is None else text)}</span>')


def table(header: list, rows: list[list], numeric: set[int] = frozenset()) -> Raw:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{esc(c)}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return Raw(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="{GENERATOR}"><title>{esc(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><main>\n{body}\n</main></body></html>\n")


def ours(path: Path) -> bool:
    """A page written here (GENERATOR in its head), so one that may be removed."""
    return GENERATOR in path.read_text(errors="replace")[:600]
