"""The static HTML archive, `evidence/index.html` and one page per evidence directory (written by the `archive`
stage after each sealing, and by `evident html` and `evident prune`).

Pages live in `evidence/_pages/<campaign>/<id>.html`, never inside an evidence directory (a sealed
directory's manifest lists every file, so a page written inside would read as tampering) nor beside
one (a campaign's folder holds evidence directories only; `_` starts no campaign name). Plain HTML
with inline CSS, relative links only and every text escaped, so the archive can be moved, served by
any static server or opened from the file system. No local paths or host names are written; the one
exception is an http(s) tracking server, which is where the MLflow links have to point.
The whole archive (every campaign, every id) is rewritten on each run, and with it each campaign's trends
(workflow/archive/trend_page.py): `evidence/_trends/<campaign>.{png,csv}` and the page `_pages/_trends/<campaign>.html`
that shows them, for every campaign with a sealed directory. The HTML itself is workflow/archive/markup.py's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from evident.workflow import tracking
from evident.workflow.archive import archive, trend_page
from evident.workflow.archive.markup import PAGES, Raw, badge, esc, link, ours, page, table, url
from evident.workflow.core.evidence import list_files, write_text
from evident.workflow.core.layout import DETAILS, MANIFEST, SUMMARY

# --- SUMMARY.md and DETAILS.md: the subset of markdown they are written in --------------------

def _inline(text: str) -> str:
    out = esc(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def _safe_rel(src: str) -> bool:
    return not (urlsplit(src).scheme or src.startswith("/") or ".." in Path(src).parts)


def markdown(text: str, base: str, exists) -> tuple[str, set[str]]:
    """Headings, GitHub tables, lists, images and paragraphs, with inline code and bold.

    Image sources are made relative to the page (`base/src`); an image whose file is missing is
    named instead of shown, so no image on a page can fail to load. Returns the markup and the
    images it shows.
    """
    out, shown, para, rows, items = [], set(), [], [], []

    def flush():
        if para:
            out.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if rows:
            cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
            body = [r for r in cells[1:] if not all(set(c) <= set("-: ") for c in r)]
            out.append(table(cells[0], [[Raw(_inline(c)) for c in r] for r in body]))
            rows.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in text.splitlines():
        s = line.strip()
        image = re.fullmatch(r"!\[([^\]]*)\]\(([^)\s]+)\)", s)
        if not s:
            flush()
        elif s.startswith("|"):
            if para or items:
                flush()
            rows.append(s)
        elif m := re.match(r"(#{1,5})\s+(.*)", s):
            flush()
            level = min(len(m.group(1)) + 1, 6)  # the page's own title is the h1
            out.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
        elif image:
            flush()
            alt, src = image.groups()
            if _safe_rel(src) and exists(src):
                shown.add(src)
                out.append(f'<figure><img src="{esc(url(f"{base}/{src}"))}" alt="{esc(alt)}"></figure>')
            else:
                out.append(f"<p class=muted>(image not in the directory: {esc(src)})</p>")
        elif s.startswith(("- ", "* ")):
            if para or rows:
                flush()
            items.append(s[2:])
        elif items and line.startswith("  "):
            items[-1] += " " + s
        else:
            if rows or items:
                flush()
            para.append(s)
    flush()
    return "\n".join(out), shown


# --- MLflow ----------------------------------------------------------------------------------

def ui_base(uri: str | None) -> str | None:
    """The MLflow UI behind an http(s) tracking server, without credentials; None for a local store."""
    if not uri:
        return None
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path.rstrip('/')}"


# MLflow 3's UI opens an experiment on its GenAI overview unless the URL (or the browser's last choice) says
# "Machine learning": then on the runs table (workflow/tracking.py's docstring has what else it offers)
VIEW = "?workflowType=machine_learning"


def run_link(ui: str, track: dict, rid: str, text) -> Raw:
    return link(f"{ui}/#/experiments/{track.get('experiment_id')}/runs/{rid}{VIEW}", text)


def mlflow_section(ev: archive.Evidence, ui: str | None) -> str:
    track = ev.tracking
    status = track.get("status", "unknown")
    exp, parent = track.get("experiment_id"), track.get("parent_run_id")
    if not parent:
        hint = {"pending": "the tracking store was unreachable when this was sealed: `evident sync` replays it",
                "disabled": "tracking was disabled for this campaign", "unsealed": "the directory is not sealed"}
        return f"<p>{badge(status)} {_inline(hint.get(status, 'no MLflow runs recorded'))}</p>"

    def run(rid):
        return run_link(ui, track, rid, rid) if ui else Raw(f"<code>{esc(rid)}</code>")

    rows = [["parent (this directory)", run(parent)]]
    rows += [[f"stage {name}", run(rid)] for name, rid in sorted((track.get("child_run_ids") or {}).items())]
    if ui:
        where = Raw(f"experiment {link(tracking.runs_url(ui, exp), exp)} on the tracking server")
    else:
        where = Raw(_inline(f"experiment `{exp}` in the working directory's MLflow store: run `evident ui` "
                            f"there (the default store is `mlflow.db`) and open experiment `{ev.campaign}`"))
    return f"<p>{badge(status)} {where}</p>\n{table(['run', 'run id'], rows)}"


# --- pages -----------------------------------------------------------------------------------

def page_of(root: Path, ev: archive.Evidence) -> Path:
    return root / PAGES / ev.path.parent.name / f"{ev.id}.html"


def _files(ev: archive.Evidence) -> str:
    """The evidence directory, relative to its page."""
    return f"../../{ev.path.parent.name}/{ev.id}"


def _size(n) -> str:
    return "?" if n is None else f"{n:,} B"


def _disk_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:  # an unsealed directory still being written
        return None


def _gates(ev: archive.Evidence) -> Raw:
    return Raw("".join(badge(v, f"{k}: {v}") for k, v in ev.gates.items()) or "—")


def _metrics(rec: dict) -> str:
    items = sorted((rec.get("metrics") or {}).items())
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:6])
    return shown + (f", … ({len(items) - 6} more)" if len(items) > 6 else "")


def files_section(ev: archive.Evidence) -> str:
    """Every file with a link; one the manifest lists but the disk lacks is flagged, not linked."""
    on_disk = set(list_files(ev.path))
    sealed = (ev.manifest or {}).get("files") or {}
    rows = []
    for rel in sorted(set(sealed) | on_disk):
        f = sealed.get(rel, {})
        size = f.get("size") if rel in sealed else _disk_size(ev.path / rel)
        present = rel in on_disk
        note = badge("missing") if not present else (badge("not in manifest") if ev.sealed and rel not in sealed else "")
        rows.append([link(f"{_files(ev)}/{rel}", rel) if present else rel, _size(size),
                     Raw(f"<code>{esc(f['sha256'][:16])}</code>") if f.get("sha256") else "—", note])
    if ev.sealed:
        rows.append([link(f"{_files(ev)}/{MANIFEST}", MANIFEST), _size((ev.path / MANIFEST).stat().st_size), "—",
                     "seals the rest"])
    note = ("Presence is checked here; <code>evident verify</code> re-hashes every file against the manifest."
            if ev.sealed else "Not sealed: no manifest vouches for these files.")
    return f"<p class=muted>{note}</p>\n{table(['file', 'size', 'sha256 (manifest)', ''], rows, {1})}"


def evidence_page(ev: archive.Evidence, ui: str | None) -> str:
    cfg, env, m = ev.config, ev.env, ev.manifest or {}
    pk = env.get("packages") or {}
    git = m.get("git") or {}
    facts = [
        ["campaign", ev.campaign], ["evidence id", Raw(f"<code>{esc(ev.id)}</code>")],
        ["state", badge(ev.state)], ["created (UTC)", ev.created or "—"], ["sealed (UTC)", m.get("sealed_utc", "—")],
        ["commit", Raw(f"<code>{esc(git.get('commit') or ev.commit)}</code>"
                       + (f" + uncommitted source diff <code>{esc(git['dirty'][:8])}</code>" if git.get("dirty") else ""))],
        ["config sha256", Raw(f"<code>{esc(m.get('config_sha256', '—'))}</code>")],
        ["device / dtype", f"{ev.device} / {cfg.get('dtype', '?')}"],
        ["torch / transformers", f"{pk.get('torch', '?')} / {pk.get('transformers', '?')}"],
    ]
    exists = lambda s: (ev.path / s).is_file()  # noqa: E731
    if exists(SUMMARY):
        summary, shown = markdown((ev.path / SUMMARY).read_text(errors="replace"), _files(ev), exists)
    else:
        summary, shown = f"<p class=muted>No {SUMMARY}: the directory was not sealed.</p>", set()
    details = ""  # the full tables and their plots; a directory sealed before DETAILS.md has all in SUMMARY.md
    if exists(DETAILS):
        details, images = markdown((ev.path / DETAILS).read_text(errors="replace"), _files(ev), exists)
        shown |= images
    # a skipped stage's plot is a placeholder saying why (the overlap screen's): listed under Files, not shown
    skipped = {f for r in ev.records if r.get("status") == "skipped" for f in r.get("files") or []}
    plots = [rel for rel in list_files(ev.path) if rel.endswith(".png") and rel not in shown | skipped]
    figures = "".join(f'<figure><img src="{esc(url(f"{_files(ev)}/{rel}"))}" alt="{esc(rel)}">'
                      f"<figcaption class=muted>{esc(rel)}</figcaption></figure>" for rel in plots)
    stages = table(["stage", "status", "seconds", "metrics", "note"], [
        [r.get("name"), badge(r.get("status", "?")), r.get("seconds", ""), _metrics(r), r.get("error") or r.get("reason") or ""]
        for r in ev.records], {2})
    body = [
        f'<nav>{link("../../index.html", "Evidence archive")} / {esc(ev.campaign)} / {esc(ev.id)}</nav>',
        f"<h1>{esc(ev.id)}</h1>",
        f"<p>{badge(ev.state)} {_gates(ev)} {badge(ev.tracking.get('status', 'unknown'), 'MLflow: ' + ev.tracking.get('status', 'unknown'))}</p>",
        table(["what", "value"], facts),
        "<h2>Summary</h2>", summary,
    ]
    if details:
        body += ["<h2>Details</h2>", details]
    if figures:
        body += ["<h2>Plots</h2>", figures]
    body += ["<h2>Stages</h2>", stages, "<h2>MLflow runs</h2>", mlflow_section(ev, ui),
             "<h2>Files</h2>", files_section(ev)]
    return page(f"{ev.label} — evident", "\n".join(body))


def index_page(entries: list[archive.Evidence], ui: str | None, trends: frozenset[str] = frozenset()) -> str:
    """`trends`: the campaigns with a trends page (trend_page.write_trends), linked under their heading."""
    body = ["<h1>Evidence archive</h1>"]
    campaigns = sorted({e.path.parent.name for e in entries})
    if not entries:
        body.append("<p>No evidence directories yet: <code>make run</code> writes the first one.</p>")
    else:
        body.append(f"<p class=muted>{len(entries)} evidence director{'y' if len(entries) == 1 else 'ies'} in "
                    f"{len(campaigns)} campaign{'' if len(campaigns) == 1 else 's'}, newest first. Each is sealed by its "
                    f"<code>MANIFEST.json</code>; <code>evident verify --all</code> re-hashes every file, "
                    f"<code>evident diff A B</code> compares two.</p>")
        body.append("<p>" + " · ".join(link(f"#{c}", c) for c in campaigns) + "</p>")
    for camp in campaigns:
        rows = []
        for e in (e for e in entries if e.path.parent.name == camp):
            summary = link(f"{camp}/{e.id}/{SUMMARY}", SUMMARY) if (e.path / SUMMARY).is_file() else "—"
            track = badge(e.tracking.get("status", "unknown"))
            if ui and e.tracking.get("parent_run_id"):  # a server is up: the badge opens the parent run
                track = run_link(ui, e.tracking, e.tracking["parent_run_id"], track)
            rows.append([link(f"{PAGES}/{camp}/{e.id}.html", e.id), e.created or "—", Raw(f"<code>{esc(e.commit)}</code>"),
                         f"{e.device} / {e.config.get('dtype', '?')}", _gates(e), badge(e.state), track, summary])
        body.append(f'<h2 id="{esc(camp)}">{esc(camp)}</h2>')
        if camp in trends:
            body.append(trend_page.index_line(camp))
        body += ["<div class=index>",
                 table(["evidence", "created (UTC)", "commit", "device / dtype", "verdicts", "state", "MLflow", ""], rows),
                 "</div>"]
    if entries and not ui:
        body.append("<p class=muted>MLflow runs are in the working directory's store: <code>evident ui</code> there "
                    "shows them and, while it runs, links these pages to them (each page lists its run ids).</p>")
    return page("Evidence archive — evident", "\n".join(body))


def write_archive(root: str | Path = archive.ROOT, tracking_uri: str | None = None,
                  records: Path | None = None) -> list[Path]:
    """Write every page and the index; remove pages written here for directories now gone."""
    root = Path(root)
    records = Path(records) if records is not None else root.parent / archive.TRACKING_RECORDS
    ui = ui_base(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    entries = archive.listing(root, records=records)
    written = [write_text(page_of(root, e), evidence_page(e, ui)) for e in entries]
    for stale in (root / PAGES).glob("*/*.html"):
        if (stale.parent.name[0].isalnum() and not (root / stale.parent.name / stale.stem).is_dir()
                and ours(stale)):
            stale.unlink()
    trends = trend_page.write_trends(root, entries)
    written.append(write_text(root / "index.html", index_page(entries, ui, frozenset(trends))))
    return written
