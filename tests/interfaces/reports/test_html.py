"""The self-contained HTML builder: escaping, structure, charts, and rendering in Chromium."""

from __future__ import annotations

import re
import struct
import subprocess
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.interfaces.reports.html import (
    BlockRun,
    ChartSeries,
    HtmlPage,
    block_map_svg,
    line_chart_svg,
)

MiB = 2**20


def _page() -> HtmlPage:
    page = HtmlPage("Report <1>", subtitle="sub & title")
    s = page.section("First section")
    s.verdict("Cause: <b>not bold</b>")
    s.paragraph("plain", css_class="note")
    s.code('x = "<script>alert(1)</script>"\nprint(x)')
    s.table(["name", "bytes"], [("a<b", 1), ("c", 2)], numeric_columns=(1,), caption="cap")
    page.section("Second!").figure(
        line_chart_svg([ChartSeries("allocated", ((0, 0), (1, 5 * MiB)))], x_label="event"),
        "a chart",
    )
    return page


def test_structure_and_escaping(parse_html):
    """Sections get slug ids; every text is escaped; code stays whole in <pre><code>."""
    html = _page().render()
    page = parse_html(html)
    assert [a["id"] for a in page.of("section")] == ["first-section", "second"]
    assert "<script>" not in html and page.of("script") == []
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>" not in html
    text = "".join(page.text)
    assert 'x = "<script>alert(1)</script>"\nprint(x)' in text
    assert "Report <1>" in text and "sub & title" in text
    assert [a.get("class") for a in page.of("td")] == [None, "num", None, "num"]


def test_no_network_references(parse_html):
    """The page loads nothing: no src/href attributes, no URLs, a CSP that forbids fetches."""
    html = _page().render()
    page = parse_html(html)
    assert not re.search(r"https?://", html)
    assert all("src" not in attrs and "href" not in attrs for _, attrs in page.tags)
    (csp,) = [a for a in page.of("meta") if a.get("http-equiv") == "Content-Security-Policy"]
    assert csp["content"].startswith("default-src 'none'")


def test_line_chart_geometry(parse_html):
    """A step path per series, byte tick labels, the marker and the limit line."""
    svg = line_chart_svg(
        [
            ChartSeries("allocated", ((0, 0), (10, 256 * MiB))),
            ChartSeries("reserved", ((0, 0), (10, 512 * MiB))),
        ],
        x_label="trace event",
        marker_x=10,
        marker_label="OOM",
        limit_bytes=1024 * MiB,
        limit_label="device total",
    )
    page = parse_html(svg)
    paths = page.of("path")
    assert [p["data-name"] for p in paths] == ["allocated", "reserved"]
    # 1 GiB top, 5 ticks of 256 MiB: plot height 232 px, 512 MiB sits half-way at y = 144.
    assert paths[1]["d"] == "M86.0,260.0H880.0V144.0"
    labels = [t for t in page.text if t.endswith("B")]
    assert labels == ["0 B", "256.00 MiB", "512.00 MiB", "768.00 MiB", "1.00 GiB"]
    assert len(page.of("line")) == 5 + 2  # grid lines, the limit and the marker
    assert "OOM" in page.text and "device total" in page.text


def test_block_map_pieces(parse_html):
    """Runs are cut at row ends; each segment gets one boundary tick; states keep colours."""
    runs = [BlockRun(0, 30, "allocated"), BlockRun(0, 20, "free"), BlockRun(1, 50, "allocated")]
    page = parse_html(block_map_svg(runs, width=120, rows=4))
    pieces = [(r["data-state"], float(r["width"])) for r in page.of("rect") if "data-state" in r]
    # 100 bytes over 4 rows of 25 bytes, 100 px wide: 30 = 25 + 5, 20 = 20, 50 = 25 + 25.
    assert pieces == [
        ("allocated", 100.0),
        ("allocated", 20.0),
        ("free", 80.0),
        ("allocated", 100.0),
        ("allocated", 100.0),
    ]
    assert len([r for r in page.of("rect") if r.get("class") == "boundary"]) == 2


@given(
    st.lists(
        st.tuples(st.integers(1, 2**34), st.sampled_from(["allocated", "free", "pending_free"])),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 30),
)
def test_block_map_covers_every_byte(parse_html, raw, rows):
    """Whatever the runs, the drawn pieces add up to the full plot width times the fill."""
    runs = [BlockRun(i // 3, size, state) for i, (size, state) in enumerate(raw)]
    page = parse_html(block_map_svg(runs, width=400, rows=rows))
    drawn = sum(float(r["width"]) for r in page.of("rect") if "data-state" in r)
    total = sum(size for size, _ in raw)
    row_bytes = -(-total // rows)
    expected = total / row_bytes * 380
    # Each piece is at most 0.3 px wider than its share (a minimum width) and rounded to 0.01.
    assert drawn == pytest.approx(expected, abs=0.31 * (len(runs) + rows))


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        line = raw[y * (stride + 1) : (y + 1) * (stride + 1)]
        kind, cur = line[0], bytearray(line[1:])
        for i in range(stride):
            a = cur[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if kind == 1:
                cur[i] = (cur[i] + a) & 255
            elif kind == 2:
                cur[i] = (cur[i] + b) & 255
            elif kind == 3:
                cur[i] = (cur[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(
            bytes(cur[j] for k in range(width) for j in range(k * channels, k * channels + 3))
        )
        prev = cur
    return width, height, rows


def test_charts_render_in_chromium(chromium, tmp_path):
    """Headless Chromium paints both chart series and the segment map's colours."""
    page = HtmlPage("chart")
    page.section("c").figure(
        line_chart_svg(
            [
                ChartSeries("a", ((0, 0), (5, 600 * MiB)), colour="#ff0000"),
                ChartSeries("b", ((0, 0), (5, 900 * MiB)), colour="#00ff00"),
            ],
            x_label="event",
            width=500,
            height=200,
        )
    )
    page.section("m").figure(
        block_map_svg([BlockRun(0, 10, "allocated"), BlockRun(0, 10, "free")], rows=1, width=500)
    )
    path = page.write(tmp_path / "chart.html")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=600,700",
            path.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    _, _, rows = _png_pixels(shot.read_bytes())
    pixels = {bytes(row[i : i + 3]) for row in rows for i in range(0, len(row), 3)}
    assert b"\xff\x00\x00" in pixels and b"\x00\xff\x00" in pixels  # both series
    assert bytes.fromhex("0072B2") in pixels and bytes.fromhex("d9d9d9") in pixels  # map
