"""The native allocation recorder (HAZSAN_NATIVE=1, sanitizer/capture/native): real programs run
with it, their traces read back. The same gloo programs as the dispatch mode's tests also run at
`alloc-native` (test_capture_backend_semantics.py, test_capture_public_patterns.py: the same
assertions); here, what is particular to it: the allocator's contract kept, sites, scopes, frees,
fork, drops counted, completeness at a kill, the fallback and the header saying which path ran,
and the mHC decode's verdict equal on both paths."""
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

from gloo_programs import require_native

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("jsonl_capture")


def _env(traces, native="1", **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    env.update(HAZSAN="1", HAZSAN_DIR=str(traces), HAZSAN_NATIVE=native, HAZSAN_RAISE="1",
               HAZSAN_TRACE_FORMAT="jsonl", PYTHONPATH=str(ROOT))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(tmp_path, code, env, timeout=120):
    (tmp_path / "prog.py").write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, "prog.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _trace(traces):
    files = sorted(Path(traces).glob("*.jsonl"))
    return {f: [json.loads(x) for x in f.read_text().splitlines()] for f in files}


def _check(traces, *more):
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces), "--format", "json", *more],
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


@pytest.fixture(autouse=True)
def _native_here():
    require_native()


CONTRACT = """
    import hashlib, io, pickle, torch
    import numpy as np
    out = []
    a = torch.arange(1000, dtype=torch.float32)
    buf = io.BytesIO(); torch.save({"a": a, "b": a[10:20]}, buf); buf.seek(0)
    d = torch.load(buf)
    out.append(d["b"].tolist() + [d["a"].sum().item()])
    n = a.numpy(); n[0] = 7.0                       # shares memory
    out.append([a[0].item(), torch.from_numpy(np.ones(5)).sum().item()])
    r = torch.ones(4); r.resize_(1000); r.fill_(2.0); out.append([r.sum().item()])
    s = torch.ones(64).share_memory_(); s.add_(1); out.append([s.sum().item(), s.is_shared()])
    v, i = torch.sort(torch.tensor([3.0, 1.0, 2.0])); out.append(v.tolist() + i.tolist())
    f = torch.frombuffer(bytearray(b"abcd" * 4), dtype=torch.int32); out.append(f.tolist())
    p = pickle.loads(pickle.dumps(torch.full((8,), 3.0))); out.append(p.tolist())
    big = torch.empty(1 << 22).fill_(1.0); out.append([big.sum().item()])
    print(hashlib.sha256(repr(out).encode()).hexdigest())
"""


