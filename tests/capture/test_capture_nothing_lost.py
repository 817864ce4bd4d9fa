"""Nothing lost (issue 19, part 4): every captured process that imports torch writes its header at once, the time
flush holds when events are rare, and a process killed before its first flush leaves a file that
`hazsan check` names as INCOMPLETE. Real interpreters under HAZSAN=1, killed with SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sanitizer.trace.writer import HEADER_ROOM, TraceWriter
from trace_files import header_bytes, name, records

# every test in both trace formats (HAZSAN_TRACE_FORMAT: the writer, and the captured processes)
pytestmark = pytest.mark.usefixtures("trace_format")


def _env(traces, **extra):
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(traces), PYTHONWARNINGS="ignore")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HAZSAN_LEVEL", "HAZSAN_FLUSH_SECONDS"):
        env.pop(k, None)
    env.update(extra)
    return env


def _start(code, env):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _load(path):
    return records(path)


def _check(*args):
    return subprocess.run([sys.executable, "-m", "sanitizer", "check", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _wait_for(pred, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# ------------------------------------------------------------------ killed before the first flush
KILLED = """
import torch
xs = [torch.ones(16) * n for n in range(5)]        # a few events, all still in the buffer
print("ready", flush=True)
import time; time.sleep(60)
"""


def test_sigkill_before_the_first_flush_leaves_the_header_and_check_names_it(tmp_path, trace_format):
    traces = tmp_path / "t"
    proc = _start(KILLED, _env(traces, HAZSAN_FLUSH_SECONDS="1000"))   # no time flush before the kill
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        (path,) = traces.iterdir()
        assert path.name == name(f"pid{proc.pid}", trace_format)
        assert path.stat().st_size == header_bytes(path) == HEADER_ROOM    # the header alone, padded
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (header,) = _load(path)              # the header alone: no event was ever flushed
    assert header["pid"] == proc.pid and header["rank"] == -proc.pid and header["end_record"] is True

    text = _check(traces)
    # events were lost and none is a finding: no verdict (docs/cli.md, "hazsan check": exit)
    assert text.returncode == 2, text.stderr
    assert "no verdict" in text.stdout and "INCOMPLETE" in text.stdout and str(path) in text.stdout
    assert _check(traces, "--allow-incomplete").returncode == 0
    assert f"hazsan: INCOMPLETE: {path}: header only, no end record" in text.stdout
    assert "Traceback" not in text.stderr
    doc = json.loads(_check(traces, "--format", "json").stdout)["summary"]
    assert doc["complete"] is False
    assert doc["incomplete"] == [f"1 trace(s) truncated: {path}"]
    assert [f["file"] for f in doc["incomplete_files"]] == [str(path)]
    md = _check(traces, "--format", "markdown").stdout
    assert "INCOMPLETE" in md and path.name in md and "No hazards" not in md and "**No verdict**" in md


def test_sigkill_after_a_flush_names_the_file_and_keeps_the_events(tmp_path, trace_format):
    """Killed later: the events up to the last (time) flush are read, the file is still named."""
    traces = tmp_path / "t"
    code = """
    import torch, time
    xs = [torch.ones(16) * n for n in range(5)]
    print("ready", flush=True)
    time.sleep(60)
    """
    proc = _start(code, _env(traces, HAZSAN_FLUSH_SECONDS="0.2"))
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        path = traces / name(f"pid{proc.pid}", trace_format)
        # killed once idle: the events in the file, and the header saying so (the time flush's
        # next look after writing them: later under load)
        assert _wait_for(lambda: sum(e["ev"] == "alloc" for e in _load(path)[1:]) >= 5
                         and _load(path)[0]["progress"]["quiet"] is True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    header = _load(path)[0]
    assert "dispatch-mode" in header["hooks"]["installed"]      # the facts, written over the header in place
    # killed while idle: the time flush had written everything and the header says so (its
    # `progress`), so nothing is missing (tests/capture/test_capture_shutdown.py: what is said otherwise)
    assert header["progress"]["quiet"] is True
    doc = json.loads(_check(traces, "--format", "json").stdout)["summary"]
    assert doc["complete"] and doc["events"] >= 5 and not doc["incomplete_files"]
    assert any(w.startswith(f"{path}: no end record, nothing missing") for w in doc["warnings"])


# ------------------------------------------------------------------ rare events, the timer
def test_a_rare_event_is_on_disk_before_the_process_exits(tmp_path, trace_format):
    traces = tmp_path / "t"
    code = """
    import sys, time, torch
    x = torch.full((77,), 1.0)             # one event, then nothing for 3 s
    print("emitted", flush=True)
    time.sleep(3)
    print("exiting", flush=True)
    """
    proc = _start(code, _env(traces, HAZSAN_FLUSH_SECONDS="0.5"))
    try:
        assert proc.stdout.readline().strip() == "emitted", proc.stderr.read()
        path = traces / name(f"pid{proc.pid}", trace_format)
        t0 = time.monotonic()
        assert _wait_for(lambda: any(e.get("shape") == [77] for e in _load(path)[1:]), 2.5)
        assert time.monotonic() - t0 < 2.5
        assert proc.poll() is None                         # ...while the process still sleeps
    finally:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip().endswith("exiting")
    events = _load(path)
    assert events[-1]["ev"] == "end"
    assert _check(traces).returncode == 0


def test_fork_restarts_the_timer_in_both_processes(tmp_path, trace_format):
    """A forked child gets a file of its own at once and a time flush of its own; the parent's
    keeps working. Both then die without a clean exit, idle: each one's time flush wrote all it
    recorded and its header says so, so neither is incomplete."""
    traces = tmp_path / "t"
    code = """
    import os, signal, sys, time, threading, torch
    x = torch.ones(3)
    pid = os.fork()
    if pid == 0:
        y = torch.full((55,), 2.0)
        time.sleep(1.5)
        os._exit(0)                        # no exit handler: only the child's timer wrote y
    z = torch.full((66,), 3.0)
    assert sum(t.name == "hazsan-flush" for t in threading.enumerate()) == 1
    os.waitpid(pid, 0)
    print(pid, flush=True)
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = _start(code, _env(traces, HAZSAN_FLUSH_SECONDS="0.3"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    child = int(out.split()[0])
    parent_file = traces / name(f"pid{proc.pid}", trace_format)
    child_file = traces / name(f"pid{child}", trace_format)
    assert any(e.get("shape") == [66] for e in _load(parent_file)[1:])
    child_events = _load(child_file)
    assert child_events[0]["pid"] == child
    assert any(e.get("shape") == [55] for e in child_events[1:])
    doc = json.loads(_check(traces, "--format", "json").stdout)["summary"]
    assert doc["complete"] and not doc["incomplete_files"]
    for f in (parent_file, child_file):
        assert _load(f)[-1]["ev"] != "end" and _load(f)[0]["progress"]["quiet"] is True
        assert any(w.startswith(f"{f}: no end record, nothing missing") for w in doc["warnings"])


# ------------------------------------------------------------------ no stray files
def test_a_process_that_hooked_nothing_leaves_no_file_even_killed(tmp_path, trace_format):
    """No torch, nothing recorded: no file while it runs (made when torch is imported), none after
    a clean exit, none after SIGKILL (SGLang's shutdown kills multiprocessing's resource tracker)."""
    traces = tmp_path / "t"
    proc = _start("import time; print('up', flush=True); time.sleep(1)", _env(traces))
    assert proc.stdout.readline().strip() == "up"
    assert not traces.exists() or list(traces.iterdir()) == []
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert not traces.exists() or list(traces.iterdir()) == []
    proc = _start("import time; print('up', flush=True); time.sleep(60)", _env(traces))
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not traces.exists() or list(traces.iterdir()) == []


def test_subprocess_with_preexec_fn_leaves_no_header_only_file(tmp_path):
    """subprocess runs the fork handlers for a preexec_fn, then execs: no file for that moment."""
    traces = tmp_path / "t"
    code = """
    import os, subprocess, sys, torch
    torch.ones(2)
    subprocess.run(["true"], preexec_fn=os.getpid, check=True)
    subprocess.run([sys.executable, "-c", "import torch; torch.ones(4)"], preexec_fn=os.getpid, check=True)
    """
    proc = _start(code, _env(traces))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    files = sorted(traces.iterdir())
    assert len(files) == 2, [f.name for f in files]          # this process, and the python child
    for f in files:
        assert _load(f)[-1]["ev"] == "end"
    assert json.loads(_check(traces, "--format", "json").stdout)["summary"]["complete"]


def test_exec_takes_over_its_own_header_only_file(tmp_path, trace_format):
    """exec runs no exit handler: the new program (same pid) takes the header-only file over."""
    traces = tmp_path / "t"
    code = """
    import os, sys
    os.execv(sys.executable, [sys.executable, "-c", "import os, torch; torch.ones(5); print(os.getpid())"])
    """
    proc = _start(code, _env(traces))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    (path,) = traces.iterdir()
    assert path.name == name(f"pid{proc.pid}", trace_format) and int(out) == proc.pid
    events = _load(path)
    assert events[-1]["ev"] == "end" and any(e.get("shape") == [5] for e in events[1:])


# ------------------------------------------------------------------ the writer
def test_header_facts_are_written_in_place_then_by_a_copy_when_they_outgrow_the_room(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    facts = {"hooks": {"installed": []}}
    key = [0]
    w = TraceWriter(str(tmp_path), flush_seconds=1000)
    w.header_source = lambda: dict(facts)
    w.header_key = lambda: key[0]
    w.start()
    (path,) = tmp_path.iterdir()
    assert "hooks" not in _load(path)[0]                    # at once: no facts asked yet
    w.emit({"ev": "step", "n": 0})
    w.flush()
    assert _load(path)[0]["hooks"] == {"installed": []}      # the first flush: in place
    assert header_bytes(path) == HEADER_ROOM
    facts["hooks"] = {"installed": ["x" * 50] * 200}         # ~10 KiB: past the room
    key[0] = 1
    w.emit({"ev": "step", "n": 1})
    w.flush()
    lines = _load(path)
    assert lines[0]["hooks"]["installed"] == ["x" * 50] * 200
    assert [e["n"] for e in lines[1:]] == [0, 1]
    facts["gpu"] = None                                      # at close, with a changed key
    key[0] = 2
    w.close()
    lines = _load(path)
    assert lines[0]["gpu"] is None and [e["ev"] for e in lines[1:]] == ["step", "step", "end"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]   # no temporary file left


def test_started_writer_renames_under_its_rank_with_the_right_header(tmp_path, monkeypatch, trace_format):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    w = TraceWriter(str(tmp_path))
    w.start()
    assert [p.name for p in tmp_path.iterdir()] == [name(f"pid{os.getpid()}", trace_format)]
    w.emit({"ev": "step", "n": 0})
    w.set_rank(1, 2)                        # before any flush: the header-only file is renamed
    w.emit({"ev": "step", "n": 1})
    w.flush()
    w.set_rank(1, 2)                        # the same rank again: nothing to do
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == [name("rank1", trace_format)]
    lines = _load(tmp_path / name("rank1", trace_format))
    assert (lines[0]["rank"], lines[0]["world_size"]) == (1, 2)
    assert [e.get("n") for e in lines[1:]] == [0, 1, None] and lines[-1]["ev"] == "end"


def test_nothing_recorded_and_write_empty_off_removes_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path))
    w.start()
    assert len(list(tmp_path.iterdir())) == 1
    w.write_empty = False
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_reopen_ends_the_old_file_and_starts_the_new_one_at_once(tmp_path, monkeypatch, trace_format):
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path / "a"))
    w.start()
    w.emit({"ev": "step", "n": 0})
    old = w.path
    w.reopen(str(tmp_path / "b"), [{"ev": "step", "n": 1}])
    assert [e["ev"] for e in _load(old)[1:]] == ["step", "end"]        # complete: readable as such
    assert len(_load(w.path)) == 1                                      # header at once
    w.reopen(str(tmp_path / "a"))                                       # back: a second name
    assert w.path.endswith(name(f"pid{os.getpid()}.2", trace_format))
    w.close()
    assert _load(tmp_path / "b" / name(f"pid{os.getpid()}", trace_format))[1] == {"ev": "step", "n": 1}


