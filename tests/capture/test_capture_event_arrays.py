"""Capture's hot events (alloc, free, launch) are built as the binary layout's arrays
(block_table.py), not as dicts: the arrays must say exactly what the dicts said, in either trace
format, and a value the layout cannot intern must still reach the reader, which names it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from sanitizer.capture import block_table as BT
from sanitizer.trace import binary as B

PROGRAM = """
import torch
a = torch.ones(16)
for i in range(3):
    b = a + 1.0          # the site of every alloc and launch
    c = b.mul_(2.0)
"""


def test_the_arrays_follow_the_layout():
    assert BT.ALLOC_FIELDS == B.ORDER["alloc"][1]
    assert BT.FREE_FIELDS == B.ORDER["free"][1][:len(BT.FREE_FIELDS)]
    assert BT.LAUNCH_FIELDS == B.ORDER["launch"][1][:len(BT.LAUNCH_FIELDS)]
    assert (BT._ALLOC, BT._FREE, BT._LAUNCH) == (B.ORDER["alloc"][0], B.ORDER["free"][0], B.ORDER["launch"][0])


def _capture(tmp_path, fmt):
    d = tmp_path / fmt
    env = {**os.environ, "HAZSAN": "1", "HAZSAN_LEVEL": "full", "HAZSAN_DIR": str(d), "HAZSAN_TRACE_FORMAT": fmt}
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    subprocess.run([sys.executable, str(prog)], env=env, check=True, timeout=300, cwd=tmp_path)
    (trace,) = [p for p in d.iterdir()]
    r = subprocess.run([sys.executable, "-m", "sanitizer", "cat", str(trace), "--no-header"],
                       capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()], trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arrays")
    return {fmt: _capture(tmp, fmt) for fmt in ("jsonl", "binary")}


def _steady(events):
    """The events minus what differs from process to process (addresses, times)."""
    out = []
    for ev in events:
        ev = {k: v for k, v in ev.items() if k not in ("addr", "t", "reads", "writes")}
        out.append(ev)
    return out


def test_same_events_in_both_formats_with_the_dicts_fields(traces):
    jsonl, _ = traces["jsonl"]
    binary, _ = traces["binary"]
    assert _steady(jsonl) == _steady(binary)
    # the fields the dicts had, no more (absent ones are not written as null)
    allocs = [ev for ev in jsonl if ev["ev"] == "alloc" and ev["op"] == "aten.add.Tensor"]
    assert len(allocs) == 3
    for ev in allocs:
        assert set(ev) == {"ev", "id", "addr", "size", "stream", "pool", "t", "site", "op", "shape", "dtype"}
        assert ev["site"].endswith("prog.py:5:<module>") and ev["shape"] == [16] and ev["dtype"] == "float32"
        assert ev["size"] == 64 and ev["stream"] == "cpu" and ev["pool"] == "default"
    frees = [ev for ev in jsonl if ev["ev"] == "free"]
    assert frees and all(set(ev) == {"ev", "id", "t"} for ev in frees)
    launches = [ev for ev in jsonl if ev["ev"] == "launch"]
    ops = [ev["op"] for ev in launches]
    assert ops.count("aten.add.Tensor") == 3 and ops.count("aten.mul_.Tensor") == 3
    for ev in launches:
        assert set(ev) <= {"ev", "stream", "reads", "writes", "t", "site", "op"} and "writes" in ev
    add = next(ev for ev in launches if ev["op"] == "aten.add.Tensor")
    assert len(add["reads"]) == 1 and len(add["writes"]) == 1 and add["reads"] != add["writes"]


def test_an_array_is_written_shorter_than_the_layout(traces):
    """A free is [kind, id, t] on disk: the fields after the last present one are left out."""
    _, trace = traces["binary"]
    data = trace.read_bytes()
    items = []
    pos = len(B.SIGNATURE)
    while pos < len(data):
        kind, n = B.PREFIX.unpack_from(data, pos)
        payload = data[pos + B.PREFIX_SIZE:pos + B.PREFIX_SIZE + n]
        if kind == B.FRAME_EVENTS:
            items += msgspec.msgpack.decode(payload)
        pos += B.PREFIX_SIZE + n
    frees = [it for it in items if type(it) is list and it[0] == B.ORDER["free"][0]]
    assert frees and all(len(it) == 3 for it in frees)


def test_a_value_the_layout_cannot_intern_goes_as_a_map(tmp_path):
    """An array with a wrong-typed INDEXED field (a site that is a number) is written as the map it
    stands for, so the reader names the field, as it does for JSON Lines."""
    good = [B.ORDER["alloc"][0], 1, 4096, 64, "cpu", "default", None, None, None, 5, None, "a.py:1:f", None,
            "aten.empty", [16], "float32"]
    bad = list(good)
    bad[1], bad[B.position("alloc", "site")] = 2, 12345
    table = B.ValueTable()
    assert B.to_item(bad, table) == B.to_dict(bad) and B.to_item(good, table) is not good
    assert good[B.position("alloc", "site")] == "a.py:1:f"       # the caller's array is not changed
    header = {"hazsan": 1, "rank": 0, "world_size": 1}
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(header) + B.encode_frames([good, bad, [B.ORDER["free"][0], 1, 6]], B.ValueTable()))
    r = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(p), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "alloc: field 'site'" in r.stderr and f"{p}:" in r.stderr, r.stderr[-2000:]
    assert json.loads(r.stdout)["summary"]["malformed"] == 1
