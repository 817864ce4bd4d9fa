"""Normal shutdowns leave complete traces (issue 32, item 5; issue 27, "Never complete").

Real interpreters under HAZSAN=1 (the .pth bootstrap), stopped the way serving engines stop theirs:
  * vLLM's EngineCore and workers install SIGTERM/SIGINT handlers after capture started
    (vllm/v1/engine/core.py, EngineCoreProc.run_engine_core: the handler sets a shutdown flag, the
    busy loop raises SystemExit, `finally` shuts down), and their parent stops them with
    vllm/v1/utils.py `shutdown(procs)`: `proc.terminate()` (SIGTERM), `join` up to 5 s, then
    `kill_process_tree` (SIGKILL);
  * SGLang 0.5.23's `Engine.shutdown()` (srt/entrypoints/engine.py) calls
    `kill_process_tree(os.getpid(), include_parent=False)` (srt/utils/common.py): psutil's
    `children(recursive=True)` then `child.kill()`, SIGKILL to every child: its scheduler
    processes (spawned, one per TP rank) and multiprocessing's resource tracker alike.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trace_files import records

pytest.importorskip("torch")


def _env(traces, **extra):
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(traces), PYTHONWARNINGS="ignore")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HAZSAN_LEVEL", "HAZSAN_FLUSH_SECONDS", "HAZSAN_IDLE_SECONDS",
              "HAZSAN_TRACE_FORMAT", "HAZSAN_STEP_FLUSH_SECONDS"):
        env.pop(k, None)
    env.update(extra)
    return env


def _bare_env():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("HAZSAN", None)
    return env


def _start(code, env, cwd=None):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_json(traces):
    """check's summary; its exit is 0, or 2 exactly where events that may hold a hazard are missing
    (a trace cut during a step: no verdict; one cut after its last step's end still gets one)."""
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces), "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    summary = json.loads(out.stdout)["summary"]
    assert out.returncode == (2 if summary["verdict_blockers"] else 0), (out.returncode, out.stderr)
    return summary


def _check_text(traces):
    return subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ SIGTERM, the program's handler installed later
VLLM_LIKE = """
import signal, sys, time, torch
print("before", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
shutdown_requested = False
def signal_handler(signum, frame):          # vLLM's EngineCore: a flag, then SystemExit from the loop
    global shutdown_requested
    shutdown_requested = True
    print("handler ran", signal.Signals(signum).name, flush=True)
previous = signal.signal(signal.SIGTERM, signal_handler)
signal.signal(signal.SIGINT, signal_handler)
print("previous is SIG_DFL", previous is signal.SIG_DFL, "getsignal is ours", signal.getsignal(signal.SIGTERM) is signal_handler, flush=True)
xs = [torch.ones(10) for _ in range(7)]     # buffered: a huge flush period, no step
print("ready", flush=True)
try:
    while not shutdown_requested:
        time.sleep(0.01)
    raise SystemExit(EXIT)
finally:
    ys = [torch.ones(11) for _ in range(3)]  # the shutdown's own work, recorded too
    print("shut down", flush=True)
"""


@pytest.mark.parametrize("exit_code", [0, 3])
def test_sigterm_to_a_program_that_installed_its_handler_after_capture(tmp_path, exit_code):
    code = VLLM_LIKE.replace("EXIT", str(exit_code))
    runs = {}
    for mode in ("bare", "captured"):
        traces = tmp_path / "t"
        env = _env(traces, HAZSAN_FLUSH_SECONDS="1000") if mode == "captured" else _bare_env()
        proc = _start(code, env)
        head = []
        while not head or head[-1].strip() != "ready":
            head.append(proc.stdout.readline())
            assert head[-1], proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        runs[mode] = (proc.returncode, "".join(head) + out)
    # the program's own handler ran, it saw its own handler and SIG_DFL before, same exit status
    assert runs["bare"] == runs["captured"]
    rc, out = runs["captured"]
    assert rc == exit_code
    assert "before True" in out and "previous is SIG_DFL True getsignal is ours True" in out
    assert "handler ran SIGTERM" in out and "shut down" in out
    (path,) = (tmp_path / "t").iterdir()
    shapes = [e.get("shape") for e in records(path)[1:] if e["ev"] == "alloc"]
    assert shapes.count([10]) == 7 and shapes.count([11]) == 3      # before the signal and after it
    doc = _check_json(tmp_path / "t")
    assert doc["complete"] is True and not doc["incomplete_files"]