def test_the_timer_never_raises_and_counts_a_failing_flush(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path), flush_seconds=0.05)
    w.start()

    def boom():
        raise RuntimeError("injected")
    w._flush_locked = boom
    w.emit({"ev": "step", "n": 0})
    assert _wait_for(lambda: "writer.flush" in w._hook_errors, 5)
    assert w._timer.is_alive()
    del w._flush_locked
    w.close()
    hooks = [e for e in _load(w.path) if e.get("ev") == "hook_error"]
    assert hooks and hooks[0]["hook"] == "writer.flush"


def test_close_joins_the_timer_so_no_thread_of_ours_outlives_it(tmp_path, monkeypatch):
    """At exit the time flush must have returned before the interpreter finalizes (a daemon
    thread ended there under a C++ frame aborts the process): close() wakes it and joins it, also
    while it sleeps a whole long flush period."""
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path), flush_seconds=1000.0)
    w.start()
    timer = w._timer
    assert timer.is_alive()
    w.emit({"ev": "step", "n": 0})
    w.close()
    assert not timer.is_alive()
    assert not any(t.name == "hazsan-flush" for t in threading.enumerate())
    assert [e["ev"] for e in _load(w.path)[1:]] == ["step", "end"]


def test_emit_on_many_threads_while_the_timer_flushes_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path), flush_seconds=0.0, buffer_events=500)
    w.start()

    def work(k):
        for n in range(5000):
            w.emit({"ev": "step", "n": n, "k": k})
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    lines = [ev for ev in _load(w.path) if ev.get("ev") != "thread"]   # (host threads: the switches)
    assert len(lines) == 1 + 20000 + 1 and w.dropped_total == 0
    for k in range(4):
        assert [e["n"] for e in lines[1:-1] if e["k"] == k] == list(range(5000))