def test_the_programs_results_are_unchanged_and_its_trace_clean(tmp_path):
    """torch.save/load, numpy sharing, resize_, share_memory_, frombuffer, pickle through the
    wrapped allocator: the same results as without capture; the trace says native, clean, complete."""
    bare = _run(tmp_path, CONTRACT, {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")})
    assert bare.returncode == 0, bare.stderr
    traces = tmp_path / "t"
    cap = _run(tmp_path, CONTRACT, _env(traces))
    assert cap.returncode == 0, cap.stderr
    assert cap.stdout == bare.stdout
    ((path, events),) = _trace(traces).items()
    # the default level, full: the launches from the recorder's op observer too
    assert events[0]["hooks"]["alloc"] == {"source": "native", "launches": "record-function"}
    assert "native-recorder" in events[0]["hooks"]["installed"]
    assert "dispatch-mode" not in events[0]["hooks"]["installed"]
    allocs = [e for e in events[1:] if e["ev"] == "alloc"]
    assert any(e["size"] == 4 << 22 and e["site"].startswith("prog.py:") for e in allocs)
    doc = _check(traces)
    assert doc["findings"] == [] and doc["summary"]["complete"] and doc["summary"]["hook_errors"] == 0


SITES = """
    import torch, sanitizer
    def make(n):
        return torch.ones(n)                                   # line 4
    keep = make(1000)
    gone = make(2000); del gone                               # freed at once
    with sanitizer.symmetric_scope("tp"):
        x = make(3000)                                         # placed in the window
        y = torch.einsum("i,i->i", x, x)                       # line 9: its result, in the window too
    z = make(4000)
    print("done")
"""


def test_sites_frees_and_scope_placement(tmp_path):
    traces = tmp_path / "t"
    out = _run(tmp_path, SITES, _env(traces))
    assert out.returncode == 0, out.stderr
    ((path, events),) = _trace(traces).items()
    body = events[1:]
    by_size = {}
    for e in body:
        if e["ev"] == "alloc":
            by_size.setdefault(e["size"], []).append(e)
    (a4k,) = by_size[4000]
    assert a4k["site"] == "prog.py:4:make" and a4k["pool"] == "default" and a4k["stream"] == "cpu"
    assert "op" not in a4k and "shape" not in a4k       # the allocator sees bytes only
    (a8k,) = by_size[8000]
    frees = [e["id"] for e in body if e["ev"] == "free"]
    assert a8k["id"] in frees and a4k["id"] not in frees[:frees.index(a8k["id"]) + 1]
    scope = [i for i, e in enumerate(body) if e["ev"] == "scope"]
    assert [body[i]["enter"] for i in scope] == [True, False]
    inside = [e for e in body[scope[0]:scope[1]] if e["ev"] == "alloc"]
    assert {e.get("requested", e["size"]) for e in inside} >= {12000}   # (the model rounds sizes up)
    assert all(e["pool"] == "symm" for e in inside), inside
    (win,) = [e for e in body if e["ev"] == "window"]
    assert all(win["addr"] <= e["addr"] < win["addr"] + win["size"] for e in inside)
    assert any(e["site"] == "prog.py:9:<module>" for e in inside)
    (a16k,) = by_size[16000]
    assert a16k["pool"] == "default"
    ts = [e["t"] for e in body if e["ev"] in ("alloc", "free")]
    assert ts == sorted(ts)


def _said(stderr: str) -> str:
    """What capture said on stderr besides its one line at exit (where the traces are), which the
    run's first process always says (docs/capture.md, "What it says on stderr")."""
    lines = stderr.splitlines()
    where = [x for x in lines if x.startswith("hazsan: traces in ")]
    assert len(where) == 1 and "next: hazsan check" in where[0], stderr
    return "\n".join(x for x in lines if x not in where)


def test_level_off_uses_the_dispatch_mode_and_full_says_where_launches_come_from(tmp_path):
    code = "import torch; x = torch.ones(10); y = x + 1; print('ok')"
    full = _run(tmp_path, code, _env(tmp_path / "full", HAZSAN_LEVEL="full"))
    assert full.returncode == 0 and full.stdout.strip() == "ok" and _said(full.stderr) == "", full.stderr
    ((_, ev_full),) = _trace(tmp_path / "full").items()
    assert ev_full[0]["hooks"]["alloc"] == {"source": "native", "launches": "record-function"}
    assert "dispatch-mode" not in ev_full[0]["hooks"]["installed"]
    (launch,) = [e for e in ev_full[1:] if e["ev"] == "launch" and e["op"] == "aten.add.Tensor"]
    assert launch["site"] == "prog.py:1:<module>" and launch["stream"] == "cpu"
    off = _run(tmp_path, code, _env(tmp_path / "off", native="0"))
    assert off.returncode == 0 and _said(off.stderr) == "", off.stderr
    ((_, ev_off),) = _trace(tmp_path / "off").items()
    assert ev_off[0]["hooks"]["alloc"] == {"source": "dispatch-mode", "native": "HAZSAN_NATIVE=0"}


# Every way an op reaches the dispatcher that the dispatch mode treats apart: composite ops (seen
# decomposed where autograd runs, whole in inference mode), out= and in-place writes, Python
# numbers made tensors, list arguments, torch.tensor()'s own calls, an op that raises, a thread
# started later, a tensor subclass, storages of another allocator (numpy: a launch reading one, into
# a block freed before the records are drained), a resize, and torch.compile tracing.
LAUNCHES = """
    import threading, torch, numpy as np, sanitizer
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    loss = m(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(p.grad, alpha=-0.1)
    a = torch.ones(10); b = torch.empty(10)
    torch.add(a, 1.0, out=b)
    c = torch.cat([a, b]); d = c[::2].clone() * 2
    f = torch.from_numpy(np.arange(6.0)); g = f + 1; g2 = f * f; o = torch.empty(6, dtype=torch.float64); o.copy_(f); del o; open("numpy_memory", "w").write(str(f.data_ptr()))
    h = torch.stack([a, b]).sum(0)
    a.index_put_((torch.tensor([0, 2]),), torch.tensor([5.0, 6.0]))
    with torch.inference_mode():
        z = torch.nn.functional.softmax(torch.randn(3, 5), dim=-1)
        zl = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
    def work():
        q = torch.ones(7) * 3
    t = threading.Thread(target=work); t.start(); t.join()
    try:
        torch.ones(3) + torch.ones(4)
    except RuntimeError:
        pass
    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})
    u = torch.ones(5).as_subclass(Logged) + 1
    r = torch.ones(4); r.resize_(100); r.fill_(2.0)
    with sanitizer.symmetric_scope("tp"):
        w = torch.ones(64)
        w2 = w + w
    w3 = w2 + w
    def scaled(v):                      # traced by Dynamo with dynamic shapes: a factory op on a
        return v * torch.full((v.shape[0],), 2.0) + 1     # FakeTensor with symbolic sizes
    compiled = torch.compile(scaled, backend="eager", dynamic=True)
    cs = [float(compiled(torch.ones(n)).sum()) for n in (4, 8, 16)]
    print("ok", round(float(loss), 6), float(w3.sum()), cs)
"""


def _launches(events, external=()):
    """Each launch as (op, site, read sizes, write sizes), and whether each range lies inside a
    block alive at that point of the trace or in `external`, memory no allocator made ((addr, size))."""
    live, out, outside = {"external": r for r in external}, [], []
    for e in events[1:]:
        if e["ev"] == "alloc":
            live[e["id"]] = (e["addr"], e["size"])
        elif e["ev"] == "free":
            live.pop(e["id"], None)
        elif e["ev"] == "launch":
            ranges = (e.get("reads") or []) + (e.get("writes") or [])
            out.append((e["op"], e.get("site"), [s for _, s in e.get("reads") or []],
                        [s for _, s in e.get("writes") or []]))
            for addr, size in ranges:
                if not any(a <= addr and addr + size <= a + n for a, n in live.values()):
                    outside.append((e["op"], addr, size))
    return out, outside


def test_launches_from_the_recorder_are_the_dispatch_modes(tmp_path):
    """Level full on both paths (HAZSAN_NATIVE=0: the dispatch mode; 1: the recorder's RecordFunction
    observer): the same program output, the same launches in the same order (op, site, the sizes
    read and written), each range inside a block alive in its own trace, clean and complete."""
    seen = {}
    for native in ("0", "1"):
        traces = tmp_path / f"n{native}"
        out = _run(tmp_path, LAUNCHES, _env(traces, native=native, HAZSAN_LEVEL="full"))
        assert out.returncode == 0, out.stderr
        ((_, events),) = _trace(traces).items()
        numpy_memory = int((tmp_path / "numpy_memory").read_text())
        launches, outside = _launches(events, [(numpy_memory, 48)])
        assert outside == [], outside
        # the numpy array's memory is no allocation (docs/capture-details.md, "Storages that are
        # not allocations"): read where it is, in no block alive then, never adopted as a block
        live, reads = {}, 0
        for e in events[1:]:
            if e["ev"] == "alloc":
                live[e["id"]] = (e["addr"], e["size"])
            elif e["ev"] == "free":
                live.pop(e["id"], None)
            elif e["ev"] == "launch" and [numpy_memory, 48] in (e.get("reads") or []):
                reads += 1
                assert not [a for a, n in live.values() if a <= numpy_memory < a + n]
        assert reads == 3                  # f + 1, f * f, o.copy_(f)
        doc = _check(traces)
        assert doc["findings"] == [] and doc["summary"]["complete"] and doc["summary"]["hook_errors"] == 0
        seen[native] = (out.stdout, launches, events)
    assert seen["0"][0] == seen["1"][0]
    assert seen["0"][1] == seen["1"][1]
    ops = [op for op, *_ in seen["1"][1]]
    # decomposed where autograd runs, whole in inference mode; a number is no tensor read
    assert "aten.addmm.default" in ops and "aten.linear.default" in ops and "aten.softmax.int" in ops
    assert ("aten.add.out", "prog.py:12:<module>", [40], [40]) in seen["1"][1]
    assert any(site == "prog.py:21:work" for _, site, *_ in seen["1"][1])
    # the launch inside the scope reads the window's modelled placement, not the real address
    events = seen["1"][2][1:]
    (win,) = [e for e in events if e["ev"] == "window"]
    (add,) = [e for e in events if e["ev"] == "launch" and e.get("site") == "prog.py:35:<module>"]
    for addr, _ in add["reads"] + add["writes"]:
        assert win["addr"] <= addr < win["addr"] + win["size"]
    assert not [e for e in events if e["ev"] == "alloc" and e.get("op") == "adopted"]


BROADCASTS = """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)
    def broadcast_size(i):              # SGLang's broadcast_pyobj: a new size tensor per call
        size = torch.tensor([i], dtype=torch.long)
        dist.broadcast(size, src=0)
        return size.item()
    total = sum(broadcast_size(i) for i in range(40))
    dist.destroy_process_group()
    print(total)
"""


def test_a_collective_names_the_storage_it_was_given_not_a_dead_one_at_its_key(tmp_path):
    """Each new tensor's StorageImpl may sit where the last one's was, whose free is still pending
    in the recorder: a collective's buffer is the new block (drained before the lookup), and the
    read after it comes after its completion, on both levels."""
    for level in ("alloc", "full"):
        traces = tmp_path / level
        out = _run(tmp_path, BROADCASTS, _env(traces, HAZSAN_LEVEL=level))
        assert out.returncode == 0 and out.stdout.strip() == str(sum(range(40))), out.stderr
        ((_, events),) = _trace(traces).items()
        live, colls = {}, 0
        for e in events[1:]:
            if e["ev"] == "alloc":
                live[e["id"]] = (e["addr"], e["size"])
            elif e["ev"] == "free":
                live.pop(e["id"])
            elif e["ev"] == "coll":
                colls += 1
                for b in e["bufs"]:
                    assert any(a <= b["addr"] and b["addr"] + b["size"] <= a + n for a, n in live.values()), (level, e)
        assert colls == 40
        doc = _check(traces)
        assert doc["findings"] == [] and doc["summary"]["complete"], (level, doc["findings"][:2])


def test_a_build_that_fails_falls_back_and_the_program_runs(tmp_path):
    """HAZSAN_NATIVE=1 with nothing built and no working compiler: the program starts and runs,
    recorded by the dispatch mode; stderr and the header say why."""
    code = "import torch; x = torch.ones(10) * 2; print(x.sum().item())"
    env = _env(tmp_path / "t", HAZSAN_NATIVE_CACHE=tmp_path / "cache", CXX="/bin/false", CC="/bin/false")
    out = _run(tmp_path, code, env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "20.0", out.stderr
    assert "the native recorder is not used: build failed" in out.stderr
    ((_, events),) = _trace(tmp_path / "t").items()
    assert events[0]["hooks"]["alloc"]["source"] == "dispatch-mode"
    assert events[0]["hooks"]["alloc"]["native"].startswith("build failed")
    assert any(e["ev"] == "alloc" and e.get("shape") == [10] for e in events[1:])
    # auto (the default) never builds: it says the recorder is not built, and runs as well
    env = _env(tmp_path / "auto", native="auto", HAZSAN_NATIVE_CACHE=tmp_path / "cache2")
    out = _run(tmp_path, code, env)
    assert out.returncode == 0, out.stderr
    assert _said(out.stderr).startswith("hazsan: the native recorder is not used (not built"), out.stderr
    ((_, events),) = _trace(tmp_path / "auto").items()
    assert events[0]["hooks"]["alloc"]["native"].startswith("not built")
    assert not (tmp_path / "cache2").exists()


def test_records_beyond_the_buffer_are_counted_as_dropped(tmp_path):
    """No drain for a long loop (no Python event, the time flush 1000 s away) and a buffer of 500
    records: what did not fit is a `dropped` record, and the check says findings may be missing."""
    code = """
        import torch
        keep = [torch.ones(16) for _ in range(2000)]
        print("ok")
    """
    traces = tmp_path / "t"
    out = _run(tmp_path, code, _env(traces, HAZSAN_NATIVE_MAX_RECORDS=500, HAZSAN_FLUSH_SECONDS=1000))
    assert out.returncode == 0, out.stderr
    ((_, events),) = _trace(traces).items()
    dropped = [e for e in events[1:] if e["ev"] == "dropped"]
    assert dropped and dropped[0]["reason"] == "native-buffer-full" and sum(d["count"] for d in dropped) >= 1500
    doc = _check(traces)
    assert any("dropped" in w for w in doc["summary"]["warnings"]), doc["summary"]["warnings"]


KILLED = """
    import sys, time, torch, sanitizer
    t = torch.ones(32)
    for n in range(3):
        with sanitizer.step(n, phase="decode"):
            t = t * 2
    zs = [torch.ones(5) for _ in range(4)]                  # after the last step
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
"""


def test_sigkill_of_an_idle_process_loses_nothing(tmp_path):
    """The allocations after the last step are in the file before the header says it is
    complete (the writer drains the recorder before it settles)."""
    traces = tmp_path / "t"
    (tmp_path / "prog.py").write_text(textwrap.dedent(KILLED))
    proc = subprocess.Popen([sys.executable, "prog.py"], cwd=tmp_path, env=_env(traces, HAZSAN_FLUSH_SECONDS="0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(0.6)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    doc = _check(traces)
    assert doc["summary"]["complete"] is True, doc["summary"]
    ((_, events),) = _trace(traces).items()
    assert sum(1 for e in events[1:] if e["ev"] == "alloc" and e["size"] == 20 and e.get("site") == "prog.py:7:<listcomp>") == 4


STEPPING = """
    import json, sys, time, torch, sanitizer
    from sanitizer.capture import runtime
    writer = runtime.active().writer
    t = torch.ones(32)
    with sanitizer.step(0, phase="decode"):
        t = t * 2
    time.sleep(0.3)                    # the time flush has met its source (the recorder)
    kick = writer._timer_kick
    woken = []
    wait = kick.wait
    def counted(timeout):
        wait(timeout)
        woken.append(time.monotonic())
    kick.wait = counted
    start = time.monotonic()
    n = 1
    while time.monotonic() - start < 1.0:        # steps back to back, for one second
        with sanitizer.step(n, phase="decode"):
            for _ in range(20):
                t = (t * 1.0001).contiguous()
        n += 1
    ended = time.monotonic()
    during = sum(1 for w in woken if w < ended)
    while not writer.progress.get("quiet") and time.monotonic() - ended < 5:
        time.sleep(0.001)
    print(json.dumps({"steps": n, "woken_during_steps": during, "quiet_after": time.monotonic() - ended,
                      "quiet": writer.progress.get("quiet"), "timer_long": writer._timer_long}), flush=True)
"""


def test_the_time_flush_sleeps_while_steps_run_and_settles_after_the_last(tmp_path):
    """With the recorder, the time flush does not wake while steps run back to back (its idle watch
    looks without the GIL: every wake-up of the Python thread took the GIL from the step's thread),
    and still makes the file quiet soon after the last step ends (HAZSAN_IDLE_SECONDS)."""
    traces = tmp_path / "t"
    out = _run(tmp_path, STEPPING, _env(traces, HAZSAN_IDLE_SECONDS="0.05", HAZSAN_FLUSH_SECONDS="30"))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] > 50, got
    assert got["woken_during_steps"] <= 1, got          # the Python looks: 40 a second
    assert got["quiet"] is True and 0.04 <= got["quiet_after"] < 1.0, got
    assert got["timer_long"] is False, got              # no kick from the step hook either
    doc = _check(traces)
    assert doc["summary"]["complete"] is True and doc["summary"]["findings"] == 0, doc["summary"]


def test_without_the_recorder_the_time_flush_looks_for_idleness_itself(tmp_path):
    """The dispatch-mode path has no idle watch: the Python thread looks itself, less often while
    steps keep running (from idle/2 s up to 4 x idle s: about 5 a second, not 40), and the file is
    quiet within 5 x idle s after the last step."""
    traces = tmp_path / "t"
    out = _run(tmp_path, STEPPING, _env(traces, native="0", HAZSAN_IDLE_SECONDS="0.05", HAZSAN_FLUSH_SECONDS="30"))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert 2 <= got["woken_during_steps"] <= 12, got
    assert got["quiet"] is True and 0.04 <= got["quiet_after"] < 0.6, got


FORK = """
    import multiprocessing as mp, os, torch
    keep = torch.ones(111)
    def child():
        c = torch.ones(222)
        print("child", c.sum().item(), flush=True)
    if __name__ == "__main__":
        p = mp.get_context("fork").Process(target=child); p.start(); p.join()
        assert p.exitcode == 0
        after = torch.ones(333)
        print("parent", flush=True)
"""


def test_a_forked_child_records_its_own_allocations(tmp_path):
    traces = tmp_path / "t"
    out = _run(tmp_path, FORK, _env(traces))
    assert out.returncode == 0, out.stderr
    files = _trace(traces)
    assert len(files) == 2
    sizes = {}
    for f, events in files.items():
        sizes[events[0]["pid"]] = {e["size"] for e in events[1:] if e["ev"] == "alloc"}
    parent = [p for p, s in sizes.items() if 1332 in s]
    child = [p for p, s in sizes.items() if 888 in s]
    assert len(parent) == 1 and len(child) == 1 and parent != child
    assert 888 not in sizes[parent[0]] and 1332 not in sizes[child[0]]
    assert 444 in sizes[child[0]]       # the inherited tensor, declared again in the child's trace
    for f in files:
        assert _check(f.parent)["summary"]["hook_errors"] == 0


@pytest.mark.long
def test_the_mhc_decode_gets_the_same_verdict_on_both_paths(tmp_path):
    """The reference case (stock build, the colliding draft depth), captured at the default level
    (full: launches too) by the dispatch mode and by the native recorder: the same findings, rule
    by rule and site by site. (Its decode casts under inference mode: `aten::to.dtype`, a
    maybe-view op that copies, is a read and a write on both paths, issue 54.)"""
    result = {}
    for native in ("0", "1"):
        out_dir = tmp_path / f"native{native}"
        env = _env(out_dir, native=native, HAZSAN_TRACE_FORMAT="binary", HAZSAN_LEVEL="full")
        r = subprocess.run([sys.executable, "-m", "examples.mhc_decode.run", "--variant", "stock", "--depth", "4",
                            "--steps", "8", "--out", str(out_dir)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = _check(out_dir)
        result[native] = ({(f["rule"], f.get("site"), f["rank"], f.get("step")) for f in doc["findings"]},
                          doc["summary"]["by_rule"], doc["summary"]["complete"])
    assert result["0"][0], "the stock build's collision was not flagged"
    assert result["0"] == result["1"]


def test_a_redispatching_op_is_one_key_with_its_op():
    """The handlers cache per op (names, argument plans); the BackendSelect kernels hand them a
    new Redispatch per call, which must be the same key as its op, or the caches grow per call."""
    import torch

    from sanitizer.capture.native.backend_select import Redispatch
    op = torch.ops.c10d.allreduce_.default
    first, second = Redispatch(op, None), Redispatch(op, None)
    cache = {first: "plan"}
    assert cache[second] == "plan" and cache.get(op) == "plan" and {op: 1}[second] == 1
    assert first == op and op == second and str(first) == str(op)
    assert Redispatch(torch.ops.c10d.broadcast_.default, None) not in cache
