"""The testbed under hazsan capture (HAZSAN=1): its events land in capture's rank files, its window
storages are not recorded a second time by capture's dispatch mode, and the analysis of the
combined trace finds the early free and the collision."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from sanitizer.rules.driver import analyze  # noqa: E402

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = textwrap.dedent("""
    import torch
    from sanitizer.testbed import SymmetricCommunicator, spawn

    def worker(rank, files):
        torch.set_num_threads(1)
        with SymmetricCommunicator(files, rank, read_delay=0.3) as comm:
            comm.step(0, tokens=4096)
            with comm.scope():
                x = torch.full((4096,), float(rank + 1))
                y = torch.empty(4096)
            work = comm.all_reduce(x, out=y)
            del x
            with comm.scope():
                t = torch.full((4096,), 100.0)
            work.wait()
            z = y * 2                       # an ordinary op on a window tensor: not adopted again
            return int((y != 3.0).sum())

    if __name__ == "__main__":
        print(spawn(worker, 2, window_bytes=8 << 20, timeout=120))
""")


def test_testbed_events_go_into_capture_traces(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    traces = tmp_path / "traces"
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(traces), PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, str(prog)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[4096, 4096]"     # really corrupted
    ranks = sorted(p.name for p in traces.glob("rank*.jsonl"))
    assert ranks == ["rank0.jsonl", "rank1.jsonl"], sorted(p.name for p in traces.iterdir())
    for name in ranks:
        evs = [json.loads(line) for line in (traces / name).read_text().splitlines()[1:]]
        kinds = [e["ev"] for e in evs]
        assert "hook_error" not in kinds, [e for e in evs if e["ev"] == "hook_error"]
        assert {"window", "scope", "coll", "coll_done", "step"} <= set(kinds)
        win = next(e for e in evs if e["ev"] == "window")
        inside = [e for e in evs if e["ev"] == "alloc" and win["addr"] <= e["addr"] < win["addr"] + win["size"]]
        assert len(inside) == 3                                  # x, y, t: once each, by the testbed
        assert all(e["pool"] == "symm" and e["op"] != "adopted" for e in inside)
        # an op's own output inside the scope is a CPU allocation that the testbed then copies
        # into the window: the trace closes the scope around the op, so a replay (hazsan place /
        # sweep) puts only the window blocks in the pool
        depth, outside_in_scope, window_in_scope = 0, [], 0
        for e in evs:
            if e["ev"] == "scope":
                depth += 1 if e["enter"] else -1
            elif e["ev"] == "alloc":
                in_window = win["addr"] <= e["addr"] < win["addr"] + win["size"]
                if in_window:
                    window_in_scope += depth > 0
                elif depth > 0:
                    outside_in_scope.append(e)
        assert depth == 0 and window_in_scope == 3 and outside_in_scope == [], outside_in_scope
    rules = analyze([str(traces)]).summary["by_rule"]
    assert rules.get("free-in-flight") == 2 and rules.get("reuse-in-flight") == 2, rules
