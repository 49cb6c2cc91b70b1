"""The gate strip under a campaign's trend PNG: a gate that measured nothing (the overlap screens' `not_measured`,
the audit's `not_compiled`) is grey, as the index shows it, never green (gates.Gate.state)."""

from __future__ import annotations

import io

import handbuilt as hb
import numpy as np
import pytest
from test_trend import seal

from evident.workflow.archive import trend
from evident.workflow.core.evidence import Stage
from evident.workflow.core.gates import BY_NAME, NOT_COMPILED, NOT_MEASURED, NOT_RUN

GREEN, GREY = (0x2D, 0xA4, 0x4E), (0xD0, 0xD7, 0xDE)


@pytest.mark.parametrize("gate,verdict,state", [
    ("overlap", NOT_MEASURED, NOT_RUN), ("overlap", "b_faster", "pass"), ("overlap", "bitwise_mismatch", "fail"),
    ("audit", NOT_COMPILED, NOT_RUN), ("audit", "ok", "pass"), ("audit", "spills", "fail"),
    ("quality", "no_claim", "fail"), ("parity", "", NOT_RUN), ("parity", None, NOT_RUN)])
def test_state(gate, verdict, state):
    assert BY_NAME[gate].state(verdict) == state


def pixels(png: bytes, rgb) -> int:
    import matplotlib.image

    img = (matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array(rgb)).max(axis=-1) <= 2).sum())


def strip(tmp_path, overlap: str) -> bytes:
    """The trend PNG of two sealed directories whose parity passes and whose overlap verdict is `overlap`."""
    root = tmp_path / overlap / "evidence"
    for i, eid in enumerate(("aaaaaaa-c11111111-r1", "bbbbbbb-c11111111-r1")):
        created = f"2026-01-0{i + 1}T00:00:00Z"
        ev = hb.build(root, "tiny", eid, created=created, cells=[hb.cell("single", 1, 10.0, 0.01)], plot=False,
                      seal=False)
        with Stage(ev, "overlap") as st:
            st.write_json("overlap/screen.json", {"verdict": overlap})
        seal(ev, created)
    assert trend.main(["--root", str(root), "trend", "--campaign", "tiny"]) == 0
    return (root / "_trends/tiny.png").read_bytes()


def test_a_gate_that_measured_nothing_is_grey_in_the_strip(tmp_path, capsys):
    idle, measured = strip(tmp_path, NOT_MEASURED), strip(tmp_path, "b_faster")
    # the same two parity squares are green in both; the overlap row's two are grey, or green where it was measured
    assert pixels(idle, GREY) > pixels(measured, GREY)
    assert pixels(measured, GREEN) > 1.5 * pixels(idle, GREEN)
