"""The evidence's PNG plots made reproducible, once: a bare Figure on the Agg canvas (`figure`: no pyplot global
state, no backend switch for the rest of the process) saved without the PNG "Software" text chunk, which names the
matplotlib version, and written atomically (`save_png`): the same figure always gives the same bytes. Used by
benchstats.plot, trend_plot.plot and the overlap and profile stages' plots, each at its own dpi."""

from __future__ import annotations

import io
from pathlib import Path

from evident.workflow.core.evidence import write_bytes


def figure(**kw):
    """A bare matplotlib Figure (`kw`: Figure's, e.g. figsize) with an Agg canvas attached."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path, dpi: int) -> Path:
    """`fig` as a PNG at `path` (written atomically, evidence.write_bytes), with no "Software" chunk."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return write_bytes(path, buf.getvalue())
