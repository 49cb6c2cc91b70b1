"""What `evident` prints, made to fit a terminal: the width, wrapped text, tables whose columns give way or
continue below, and the numbers in them as people read them (`—` where there is none).

Nothing is cut where it can wrap; where a table is split into several (`split_table`), a cell too wide for any
of them is cut with `…`: what prints it writes the whole value elsewhere (`--json`, the CSV).
"""

from __future__ import annotations

import math
import textwrap

from tabulate import tabulate

WIDTH = 100
"""Everything printed fits a terminal this wide (a long path named on its own line aside)."""

# --- text and tables -------------------------------------------------------------------------

def wrap(text: str, indent: str = "", later: str | None = None) -> str:
    """`text` on lines within WIDTH, the first starting with `indent`, the others with `later` (else `indent`)."""
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent if later is None else later,
                         break_long_words=True, break_on_hyphens=False)


def table(header, rows) -> str:
    """tabulate's `simple` table, every cell as text (no number is reformatted)."""
    return tabulate(rows, headers=header, tablefmt="simple", disable_numparse=True)


def fit(header: list[str], rows: list[list], keep: tuple[int, ...] = (), tight: bool = False) -> str:
    """`table` within WIDTH: the widest columns give way first (down to 8 characters), their cells wrapped onto
    more lines, never cut; the columns numbered in `keep` (an id one copies) only once no other can. tabulate's
    `simple` format puts two spaces between columns and none around, and makes a column two wider than its
    header; `tight`: no wider than its header (the same layout, drawn here, for a listing whose every column
    counts)."""
    def longest(v) -> int:
        return max(map(len, str(v).splitlines() or [""]))

    pad = 0 if tight else 2
    widths = [max([longest(h) + pad, *(longest(v) for v in col)]) for h, *col in zip(header, *rows)]
    room = WIDTH - 2 * (len(widths) - 1)
    while sum(widths) > room and max(widths) > 8:
        free = [0 if i in keep else w for i, w in enumerate(widths)]
        pick = free if max(free) > 8 else widths
        widths[pick.index(max(pick))] -= 1

    def cell(v, w: int) -> str:
        return "\n".join(textwrap.fill(line, w, break_long_words=True, break_on_hyphens=True) if len(line) > w
                         else line for line in (str(v).splitlines() or [""]))

    head = [cell(h, w - pad) for h, w in zip(header, widths)]
    body = [[cell(v, w) for v, w in zip(row, widths)] for row in rows]
    if not tight:
        return table(head, body)

    def lines(cells: list[str]) -> list[str]:
        parts = [c.splitlines() or [""] for c in cells]
        return ["  ".join((p[i] if i < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip()
                for i in range(max(map(len, parts)))]

    return "\n".join([*lines(head), "  ".join("-" * w for w in widths), *(x for row in body for x in lines(row))])


def split_table(fixed_header: list[str], fixed_rows: list[list], header: list[str], columns: list[list],
                width: int = WIDTH) -> list[str]:
    """Tables of the fixed columns and as many of the others (each a header and its column of cells) as fit in
    `width`, the rest continued in the next table; a cell too wide for any table is cut with `…`."""
    def render(cols):
        return table([*fixed_header, *(c[0] for c in cols)],
                     [[*r, *(c[1][i] for c in cols)] for i, r in enumerate(fixed_rows)])

    def fits(cols):
        return max(len(line) for line in render(cols).splitlines()) <= width

    out, chunk = [], []
    for h, col in zip(header, columns):
        h, col = str(h), [str(v) for v in col]
        while not fits([(h, col)]) and max(len(h), *map(len, col)) > 2:
            n = max(len(h), *map(len, col)) - 1
            h, col = (h if len(h) <= n else h[:n - 1] + "…"), [v if len(v) <= n else v[:n - 1] + "…" for v in col]
        if chunk and not fits([*chunk, (h, col)]):
            out.append(render(chunk))
            chunk = []
        chunk.append((h, col))
    if chunk or not out:
        out.append(render(chunk))
    return out


# --- numbers ---------------------------------------------------------------------------------

def _real(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def num(v, fmt: str = ".4g") -> str:
    """A float in `fmt`, anything else as it is."""
    return "—" if v is None else (format(v, fmt) if isinstance(v, float) else str(v))


def pct(v) -> str:
    """A change in percent, signed: `+1.5%` (`—` for None, or NaN: a frame's empty cell)."""
    return f"{v:+.1f}%" if _real(v) else "—"


def ratio(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit} old"
    return f"{max(seconds, 0):.0f}s old"


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
