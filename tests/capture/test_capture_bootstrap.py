"""Activation from the environment, robustness of the hooks and of the trace file.

Every test starts fresh interpreters, so what is checked is what a user gets: the .pth line
installed with the package, HAZSAN in the environment, and nothing else.
"""
from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sanitizer.trace.reader import open_trace
from sanitizer.trace.writer import TraceWriter

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

ROOT = Path(__file__).resolve().parents[2]


def py(code, env_extra=None, cwd=None, timeout=90, unset=("HAZSAN",)):
    env = dict(os.environ)
    for k in (*unset, "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def load(path):
    with open(path, "rb") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ the bootstrap line
def test_pth_is_installed_in_this_environment():
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    found = [Path(d) / "hazsan_capture.pth" for d in dirs if (Path(d) / "hazsan_capture.pth").exists()]
    assert found, f"hazsan_capture.pth not in {dirs}: reinstall with pip install -e ."
    assert found[0].read_text() == (ROOT / "hooks" / "hazsan_capture.pth").read_text()


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_unset_bootstrap_imports_nothing(value, tmp_path):
    env = {"HAZSAN_DIR": str(tmp_path / "t")}
    if value is not None:
        env["HAZSAN"] = value
    out = py("""
        import sys
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('sanitizer', 'wrapt', 'orjson', 'torch')))
    """, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "t").exists()


def test_set_bootstrap_waits_for_torch(tmp_path):
    """HAZSAN=1 installs hooks but imports torch only when the program does."""
    out = py("""
        import sys
        print('torch' in sys.modules, 'sanitizer.capture.bootstrap' in sys.modules)
        import sanitizer
        print(sanitizer.enabled())
        import torch
        from sanitizer.capture.runtime import active
        print(active().installed)
    """, {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path / "t")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "False True" and lines[1] == "True"
    assert "dispatch-mode" in lines[2] and "collectives" in lines[2]


# ------------------------------------------------------------------ reaching children
CHILD = """
import os, torch
x = torch.ones(123)
print(os.getpid(), flush=True)
"""

PARENT = """
import multiprocessing as mp, subprocess, sys, os

def spawned(q):
    import torch
    y = torch.zeros(321)
    q.put(os.getpid())

if __name__ == "__main__":
    out = subprocess.run([sys.executable, "child.py"], capture_output=True, text=True, check=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=spawned, args=(q,))
    p.start(); pid = q.get(timeout=60); p.join()
    print(out.stdout.strip(), pid)
    print("torch" in sys.modules)
"""


def test_activation_reaches_subprocess_and_spawned_child(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"))
    out = subprocess.run([sys.executable, "parent.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().split("\n")
    sub_pid, spawn_pid = map(int, first.split())
    assert second == "False"                           # the parent never imported torch
    files = sorted(os.listdir(tmp_path / "t"))
    assert files == sorted([f"pid{sub_pid}.jsonl", f"pid{spawn_pid}.jsonl"])   # no parent trace
    sub = load(tmp_path / "t" / f"pid{sub_pid}.jsonl")
    assert sub[0]["pid"] == sub_pid
    assert any(e["ev"] == "alloc" and e.get("shape") == [123] for e in sub[1:])
    spawned = load(tmp_path / "t" / f"pid{spawn_pid}.jsonl")
    assert any(e["ev"] == "alloc" and e.get("shape") == [321] for e in spawned[1:])


def test_rank_from_environment(tmp_path):
    out = py("import torch; torch.ones(1)", {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path), "RANK": "3",
                                             "WORLD_SIZE": "8"}, unset=())
    # py() removes RANK first, then env_extra puts it back
    assert out.returncode == 0, out.stderr
    header = load(tmp_path / "rank3.jsonl")[0]
    assert (header["rank"], header["world_size"]) == (3, 8)


# ------------------------------------------------------------------ killed programs
LOOP = """
import sys, time, torch, sanitizer
keep = []
for n in range(100000):
    sanitizer.step(n)
    keep.append(torch.ones(64) * n)
    if len(keep) > 8:
        keep.pop(0)
    print(n, flush=True)
    time.sleep(0.002)
"""


def _start_loop(tmp_path, extra=None):
    (tmp_path / "loop.py").write_text(LOOP)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), **(extra or {}))
    proc = subprocess.Popen([sys.executable, "loop.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for _ in range(50):                       # wait for a few steps
        line = proc.stdout.readline()
        if line and int(line) >= 20:
            break
    return proc


def test_sigkill_leaves_parsable_trace_up_to_last_flush(tmp_path):
    from sanitizer.rules.driver import analyze
    proc = _start_loop(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (path,) = (tmp_path / "t").iterdir()
    tf = open_trace(path)
    steps = [ev["n"] for _, ev in tf.events() if isinstance(ev, dict) and ev.get("ev") == "step"]
    assert len(steps) >= 20 and steps == list(range(len(steps)))   # every flushed step, in order
    a = analyze([path])
    assert not a.errors and a.summary["events"] > 40


def test_sigterm_flushes_buffered_events(tmp_path):
    # no step markers flush here (a huge buffer and flush interval): only the SIGTERM handler can
    code = """
import os, signal, sys, time, torch
xs = [torch.ones(10) for _ in range(7)]
print("ready", flush=True)
time.sleep(60)
"""
    (tmp_path / "term.py").write_text(code)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), HAZSAN_FLUSH_SECONDS="1000")
    proc = subprocess.Popen([sys.executable, "term.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM          # still dies of SIGTERM
    (path,) = (tmp_path / "t").iterdir()
    allocs = [e for e in load(path)[1:] if e["ev"] == "alloc" and e.get("shape") == [10]]
    assert len(allocs) == 7


# ------------------------------------------------------------------ hooks never raise
INJECT = """
import torch, torch.distributed as dist, sanitizer
from sanitizer.capture.runtime import active
cap = active()
def boom(*a, **k):
    raise RuntimeError("injected")
cap.sites.where = boom                      # every allocation hook now fails
x = torch.arange(10.0) * 2
y = x.sum().item()
dist.init_process_group("gloo", init_method="file://{rdv}", rank=0, world_size=1)
cap.blocks.buffer = boom                    # every collective hook now fails
t = torch.ones(4)
dist.all_reduce(t)
w = dist.all_reduce(t, async_op=True); w.wait()
dist.destroy_process_group()
print(y, t.tolist())
"""


def test_exception_in_hook_does_not_reach_program(tmp_path):
    from sanitizer.rules.driver import analyze
    out = py(INJECT.format(rdv=tmp_path / "rdv"), {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path / "t")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "90.0 [1.0, 1.0, 1.0, 1.0]"
    assert "injected" not in out.stderr
    events = load(tmp_path / "t" / "rank0.jsonl")[1:]
    errors = {e["hook"]: e for e in events if e["ev"] == "hook_error"}
    assert errors["dispatch"]["count"] >= 2 and "injected" in errors["dispatch"]["error"]
    assert errors["coll.c10d.allreduce_"]["count"] == 2
    a = analyze([tmp_path / "t"])
    assert not a.errors and a.summary["hook_errors"] == sum(e["count"] for e in errors.values())


def test_event_cap_drops_are_counted_in_trace_and_report(tmp_path):
    from sanitizer.rules.driver import analyze
    out = py("""
        import torch, sanitizer
        for n in range(40):
            x = torch.ones(8) + n
        sanitizer.step(1)
    """, {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path / "t"), "HAZSAN_MAX_EVENTS": "30"})
    assert out.returncode == 0, out.stderr
    (path,) = (tmp_path / "t").iterdir()
    events = load(path)[1:]
    drops = [e for e in events if e["ev"] == "dropped"]
    assert drops and drops[0]["reason"] == "max-events"
    assert len([e for e in events if e["ev"] not in ("dropped", "hook_error", "end")]) == 30
    assert events[-1]["ev"] == "end" and events[-1]["dropped"] >= 80
    a = analyze([path])                   # a prefix of the event stream: still well-formed
    assert not a.errors
    assert a.summary["dropped_events"] == sum(e["count"] for e in drops) >= 80
    assert any("dropped" in w for w in a.summary["warnings"])


def test_bad_settings_fall_back_and_are_reported(tmp_path):
    out = py("import torch; torch.ones(1); import sanitizer; sanitizer.step(0)",
             {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path), "HAZSAN_STACKS": "bogus",
              "HAZSAN_MAX_EVENTS": "many"})
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.iterdir()
    events = load(path)[1:]
    err = [e for e in events if e["ev"] == "hook_error" and e["hook"] == "settings"]
    assert err and err[0]["count"] == 2
    assert any(e["ev"] == "alloc" and "site" in e for e in events)   # fell back to "site"


# ------------------------------------------------------------------ the writer itself
def test_writer_renames_pid_file_when_rank_becomes_known(tmp_path, monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    w = TraceWriter(str(tmp_path))
    w.emit({"ev": "step", "n": 0})
    w.flush()
    assert os.listdir(tmp_path) == [f"pid{os.getpid()}.jsonl"]
    w.set_rank(2, 4)
    w.emit({"ev": "step", "n": 1})
    w.close()
    assert os.listdir(tmp_path) == ["rank2.jsonl"]
    lines = load(tmp_path / "rank2.jsonl")
    assert lines[0]["rank"] == 2 and lines[0]["world_size"] == 4
    assert [e["n"] for e in lines[1:-1]] == [0, 1] and lines[-1]["ev"] == "end"


@pytest.mark.parametrize("flushed", [False, True])
def test_world_size_learnt_later_keeps_the_rank_file(tmp_path, monkeypatch, flushed):
    """RANK in the environment names the file at start; init_process_group then tells the world
    size. The file keeps its name and gets the world size in its header. (It used to be copied
    onto its own name: taken over as a stale file and unlinked, "trace file removed while
    running", a hook error in PyTorch's own FileStore tests.)"""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = TraceWriter(str(tmp_path))
    w.start()
    if flushed:
        w.emit({"ev": "step", "n": 0})
        w.flush()
    w.set_rank(0, 4)
    assert os.listdir(tmp_path) == ["rank0.jsonl"]
    w.emit({"ev": "step", "n": 1})
    w.close()
    assert os.listdir(tmp_path) == ["rank0.jsonl"]
    lines = load(tmp_path / "rank0.jsonl")
    assert lines[0]["rank"] == 0 and lines[0]["world_size"] == 4
    assert [e["n"] for e in lines[1:-1]] == ([0, 1] if flushed else [1])
    assert lines[-1] == {"ev": "end", "events": 2 if flushed else 1, "dropped": 0}


def test_rank_from_environment_then_init_process_group(tmp_path):
    """The same through real torch: RANK=0 in the environment, WORLD_SIZE not, a FileStore group."""
    code = f"""
        import torch, torch.distributed as dist
        store = dist.FileStore({str(tmp_path / "store")!r}, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        x = torch.ones(8)
        dist.all_reduce(x)
        dist.destroy_process_group()
    """
    out = py(code, {"HAZSAN": "1", "HAZSAN_DIR": str(tmp_path / "t"), "RANK": "0"}, unset=())
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path / "t") == ["rank0.jsonl"], out.stderr
    lines = load(tmp_path / "t" / "rank0.jsonl")
    assert (lines[0]["rank"], lines[0]["world_size"]) == (0, 1)
    events = lines[1:]                  # (the header has no "ev")
    assert not [e for e in events if e.get("ev") in ("hook_error", "dropped")], events
    assert any(e.get("ev") == "coll" for e in events) and events[-1]["ev"] == "end"


SPAWNED_WITH_STALE_RANK = """
import sys, torch.multiprocessing as mp

def worker(rank, store_path):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    x = torch.full((8,), float(rank))
    dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
"""


def test_ranks_spawned_with_a_stale_rank_in_the_environment(tmp_path):
    """Both ranks inherit RANK=0 (a parent process that ran an env:// test before, as PyTorch's
    RendezvousEnvTest leaves it): both start as rank 0, one in rank0, the other in rank0.pid<N>;
    init_process_group then names each after its real rank. Both files whole, no hook error.
    (Before, a rank that kept the name rank0 unlinked its own file: PyTorch's FileStore tests run
    in a batch after RendezvousEnvTest had hook errors and lost traces.)"""
    (tmp_path / "prog.py").write_text(SPAWNED_WITH_STALE_RANK)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), HAZSAN_TRACE_FORMAT="jsonl",
               RANK="0")
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "prog.py", str(tmp_path / "store")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the launcher holds RANK=0 too: its file is rank 0's of a world of one, with nothing in it
    files = {f: load(tmp_path / "t" / f) for f in os.listdir(tmp_path / "t")}
    ranks = {(lines[0]["rank"], lines[0].get("world_size")): (f, lines) for f, lines in files.items()}
    assert len(files) == 3 and {(0, 2), (1, 2)} <= set(ranks), sorted(files)
    assert all(lines[-1].get("ev") == "end" for lines in files.values()), sorted(files)
    for r in (0, 1):
        f, lines = ranks[(r, 2)]
        events = lines[1:]
        assert not [e for e in events if e.get("ev") in ("hook_error", "dropped")], events
        assert sum(e.get("ev") == "coll" for e in events) >= 2 and events[-1]["ev"] == "end"


def test_writer_never_clobbers_another_process_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "rank0.jsonl").write_text("someone else's\n")
    w = TraceWriter(str(tmp_path))
    w.emit({"ev": "step", "n": 0})
    w.close()
    assert (tmp_path / "rank0.jsonl").read_text() == "someone else's\n"
    assert load(tmp_path / f"rank0.pid{os.getpid()}.jsonl")[0]["rank"] == 0


def test_writer_counts_failed_writes(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    w = TraceWriter(str(blocker / "sub"))          # cannot create a directory under a file
    w.emit({"ev": "step", "n": 0})
    w.flush()                                      # must not raise
    assert w.dropped_total == 1


def test_writer_time_flush_is_a_timer_not_an_event_count(tmp_path, monkeypatch):
    """One event, then nothing: the timer thread writes it within flush_seconds (no 512-event tick)."""
    import time
    monkeypatch.delenv("RANK", raising=False)
    w = TraceWriter(str(tmp_path), flush_seconds=0.2)
    w.start()
    try:
        (name,) = os.listdir(tmp_path)
        assert [e.get("ev") for e in load(tmp_path / name)] == [None]          # the header, at once
        w.emit({"ev": "step", "n": 0})
        deadline = time.monotonic() + 5
        while len(load(tmp_path / name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load(tmp_path / name)[1] == {"ev": "step", "n": 0}
    finally:
        w.close()
    assert load(tmp_path / name)[-1]["ev"] == "end"
    assert w._timer is None
