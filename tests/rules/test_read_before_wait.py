"""End to end: examples/read_before_wait.py under capture, then `hazsan check`.

Reading an asynchronous all-reduce's output before waiting is `unordered-access` at level full
(the read is a `launch`), clean when the program waits first; level alloc records no launch, so
it cannot see the read (its documented limit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _capture_and_check(tmp_path, variant, level):
    traces = tmp_path / f"{variant}-{level}"
    env = dict(os.environ, HAZSAN="1", HAZSAN_LEVEL=level, HAZSAN_DIR=str(traces), PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "read_before_wait.py"),
                          "--variant", variant], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces), "--format", "json"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    report = json.loads(check.stdout)
    assert report["summary"]["ranks"] == 2
    return check.returncode, report


def test_read_before_wait_is_unordered_access_at_level_full(tmp_path):
    code, report = _capture_and_check(tmp_path, "early", "full")
    assert code == 1
    rules = {f["rule"] for f in report["findings"]}
    assert rules == {"unordered-access"}, report["findings"]
    assert {f["rank"] for f in report["findings"]} == {0, 1}


def test_read_after_wait_is_clean_at_level_full(tmp_path):
    code, report = _capture_and_check(tmp_path, "wait", "full")
    assert (code, report["findings"]) == (0, [])


def test_level_alloc_records_no_launch(tmp_path):
    code, report = _capture_and_check(tmp_path, "early", "alloc")
    assert (code, report["findings"]) == (0, [])


GLOO_PROGRAM = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
x = torch.ones(1024)
work = dist.all_reduce(x, async_op=True)
if sys.argv[1] == "early":
    y = x * 2                       # reads the all-reduce's buffer before the wait
    work.wait()
else:
    work.wait()
    y = x * 2
dist.destroy_process_group()
"""


@pytest.mark.parametrize("variant,expect", [("early", 1), ("wait", 0)])
def test_gloo_async_all_reduce_read_before_wait(tmp_path, variant, expect):
    prog = tmp_path / "prog.py"
    prog.write_text(GLOO_PROGRAM)
    traces = tmp_path / "traces"
    env = dict(os.environ, HAZSAN="1", HAZSAN_LEVEL="full", HAZSAN_DIR=str(traces))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    run = subprocess.run([sys.executable, str(prog), variant, str(tmp_path / "store")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    (trace,) = traces.glob("*.jsonl")
    events = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    # the c10d op the collective dispatches is the `coll`, not a launch of its own
    assert not [e for e in events if e["ev"] == "launch" and e["op"].startswith("c10d.")]
    check = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces), "--format", "json"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    findings = json.loads(check.stdout)["findings"]
    assert check.returncode == expect
    assert [f["rule"] for f in findings] == ["unordered-access"] * expect
