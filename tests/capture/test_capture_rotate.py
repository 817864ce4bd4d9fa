"""Capture's switch to a new trace file (the pytest plugin's one trace per test): the new file
reads on its own, the blocks and windows still live re-declared at its top."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from sanitizer.rules.driver import analyze  # noqa: E402
from trace_files import records, traces  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = textwrap.dedent("""
    import sys, torch, sanitizer
    from sanitizer.capture import runtime
    from sanitizer.capture.rotate import rotate
    cap = runtime.active()
    keep = torch.ones(1000)                        # lives across the switch
    with sanitizer.symmetric_scope("tp"):
        win = torch.zeros(2048)                    # in the modelled window, lives across it
    gone = torch.ones(10)
    del gone
    rotate(cap, sys.argv[1])
    sanitizer.step(1)
    del keep, win                                  # freed in the new file: known there
    with sanitizer.symmetric_scope("tp"):
        t = torch.empty(512)
    del t
""")


@pytest.mark.usefixtures("trace_format")
def test_rotate_starts_a_self_contained_file(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    first, second = tmp_path / "first", tmp_path / "second"
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(first), PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, str(prog), str(second)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (old,) = traces(first)
    (new,) = traces(second)
    evs = [e for e in records(new)[1:] if e["ev"] != "end"]
    kinds = [e["ev"] for e in evs]
    assert kinds[0] == "window"                                       # the window first
    redeclared = [e for e in evs if e.get("op") == "live-at-new-trace"]
    assert {e["pool"] for e in redeclared} >= {"symm", "default"}
    old_ids = {e["id"] for e in records(old)[1:] if e["ev"] == "alloc"}
    assert {e["id"] for e in redeclared} <= old_ids
    freed = {e["id"] for e in evs if e["ev"] == "free"}
    assert {e["id"] for e in redeclared} & freed                     # freed after the switch, known
    assert "step" in kinds and "hook_error" not in kinds
    # read strictly (not leniently): no free of an unknown block, no malformed line
    a = analyze([str(new)])
    assert not a.errors, a.errors
    window = evs[0]
    assert [e for e in redeclared if window["addr"] <= e["addr"] < window["addr"] + window["size"]]  # win, in it
    # win and t are window blocks that no collective ever reaches (the program runs none): no
    # transient-in-window (docs/hazard-model.md, "When a window transient is a hazard"), no finding
    assert a.findings == []
