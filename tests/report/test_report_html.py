"""`hazsan report`: a self-contained HTML file; its plots hold the trace's data, it escapes what
comes from a trace, and a real headless browser (Debian's chromium) renders the plots."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from sanitizer.cli import main

from tracebuilder import Trace

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "examples" / "traces"
SVG_NS = "{http://www.w3.org/2000/svg}"


def _chromium():
    for name in (os.environ.get("HAZSAN_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _svgs(page: str):
    return [ET.fromstring(m) for m in re.findall(r"<svg.*?</svg>", page, flags=re.S)]


def _group_paths(svgs, gid_prefix):
    n = 0
    for svg in svgs:
        for g in svg.iter(f"{SVG_NS}g"):
            if g.get("id", "").startswith(gid_prefix):
                n += sum(1 for el in g.iter() if el.tag in (f"{SVG_NS}path", f"{SVG_NS}use"))
    return n


@pytest.fixture(scope="module")
def decode_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gen_decode_trace.py"), "--events", "12000",
                    "--ranks", "2", "--inject", "4", "--out", str(d / "traces")], check=True, capture_output=True)
    out = d / "report.html"
    rc = main(["report", str(d / "traces"), "-o", str(out)])
    assert rc == 1
    return out


def test_report_is_self_contained_and_holds_the_data(decode_report):
    page = decode_report.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "default-src 'none'" in page                      # no fetch can happen
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    figures = re.findall(r'<figure class="window" data-rank="(\d+)" data-bars="(\d+)" data-blocks="(\d+)"', page)
    assert {r for r, _, _ in figures} == {"0", "1"}           # one timeline per rank (and window)
    svgs = _svgs(page)
    bars = sum(int(b) for _, b, _ in figures)
    assert bars > 0 and _group_paths(svgs, "hazsan-coll-bars") == bars    # one shape per in-flight buffer
    assert _group_paths(svgs, "hazsan-transients") >= 1       # the planted transient-in-window
    assert _group_paths(svgs, "hazsan-collisions") >= 2       # the planted collisions, on both ranks
    assert _group_paths(svgs, "hazsan-steps") >= 2            # findings per decode step
    for rule in ("reuse-in-flight", "free-in-flight", "unordered-access", "transient-in-window"):
        assert f'<b class="error">{rule}</b>' in page or f'<b class="warning">{rule}</b>' in page
    assert "Memory allocated at:" in page and "Op enqueued at:" in page


def test_report_escapes_everything_from_a_trace(tmp_path):
    t = Trace(rank=0, world_size=1)
    evil = "<script>alert(1)</script>"
    t.ev("window", addr=0x10000, size=1 << 20, comm=f"tp{evil}")
    t.alloc(1, 0x10000, 4096, stream="s0", pool="symm", site=f"model.py:1:{evil}", op=evil)
    t.coll(1, stream="c", comm=f"tp{evil}", bufs=[(0x10000, 4096, "rw")], site="x.py:2:<img src=x onerror=alert(2)>")
    t.free(1)
    t.alloc(2, 0x10000, 8192, stream="s0", pool="symm", site=f"a.py:3:{evil}")
    t.write(tmp_path / f"rank0.jsonl")
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "rank0.jsonl"), "-o", str(out)]) == 1
    page = out.read_text()
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_report_of_the_example_traces(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(TRACES), str(TRACES / "asymmetric-offset"), "-o", str(out)]) == 1
    page = out.read_text()
    assert "asymmetric-offset" in page and page.count('<figure class="window"') >= 7


@pytest.mark.skipif(_chromium() is None, reason="no chromium (Debian: apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(decode_report, tmp_path):
    import numpy as np
    from PIL import Image

    shot = tmp_path / "report.png"
    done = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1280,1400", f"--screenshot={shot}", decode_report.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), done.stderr[-2000:]
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          decode_report.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert 'id="hazsan-coll-bars"' in dom and 'id="hazsan-collisions"' in dom   # the browser's DOM
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 1400)
    px = np.asarray(img).astype(int)
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    blue = int(((b > r + 60) & (b > g + 25)).sum())                  # collective buffers
    red = int(((r > 190) & (g < 70) & (b < 70)).sum())                # collision marks
    white = int(((r > 245) & (g > 245) & (b > 245)).sum())
    assert blue > 2000, blue
    assert red > 30, red
    assert white < r.size * 0.97          # not a blank page


def test_report_on_unusable_input_exits_2_with_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err
    (tmp_path / "rank0.jsonl").write_text('{"hazsan": 1, "rank": 0}\n{"ev": "free", "id": 9}\n')
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    # no page that could pass for a report: the error, on stderr, naming file and line
    assert not (tmp_path / "r.html").exists()
    assert "rank0.jsonl:2: " in capsys.readouterr().err