def test_sigterm_with_no_handler_dies_of_it_and_completes_the_trace(tmp_path):
    code = """
    import torch, time
    xs = [torch.ones(10) for _ in range(7)]
    print("ready", flush=True)
    time.sleep(60)
    """
    proc = _start(code, _env(tmp_path / "t", HAZSAN_FLUSH_SECONDS="1000"))
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM         # the default action, as without capture
    doc = _check_json(tmp_path / "t")
    assert doc["complete"] is True and doc["events"] >= 7


def test_sighup_and_an_ignored_sigterm(tmp_path):
    """SIG_IGN set after capture is really ignored; SIGHUP's default action still kills, after the
    trace is closed."""
    code = """
    import signal, time, torch
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    xs = [torch.ones(10) for _ in range(3)]
    print("ready", flush=True)
    time.sleep(60)
    """
    proc = _start(code, _env(tmp_path / "t", HAZSAN_FLUSH_SECONDS="1000"))
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None                              # ignored
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == -signal.SIGHUP
    assert _check_json(tmp_path / "t")["complete"] is True


# ------------------------------------------------------------------ SIGKILL: what the check can say
STEPS = """
import sys, time, torch, sanitizer
for n in range(3):
    with sanitizer.step(n, phase="decode"):
        y = torch.ones(64) * n
        del y
WHAT
print("ready", flush=True)
time.sleep(60)
"""


def _killed(tmp_path, what, flush_seconds, idle_seconds=None, wait=None, step_flush_seconds=None):
    """STEPS with `what` after its last step, SIGKILLed once it printed ready (after `wait` s; by
    default three flush periods, or at once when the period is long); `step_flush_seconds`:
    HAZSAN_STEP_FLUSH_SECONDS (None: capture's default)."""
    traces = tmp_path / "t"
    extra = {"HAZSAN_IDLE_SECONDS": idle_seconds} if idle_seconds is not None else {}
    if step_flush_seconds is not None:
        extra["HAZSAN_STEP_FLUSH_SECONDS"] = step_flush_seconds
    proc = _start(STEPS.replace("WHAT", textwrap.dedent(what)),
                  _env(traces, HAZSAN_FLUSH_SECONDS=flush_seconds, **extra))
    if wait is None:
        wait = float(flush_seconds) * 3 if float(flush_seconds) < 100 else 0
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(wait)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (path,) = traces.iterdir()
    return path, _check_json(traces), _check_text(traces)


def test_sigkill_after_the_last_step_says_nothing_recorded_during_a_step_is_missing(tmp_path):
    # work between steps that no flush wrote (the time flush is 1000 s away, and so is idleness)
    # (every step's end flushed: HAZSAN_STEP_FLUSH_SECONDS=0)
    path, doc, text = _killed(tmp_path, "zs = [torch.ones(5) for _ in range(4)]", "1000", idle_seconds="1000",
                              step_flush_seconds="0")
    assert doc["complete"] is False
    (why,) = [f["why"] for f in doc["incomplete_files"]]
    assert why.startswith("no end record: the process was killed, or its last writes failed, after its last step (2)")
    assert "nothing recorded during a step is missing" in why
    assert "in at most the last 1000 s before it died" in why
    assert f"hazsan: INCOMPLETE: {path}: {why}" in text.stdout


def test_sigkill_after_a_step_whose_end_was_not_flushed_says_during_it(tmp_path):
    """Steps shorter than HAZSAN_STEP_FLUSH_SECONDS (capture's default: 0.05 s) have their ends
    flushed with a later flush: killed right after the last of them, with the time flush and
    idleness far away, the header still says that step runs, and the check claims no more."""
    path, doc, _ = _killed(tmp_path, "zs = [torch.ones(5) for _ in range(4)]", "1000", idle_seconds="1000",
                           step_flush_seconds="1000")
    (why,) = [f["why"] for f in doc["incomplete_files"]]
    assert "during step 2" in why and "events of step 2 among them" in why, why
    assert "nothing recorded during a step is missing" not in why
    head = records(path)[0]
    assert head["progress"]["step"] == 2 and head["progress"]["step_ended"] is False


