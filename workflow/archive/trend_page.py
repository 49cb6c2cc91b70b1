"""The archive's trends pages (workflow/archive/pages.py writes them with the rest): per campaign with a sealed
directory, its trend (workflow/archive/trend.py) as `evidence/_trends/<campaign>.{png,csv}` and the page
`_pages/_trends/<campaign>.html` that shows them: the PNG, the regressions, each cell's value per directory and
each gate's verdict, linked to the directories' pages.
"""

from __future__ import annotations

from pathlib import Path

from evident.workflow.archive import archive, trend
from evident.workflow.archive.markup import PAGES, Raw, badge, esc, link, ours, page, table, url
from evident.workflow.core.evidence import write_text
from evident.workflow.core.gates import GATES
from evident.workflow.core.terminal import pct
from evident.workflow.plan.runs import label_key


def trends_page_of(root: Path, campaign: str) -> Path:
    return root / PAGES / trend.OUT / f"{campaign}.html"


def index_line(camp: str) -> str:
    """The index's link to a campaign's trends page, PNG and CSV, under the campaign's heading."""
    return (f"<p>{link(f'{PAGES}/{trend.OUT}/{camp}.html', 'Trends')}: each bench cell's TPOT p50 and each gate's "
            f"verdict over the sealed directories, regressions flagged "
            f"({link(f'{trend.OUT}/{camp}.png', 'PNG')}, {link(f'{trend.OUT}/{camp}.csv', 'CSV')})</p>")


def write_trends(root: str | Path, entries: list[archive.Evidence]) -> dict[str, list[Path]]:
    """Per campaign with a sealed directory: `_trends/<campaign>.{png,csv}` and its page. The page, PNG and CSV of
    a campaign with none left are removed (a filtered `evident trend` view, `<campaign>-...`, is left alone)."""
    root = Path(root)
    out: dict[str, list[Path]] = {}
    for camp in sorted({e.path.parent.name for e in entries if e.sealed}):
        dirs, ordered_by = trend.in_order([e for e in entries if e.path.parent.name == camp], root.parent)
        frame = trend.history(dirs, ordered_by=ordered_by)
        png, csv = trend.write(frame, root / trend.OUT, camp, trend.title(camp, len(dirs), ordered_by=ordered_by))
        out[camp] = [png, csv, write_text(trends_page_of(root, camp), trends_page(camp, frame))]
    for stale in (root / PAGES / trend.OUT).glob("*.html"):
        if stale.stem not in out and ours(stale):
            stale.unlink()
            for ext in ("png", "csv"):
                (root / trend.OUT / f"{stale.stem}.{ext}").unlink(missing_ok=True)
    return out


def trends_page(camp: str, frame) -> str:
    """The PNG, links to it and the CSV, the regressions, each cell's value per directory and each gate's verdict."""
    rows = frame.to_dict("records")
    dirs = {r["order"]: r for r in rows}
    dirs = [dirs[k] for k in sorted(dirs)]
    order = {d["evidence"]: d["order"] for d in dirs}
    n = len(dirs)

    def ev_link(eid):
        return link(f"../{camp}/{eid}.html", eid) if eid in order else "—"

    cells = sorted({r["cell"] for r in rows if isinstance(r["cell"], str) and r["cell"]}, key=label_key)
    by = {(r["order"], r["cell"]): r for r in rows if isinstance(r["cell"], str) and r["cell"]}

    def value(d, c):
        r = by.get((d["order"], c))
        if r is None:
            return "—"
        text = trend.value_text(r["value"]) + (f" {trend.mark(r)}" if trend.mark(r) else "")
        return badge("slower", text) if r["regression"] else text

    head = ["#", "evidence", "commit", "created (UTC)"]
    facts = [[d["order"], ev_link(d["evidence"]), Raw(f"<code>{esc(d['commit'])}</code>"), d["created_utc"] or "—"]
             for d in dirs]
    gates = [g.name for g in GATES if any(d[f"gate_{g.name}"] for d in dirs if isinstance(d[f"gate_{g.name}"], str))]
    bad = trend.regressions(frame)
    body = [
        f'<nav>{link("../../index.html", "Evidence archive")} / {link(f"../../index.html#{camp}", camp)} / trends</nav>',
        f"<h1>Trends: {esc(camp)}</h1>",
        f"<p class=muted>{n} sealed director{'y' if n == 1 else 'ies'} of this campaign, "
        f"{trend.ORDERS[frame.attrs.get('ordered_by', 'created')]}. Each line is a bench "
        f"cell's steady TPOT p50; its band is the min–max of the cell's per-repeat TPOT p50s (the spread the noise "
        f"rule reads). A cell is flagged when it is slower than the previous directory with the same cell beyond "
        f"the noise, by the rule of <code>evident diff</code>. A cell of the rate rung (named <code>-r&lt;R&gt;</code>"
        f", R requests a second) runs once a directory: no band and never a claim. <code>evident trend --campaign "
        f"{esc(camp)}</code> prints the same.</p>",
    ]
    if n < 2:
        body.append("<p>Only one sealed directory: nothing to compare yet.</p>")
    body += [f'<figure><img src="{esc(url(f"../../{trend.OUT}/{camp}.png"))}" alt="{esc(camp)} trends"></figure>',
             f"<p>{link(f'../../{trend.OUT}/{camp}.csv', f'{camp}.csv')} (one row per directory and cell, every "
             f"claim and its reason) · {link(f'../../{trend.OUT}/{camp}.png', f'{camp}.png')}</p>",
             "<h2>Regressions</h2>"]
    if bad:
        body.append(table(["cell", "directory", "against", "TPOT p50", "tok/s", "spread"], [
            [r["cell"], ev_link(r["evidence"]), ev_link(r["baseline"]), badge("slower", pct(r["tpot_p50_change_pct"])),
             pct(r["tok_s_change_pct"]), pct(r["spread"] * 100 if isinstance(r["spread"], float) else None).lstrip("+")]
            for r in bad], {3, 4, 5}))
    else:
        body.append("<p>None: no cell got slower beyond the noise.</p>")
    body.append("<h2>Steady TPOT p50 (ms) per cell</h2>")
    if cells:
        body += [table(head + cells, [f + [value(d, c) for c in cells] for f, d in zip(facts, dirs)],
                       set(range(4, 4 + len(cells)))),
                 f"<p class=muted>{esc(trend.LEGEND)}.</p>"]
    else:
        body.append("<p>No bench cells in these directories.</p>")
    body.append("<h2>Gate verdicts</h2>")
    body.append(table(head + gates, [f + [badge(d[f"gate_{g}"]) if d[f"gate_{g}"] else "—" for g in gates]
                                     for f, d in zip(facts, dirs)]) if gates else "<p>No gate verdicts recorded.</p>")
    return page(f"{camp} trends — evident", "\n".join(body))
