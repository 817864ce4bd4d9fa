"""A newcomer's first programs, run with the README's recipes and no settings beyond them (issue 49):
real 2-rank gloo programs (examples/first_programs/), the real `hazsan` command line, the real
pytest plugin. Each test is one first verdict a user gets."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "examples" / "first_programs"
HAZSAN = [sys.executable, "-m", "sanitizer"]


def _env(**extra) -> dict:
    """The user's environment: no HAZSAN_* setting of ours leaks in (the test process may run under
    the pytest plugin or with settings exported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(extra)
    return env


def sh(cmd, cwd, timeout=300, **env):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env(**env))


def bug_line(path: Path) -> int:
    """The line of the program marked `# BUG`."""
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "# BUG" in text)


def headline_sites(report: str) -> list[str]:
    return re.findall(r"^hazsan ERROR: \S+\s+at (\S+)", report, re.M)


def test_the_async_bug_is_found_at_its_line_and_the_fix_in_the_same_folder_is_judged_alone(tmp_path):
    prog = tmp_path / "async_allreduce.py"
    shutil.copy(PROGRAMS / "async_allreduce.py", prog)
    # the README's first recipe: HAZSAN=1, then hazsan check on the default folder
    out = sh([sys.executable, str(prog)], tmp_path, HAZSAN="1")
    assert out.returncode == 0, out.stderr
    assert "hazsan: traces in hazsan-traces" in out.stderr and "next: hazsan check hazsan-traces" in out.stderr
    out = sh(HAZSAN + ["check", "hazsan-traces"], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    # sites are relative to the working directory
    assert headline_sites(out.stdout) == [f"async_allreduce.py:{bug_line(prog)}:worker"]
    # the last line is the verdict, at the bad access; the launcher is no rank
    assert out.stdout.strip().splitlines()[-1].startswith(
        f"SUMMARY: hazsan: unordered-access at async_allreduce.py:{bug_line(prog)}:worker; 8 finding(s)")
    assert "2 rank(s) and 1 process(es) without a rank" in out.stdout
    # the fix, into the same folder: judged alone, and the report says so
    out = sh([sys.executable, str(prog), "--fixed"], tmp_path, HAZSAN="1")
    assert out.returncode == 0, out.stderr
    out = sh(HAZSAN + ["check", "hazsan-traces"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hazsan-traces holds 2 runs; judged the newest" in out.stdout
    assert "no hazards found" in out.stdout and "2 rank(s)" in out.stdout
    # naming the files of both runs is refused, naming the runs
    files = sorted(str(p) for p in (tmp_path / "hazsan-traces").glob("rank0*"))
    assert len(files) == 2
    out = sh(HAZSAN + ["check", *files], tmp_path)
    assert out.returncode == 2 and "come from 2 different runs" in out.stdout
    # the older run, asked for by its id, still holds the bug
    older = re.search(r"left out: run (\S+)", sh(HAZSAN + ["check", "hazsan-traces"], tmp_path).stdout)[1]
    out = sh(HAZSAN + ["check", "hazsan-traces", "--run", older, "--format", "json"], tmp_path)
    assert out.returncode == 1 and json.loads(out.stdout)["summary"]["by_rule"] == {"unordered-access": 8}


def test_hazsan_run_keeps_the_command_s_failure_and_the_findings_in_its_exit_code(tmp_path):
    fail = sh(HAZSAN + ["run", "--", sys.executable, "-c", "import torch, sys; sys.exit(3)"], tmp_path)
    assert fail.returncode == 3, fail.stderr
    assert "exit 3, its own status" in fail.stderr
    killed = sh(HAZSAN + ["run", "--", sys.executable, "-c", "import torch, os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                tmp_path)
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr
    bug = sh(HAZSAN + ["run", "--", sys.executable, str(PROGRAMS / "async_allreduce.py")], tmp_path)
    assert bug.returncode == 1, bug.stdout + bug.stderr
    picked = sh(HAZSAN + ["run", "--error-exitcode", "42", "--", sys.executable, str(PROGRAMS / "async_allreduce.py")],
                tmp_path)
    assert picked.returncode == 42
    fixed = sh(HAZSAN + ["run", "--", sys.executable, str(PROGRAMS / "async_allreduce.py"), "--fixed"], tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    # the cheaper level, asked for, misses the access (its documented limit), and says nothing is wrong
    alloc = sh(HAZSAN + ["run", "--level", "alloc", "--", sys.executable, str(PROGRAMS / "async_allreduce.py")], tmp_path)
    assert alloc.returncode == 0, alloc.stdout + alloc.stderr


def test_the_seed_fails_ci_where_nothing_collides_and_its_fix_passes(tmp_path):
    prog = PROGRAMS / "window_compute.py"
    bug = sh(HAZSAN + ["run", "--format", "json", "--", sys.executable, str(prog)], tmp_path)
    assert bug.returncode == 1, bug.stderr
    doc = json.loads(bug.stdout)
    assert doc["summary"]["by_rule"] == {"transient-in-window": 2}       # one site, per rank
    assert {f["severity"] for f in doc["findings"]} == {"error"}
    assert {f["site"] for f in doc["findings"]} == {f"{prog}:{bug_line(prog)}:worker"}
    fixed = sh(HAZSAN + ["run", "--", sys.executable, str(prog), "--fixed"], tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_a_truncated_capture_is_no_pass_and_no_report_shows_it_clean(tmp_path):
    traces = tmp_path / "t"
    out = sh(HAZSAN + ["run", "--dir", str(traces), "--", sys.executable, str(PROGRAMS / "window_compute.py"),
                       "--fixed"], tmp_path, HAZSAN_TRACE_FORMAT="jsonl")
    assert out.returncode == 0, out.stdout + out.stderr
    rank0 = traces / "rank0.jsonl"
    lines = rank0.read_text().splitlines(keepends=True)
    rank0.write_text("".join(lines[: len(lines) // 2]))        # cut mid-body, no end record
    check = sh(HAZSAN + ["check", str(traces)], tmp_path)
    assert check.returncode == 2, check.stdout
    assert "no verdict" in check.stdout and "INCOMPLETE" in check.stdout
    assert check.stdout.strip().splitlines()[-1].startswith("SUMMARY: hazsan: no verdict")
    assert sh(HAZSAN + ["check", "--allow-incomplete", str(traces)], tmp_path).returncode == 0
    page = tmp_path / "r.html"
    report = sh(HAZSAN + ["report", str(traces), "-o", str(page)], tmp_path)
    assert report.returncode == 2
    html = page.read_text()
    assert "INCOMPLETE capture" in html and "No hazards" not in html
    # unusable input writes no page at all
    missing = sh(HAZSAN + ["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "n.html")], tmp_path)
    assert missing.returncode == 2 and not (tmp_path / "n.html").exists()


PLUGIN_TEST = '''
import torch, torch.distributed as dist

def test_scale_before_wait(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        g = torch.ones(4096)
        work = dist.all_reduce(g, async_op=True)
        g.mul_(0.5)   # BUG
        work.wait()
    finally:
        dist.destroy_process_group()

def test_clean():
    assert torch.ones(3).sum() == 3
'''


def test_the_plugin_s_failure_line_is_the_verdict_and_check_reads_its_session_folder(tmp_path):
    (tmp_path / "test_x.py").write_text(PLUGIN_TEST)
    out = sh([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--hazsan", "--hazsan-dir", "ht",
              "test_x.py"], tmp_path, COLUMNS="200")
    assert out.returncode == 1, out.stdout
    line = bug_line(tmp_path / "test_x.py")
    # the short summary pytest prints for CI: the verdict, not the trace folder
    summary = re.search(r"^FAILED test_x.py::test_scale_before_wait - (.*)$", out.stdout, re.M)
    assert summary, out.stdout
    assert re.fullmatch(rf"unordered-access at \S*test_x.py:{line}:test_scale_before_wait \(\d+ findings?\)",
                        summary[1]), summary[1]
    assert "1 failed, 1 passed" in out.stdout
    # the session folder holds a folder per test: check judges each on its own
    check = sh(HAZSAN + ["check", "ht", "--format", "json"], tmp_path)
    assert check.returncode == 1, check.stdout + check.stderr
    doc = json.loads(check.stdout)
    assert doc["summary"]["by_rule"] == {"unordered-access": 1}
    assert len(doc["summary"]["runs"]) >= 2


def test_capture_speaks_once_and_never_captures_hazsan_itself(tmp_path):
    out = sh([sys.executable, "-c", "import torch; torch.ones(2) + 1"], tmp_path, HAZSAN="1",
             HAZSAN_LEVEL="fulll", HAZSAN_LEVLE="full")
    assert out.returncode == 0
    assert "HAZSAN_LEVEL='fulll' is not one of" in out.stderr
    assert "HAZSAN_LEVLE is not a setting (did you mean HAZSAN_LEVEL?)" in out.stderr
    assert out.stderr.count("hazsan: traces in") == 1
    # HAZSAN=1 exported: hazsan's own commands write no trace and say nothing of one
    own = sh(HAZSAN + ["check", "--help"], tmp_path, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "own"))
    assert own.returncode == 0 and "traces in" not in own.stderr and not (tmp_path / "own").exists()


def test_an_unusable_input_says_one_thing(tmp_path):
    out = sh(HAZSAN + ["check", str(tmp_path / "no" / "such")], tmp_path)
    assert out.returncode == 2
    assert out.stdout.splitlines() == [
        f"hazsan: error: {tmp_path / 'no' / 'such'}: no such file or directory",
        "hazsan: the input is unusable (exit 2): see the error above",
        f"SUMMARY: hazsan: unusable input: {tmp_path / 'no' / 'such'}: no such file or directory",
    ]
    doc = json.loads(sh(HAZSAN + ["check", "--format", "json", str(tmp_path / "x")], tmp_path).stdout)
    assert doc["summary"]["complete"] is False and doc["summary"]["events"] == 0
    assert {"ranks", "by_rule", "warnings", "malformed", "steps_by_rank"} <= set(doc["summary"])
    (tmp_path / "notes.txt").write_text("just some notes\n")
    out = sh(HAZSAN + ["check", str(tmp_path / "notes.txt")], tmp_path)
    assert out.returncode == 2 and "no hazards" not in out.stdout