def test_sigkill_during_a_step_says_so(tmp_path):
    what = """
    step = sanitizer.step(3)
    zs = [torch.ones(5) for _ in range(4)]
    """
    path, doc, _ = _killed(tmp_path, what, "1000")
    (why,) = [f["why"] for f in doc["incomplete_files"]]
    assert "during step 3" in why and "events of step 3 among them" in why
    assert "nothing recorded during a step is missing" not in why


def test_sigkill_soon_after_the_last_step_loses_nothing(tmp_path):
    """A program that marks step ends is idle HAZSAN_IDLE_SECONDS (0.05 s) after its last one:
    the events it recorded after it are written and the header says quiet, with the time flush
    1000 s away. Killed 1 s after its last step (room for a loaded machine): complete, those
    events in the file."""
    path, doc, text = _killed(tmp_path, "zs = [torch.ones(5) for _ in range(4)]", "1000", wait=1.0)
    assert doc["complete"] is True and not doc["incomplete_files"], doc
    assert "INCOMPLETE" not in text.stdout
    head, *evs = records(path)
    assert head["progress"]["quiet"] is True and head["progress"]["step_ended"] is True
    assert [e.get("shape") for e in evs if e["ev"] == "alloc"].count([5]) == 4


def test_sigkill_of_an_idle_process_loses_nothing(tmp_path):
    """Idle for a few flush periods: the header says every recorded event is in the file."""
    path, doc, text = _killed(tmp_path, "zs = [torch.ones(5) for _ in range(4)]", "0.2")
    assert doc["complete"] is True and not doc["incomplete_files"], doc
    notes = [w for w in doc["warnings"] if str(path) in w]
    assert notes == [f"{path}: no end record, nothing missing: the process was killed, or ended without a "
                     "clean exit, while idle: every event it recorded is in the file"]
    assert "INCOMPLETE" not in text.stdout
    shapes = [e.get("shape") for e in records(path)[1:] if e["ev"] == "alloc"]
    assert shapes.count([5]) == 4


# ------------------------------------------------------------------ the two engines' shutdown sequences
RANKS = """
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
import sanitizer

def rank(r, port, ready, work_after):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    t = torch.ones(32)
    for n in range(4):                       # the scheduler's batches, one step each
        with sanitizer.step(n, phase="decode"):
            dist.all_reduce(t)
    if work_after:
        zs = [torch.ones(7) for _ in range(5)]   # after the last step, never flushed
    ready.put(r)
    while True:                              # SGLang's event loop, idle: polls for requests
        if POLL:                             # TP > 1: broadcast_pyobj of no request, every loop
            size = torch.tensor([0], dtype=torch.long)
            dist.broadcast(size, src=0)
            del size
        time.sleep(0.002)

if __name__ == "__main__":
    import psutil, socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")            # SGLang: mp.set_start_method("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=rank, args=(r, port, ready, WORK_AFTER)) for r in range(2)]
    for p in procs:
        p.start()
    assert sorted(ready.get(timeout=300) for _ in procs) == [0, 1]
    time.sleep(IDLE)
    if WAIT_QUIET:                           # capture's hook on Engine.shutdown, before the kill
        from sanitizer.capture.child_traces import wait_until_quiet
        pending, waited = wait_until_quiet(os.environ["HAZSAN_DIR"])
        print("waited", sorted(pending), round(waited, 3), flush=True)
    # SGLang 0.5.23 Engine.shutdown -> kill_process_tree(os.getpid(), include_parent=False)
    children = psutil.Process(os.getpid()).children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=60)
    print("killed", len(children), flush=True)
"""


