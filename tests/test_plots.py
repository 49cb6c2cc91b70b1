"""workflow/core/plots.py: the evidence's PNGs are reproducible (no "Software" chunk naming matplotlib, the same figure
gives the same bytes at the dpi asked) and written atomically."""

from __future__ import annotations

import struct
import zlib

from evident.workflow.core.plots import figure, save_png

PNG = b"\x89PNG\r\n\x1a\n"


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data.startswith(PNG)
    out, i = [], len(PNG)
    while i < len(data):
        (n,), kind = struct.unpack(">I", data[i:i + 4]), data[i + 4:i + 8]
        body = data[i + 8:i + 8 + n]
        assert struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0] == zlib.crc32(kind + body)
        out.append((kind, body))
        i += 12 + n
    return out


def draw():
    fig = figure(figsize=(4, 2))
    ax = fig.subplots()
    ax.plot([0, 1, 2], [1, 3, 2], label="x")
    ax.set_title("µs")
    ax.legend()
    return fig


def test_the_same_figure_gives_the_same_bytes_without_a_software_chunk(tmp_path):
    a, b = tmp_path / "plots" / "a.png", tmp_path / "b.png"
    assert save_png(draw(), a, dpi=110) == a  # its folder made
    save_png(draw(), b, dpi=110)
    data = a.read_bytes()
    assert data == b.read_bytes()
    texts = [body.split(b"\0")[0] for kind, body in chunks(data) if kind in (b"tEXt", b"iTXt", b"zTXt")]
    assert b"Software" not in texts
    (_, ihdr), = [c for c in chunks(data) if c[0] == b"IHDR"]
    assert struct.unpack(">II", ihdr[:8]) == (440, 220)  # 4x2 inches at 110 dpi
    save_png(draw(), b, dpi=120)
    assert struct.unpack(">II", chunks(b.read_bytes())[0][1][:8]) == (480, 240)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.png", "b.png", "plots"]  # no temporary file left
    assert oct(a.stat().st_mode & 0o777) == "0o644"