def _sglang_shutdown(tmp_path, work_after, idle, flush_seconds, poll=False, idle_seconds=None, wait_quiet=False,
                     step_flush_seconds=None):
    pytest.importorskip("psutil")
    traces = tmp_path / "t"
    script = tmp_path / "engine.py"
    script.write_text(RANKS.replace("WORK_AFTER", str(work_after)).replace("IDLE", str(idle))
                      .replace("POLL", str(poll)).replace("WAIT_QUIET", str(wait_quiet)))
    extra = {"HAZSAN_IDLE_SECONDS": idle_seconds} if idle_seconds is not None else {}
    if step_flush_seconds is not None:
        extra["HAZSAN_STEP_FLUSH_SECONDS"] = step_flush_seconds
    out = subprocess.run([sys.executable, str(script)], env=_env(traces, HAZSAN_FLUSH_SECONDS=flush_seconds, **extra),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    # two ranks and the resource tracker that spawn started
    assert "killed 3" in out.stdout, out.stdout
    if wait_quiet:
        return traces, out.stdout
    return traces


@pytest.mark.parametrize("poll", [False, True])
def test_sglang_engine_shutdown_of_idle_schedulers_leaves_complete_traces(tmp_path, poll):
    """Idle: nothing recorded (TP=1), or a broadcast every loop (TP>1's idle polling: written as
    each event comes once a flush period passed with no step)."""
    traces = _sglang_shutdown(tmp_path, work_after=False, idle=1.5, flush_seconds="0.2", poll=poll)
    names = sorted(p.name for p in traces.iterdir())
    # the two ranks and the engine process itself; the SIGKILLed resource tracker never imported
    # torch and left no header-only pid file
    assert [n for n in names if n.startswith("rank")] == ["rank0.hzs", "rank1.hzs"], names
    assert len(names) == 3, names
    doc = _check_json(traces)
    assert doc["complete"] is True and not doc["incomplete_files"], doc
    for r in (0, 1):
        evs = records(traces / f"rank{r}.hzs")
        assert [e["n"] for e in evs[1:] if e["ev"] == "step"] == [0, 1, 2, 3]
        assert evs[0]["progress"]["quiet"] is True and evs[0]["progress"]["step_ended"] is True
        polls = sum(e["ev"] == "coll" and e["op"] == "c10d.broadcast_" for e in evs[1:])
        assert polls > 50 if poll else polls == 0


@pytest.mark.parametrize("poll", [False, True])
def test_sglang_engine_shutdown_soon_after_work_leaves_complete_traces(tmp_path, poll):
    """Engine.shutdown() 1 s after the schedulers' last step (no wait hook), work recorded after it
    and the time flush 1000 s away: idle 0.05 s after the step (HAZSAN_IDLE_SECONDS), so quiet,
    every event written, the polling too, each as it came."""
    traces = _sglang_shutdown(tmp_path, work_after=True, idle=1.0, flush_seconds="1000", poll=poll)
    doc = _check_json(traces)
    assert doc["complete"] is True and not doc["incomplete_files"], doc
    for r in (0, 1):
        head, *evs = records(traces / f"rank{r}.hzs")
        assert head["progress"]["quiet"] is True and head["progress"]["step_ended"] is True
        assert [e["n"] for e in evs if e["ev"] == "step"] == [0, 1, 2, 3]
        assert [e.get("shape") for e in evs if e["ev"] == "alloc"].count([7]) == 5
        polls = sum(e["ev"] == "coll" and e["op"] == "c10d.broadcast_" for e in evs)
        assert polls > 10 if poll else polls == 0


@pytest.mark.parametrize("poll", [False, True])
def test_engine_shutdown_hook_waits_for_quiet_children_then_the_kill_loses_nothing(tmp_path, poll):
    """What capture's hook on SGLang's Engine.shutdown does (child_traces.wait_until_quiet) before
    the SIGKILLs: killed at once after the ranks' last step, work recorded after it and the time
    flush 1000 s away, every trace is complete, the wait under its 1 s bound."""
    from sanitizer.capture import child_traces

    traces, stdout = _sglang_shutdown(tmp_path, work_after=True, idle=0, flush_seconds="1000", poll=poll,
                                      wait_quiet=True)
    (line,) = [l for l in stdout.splitlines() if l.startswith("waited")]
    assert line.startswith("waited [] "), line
    assert 0 < float(line.split()[-1]) < child_traces.WAIT_SECONDS, line
    doc = _check_json(traces)
    assert doc["complete"] is True and not doc["incomplete_files"], doc
    for r in (0, 1):
        evs = records(traces / f"rank{r}.hzs")[1:]
        assert [e.get("shape") for e in evs if e["ev"] == "alloc"].count([7]) == 5


def test_engine_shutdown_hook_waits_at_most_its_bound_for_a_child_inside_a_step(tmp_path):
    """A child that never becomes quiet (the time flush and idleness 1000 s away): the wait gives
    up after its bound and names the file; the kill then leaves it reported as before."""
    from sanitizer.capture import child_traces

    traces, stdout = _sglang_shutdown(tmp_path, work_after=True, idle=0, flush_seconds="1000",
                                      idle_seconds="1000", wait_quiet=True)
    (line,) = [l for l in stdout.splitlines() if l.startswith("waited")]
    assert "'rank0.hzs'" in line and "'rank1.hzs'" in line, line
    assert child_traces.WAIT_SECONDS <= float(line.split()[-1]) < child_traces.WAIT_SECONDS + 1, line
    assert _check_json(traces)["complete"] is False


def test_sglang_engine_shutdown_right_after_work_names_what_may_be_missing(tmp_path):
    # killed at once after the ranks' last step, idleness and the time flush 1000 s away
    traces = _sglang_shutdown(tmp_path, work_after=True, idle=0, flush_seconds="1000", idle_seconds="1000",
                              step_flush_seconds="0")       # every step's end flushed
    doc = _check_json(traces)
    assert doc["complete"] is False
    files = {Path(f["file"]).name: f["why"] for f in doc["incomplete_files"]}
    assert sorted(files) == ["rank0.hzs", "rank1.hzs"], files
    for why in files.values():
        assert "after its last step (3)" in why and "nothing recorded during a step is missing" in why


VLLM_SHUTDOWN = """
import os, signal, sys, time
import torch, torch.multiprocessing as mp

def engine_core(ready, hang):
    shutdown_requested = False
    def signal_handler(signum, frame):       # vllm/v1/engine/core.py run_engine_core
        nonlocal shutdown_requested
        shutdown_requested = True
    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal_handler)
    xs = [torch.ones(9) for _ in range(6)]
    ready.put(1)
    try:
        while not shutdown_requested:
            time.sleep(0.01)
        raise SystemExit
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        ys = [torch.ones(13) for _ in range(2)]   # engine_core.shutdown()
        if hang:
            time.sleep(60)                        # a shutdown slower than vLLM waits for

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=engine_core, args=(ready, HANG))
    proc.start()
    ready.get(timeout=300)
    # vllm/v1/utils.py shutdown(procs): terminate, join until the deadline, then SIGKILL
    proc.terminate()
    proc.join(WAIT)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    print("exitcode", proc.exitcode, flush=True)
"""


@pytest.mark.parametrize("hang", [False, True])
def test_vllm_terminate_then_kill(tmp_path, hang):
    traces = tmp_path / "t"
    script = tmp_path / "core.py"
    # vLLM waits 5 s; a shorter wait here: the hanging shutdown is killed either way
    script.write_text(VLLM_SHUTDOWN.replace("HANG", str(hang)).replace("WAIT", "2" if hang else "60"))
    out = subprocess.run([sys.executable, str(script)], env=_env(traces, HAZSAN_FLUSH_SECONDS="1000"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"exitcode {-9 if hang else 0}" in out.stdout, out.stdout
    doc = _check_json(traces)
    if not hang:
        assert doc["complete"] is True, doc
        return
    (why,) = [f["why"] for f in doc["incomplete_files"]]
    assert why.startswith("no end record: killed during shutdown (SIGTERM arrived and the program's own "
                          "handler ran; the process died before it exited)")
    assert "in at most the last 1000 s before it died" in why
    core = [p for p in traces.iterdir() if str(p) == doc["incomplete_files"][0]["file"]][0]
    shapes = [e.get("shape") for e in records(core)[1:] if e["ev"] == "alloc"]
    assert shapes.count([9]) == 6          # flushed when SIGTERM arrived


# ------------------------------------------------------------------ the writer's part, in process
def _header(path):
    return records(path)[0]


def test_quiet_is_said_after_the_time_flush_and_taken_back_before_the_next_event(tmp_path):
    from sanitizer.trace.writer import TraceWriter
    w = TraceWriter(str(tmp_path), flush_seconds=0.05, trace_format="binary")
    w.start()
    try:
        w.emit({"ev": "step", "n": 0})
        deadline = time.monotonic() + 30
        while not _header(w.path)["progress"]["quiet"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [e["ev"] for e in records(w.path)[1:]] == ["step"]       # written before it said so
        w.emit({"ev": "step", "n": 1})
        # back to "not everything is in the file" before emit returned, the event still buffered
        assert _header(w.path)["progress"]["quiet"] is False
        assert [e["n"] for e in records(w.path)[1:]] == [0]
        w.hook_failed("x", RuntimeError("y"))                        # a count is something to write too
        assert _header(w.path)["progress"]["quiet"] is False
    finally:
        w.close()


def test_a_signal_handler_inside_emit_runs_after_the_append(tmp_path):
    """Python may run a signal handler between any two bytecodes of the main thread, inside the
    writer too: its flush must not swap the buffer between emit's read and append."""
    from sanitizer.trace.writer import TraceWriter
    w = TraceWriter(str(tmp_path), flush_seconds=1000, trace_format="binary")
    w.start()
    ran = []

    class Interrupted(list):
        def append(self, ev):
            w.when_outside(lambda: (ran.append(len(self)), w.flush()))  # the "handler": a flush
            super().append(ev)

    w._buf = Interrupted()
    w.emit({"ev": "step", "n": 7})
    assert ran == [1]                          # after the append, not in the middle of it
    assert [e["n"] for e in records(w.path)[1:] if e["ev"] == "step"] == [7]
    w.close()
    assert records(w.path)[-1]["ev"] == "end"


def test_signal_functions_behave_as_stock_under_capture(tmp_path):
    code = """
    import signal, threading
    out = []
    def h(s, f): pass
    out.append(signal.signal(signal.SIGTERM, h) is signal.SIG_DFL)
    out.append(signal.signal(signal.SIGTERM, signal.SIG_IGN) is h)
    out.append(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
    out.append(signal.signal(signal.SIGTERM, signal.SIG_DFL) is signal.SIG_IGN)
    out.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    out.append(signal.signal(signal.SIGUSR1, h) is signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) is h)
    try:
        signal.signal(signal.SIGTERM, 42)
    except TypeError as e:
        out.append("TypeError")
    errs = []
    t = threading.Thread(target=lambda: errs.append(_try()))
    def _try():
        try:
            signal.signal(signal.SIGTERM, h)
        except ValueError:
            return "ValueError"
    t.start(); t.join()
    out += errs
    out.append(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    print(out)
    """
    bare = _start(code, _bare_env()).communicate(timeout=60)[0]
    cap = _start(code, _env(tmp_path / "t")).communicate(timeout=60)[0]
    assert bare == cap and "False" not in cap and "TypeError" in cap and "ValueError" in cap, (bare, cap)


def test_between_steps_idle_events_are_written_as_they_come_until_the_next_step(tmp_path):
    from sanitizer.trace.writer import TraceWriter
    w = TraceWriter(str(tmp_path), flush_seconds=0.05, trace_format="binary")
    w.start()
    try:
        w.mark_step(0, ended=False)
        w.emit({"ev": "step", "n": 0})
        w.flush()
        w.mark_step(0, ended=True)
        deadline = time.monotonic() + 30
        while True:                        # an idle loop that records all the time
            w.emit({"ev": "free", "id": 1})
            if _header(w.path)["progress"]["quiet"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for i in range(3):                 # each on disk before emit returns, the header still quiet
            before = len(records(w.path))
            w.emit({"ev": "free", "id": 100 + i})
            assert len(records(w.path)) == before + 1
            assert _header(w.path)["progress"]["quiet"] is True
        w.mark_step(1, ended=False)        # a step: buffered again, said before its first event
        assert _header(w.path)["progress"] == {"quiet": False, "step": 1, "step_ended": False}
        before = len(records(w.path))
        w.emit({"ev": "step", "n": 1})
        assert len(records(w.path)) == before
    finally:
        w.close()
